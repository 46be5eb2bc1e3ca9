"""Profile one sub-run of the ``gpu-realistic`` soak plan with cProfile: where its wall time
goes on the host (Python, waits for the device, locks), by own time and by cumulative time.

    PYTHONPATH=. python scripts/profile_soak_subrun.py quest-p16 --seconds 90 --device cuda
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from soak import realistic  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("subrun", choices=[s.name for s in realistic.SHAPES])
    ap.add_argument("--seconds", type=float, default=90.0, help="the sub-run's time budget")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=40, help="functions listed per ordering")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    subs = realistic.plan(requests=realistic.REQUESTS, scale=a.scale, device=a.device, seed=1,
                          l3_root=f"{realistic.default_l3_parent() or '/tmp'}/soak-profile")
    sub = next(s for s in subs if s.name == a.subrun)
    prof = cProfile.Profile()
    prof.enable()
    rec = realistic.run_subrun(sub, a.seconds, max(3.0, 0.05 * a.seconds))
    prof.disable()
    print({"subrun": sub.name, **{k: rec.result[k] for k in ("requests", "mismatched_tokens", "decode_steps")},
           **rec.timings})
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(a.top)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
