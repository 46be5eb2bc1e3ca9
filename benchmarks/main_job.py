"""The main job (``sparsehi run``) at a long context, with its issue targets checked.

Runs ``sparsehi run --context N`` (every other option at its default: the built-in model,
batch 2, 64 decode tokens, all four modes; on CUDA the decode steps replay CUDA graphs)
and writes ``main_job_<N // 1024>k.json``: the run's report (tokens per second, hit rate,
bytes loaded, agreement per mode) and the two ratios the targets name, sparse-hier over
sparse-gpu (target >= 0.9) and sparse-hier over dense (target >= 1.0), measured in the
same run.

    PYTHONPATH=. python benchmarks/main_job.py --context 32768      # on a GPU
    PYTHONPATH=. python benchmarks/main_job.py --context 512 --quick  # CPU check of the script
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from sparsehi.cli import main as cli_main  # noqa: E402

DROP = ("tokens", "per_step")  # long per-token series: in the run's own run.json, not here


def ratios(rows: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """``{"sparse_hier_over_sparse_gpu", "sparse_hier_over_dense"}`` from the rows' decode
    tokens/s (None where a mode did not run)."""
    tps = {r["mode"]: r.get("decode_tokens_per_s") for r in rows}
    hier = tps.get("sparse-hier")

    def over(other: str) -> Optional[float]:
        o = tps.get(other)
        return round(hier / o, 3) if hier and o else None

    return {"sparse_hier_over_sparse_gpu": over("sparse-gpu"), "sparse_hier_over_dense": over("dense")}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768)")
    ap.add_argument("--quick", action="store_true", help="few decode tokens, to check the script on CPU")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = ap.parse_args(argv)
    extra = ["--decode-tokens", "4", "--batch", "2", "--modes", "dense,sparse-gpu,sparse-hier"] if args.quick else []
    with tempfile.TemporaryDirectory() as tmp:
        rc = cli_main(["run", "--context", str(args.context), "--output-dir", tmp, "--no-progress", *extra])
        if rc:
            raise SystemExit(f"sparsehi run exited with {rc}")
        run = json.loads((Path(tmp) / "run.json").read_text())
    r = ratios(run["rows"])
    hs, hd = r["sparse_hier_over_sparse_gpu"], r["sparse_hier_over_dense"]
    payload = {
        "what": f"the main job on this machine: `sparsehi run --context {args.context}` "
                f"({run['model']}, batch {run['batch']}, {run['decode_tokens']} decode steps)",
        "targets": {**r, "target_ge_0.9": None if hs is None else hs >= 0.9,
                    "target_ge_1.0": None if hd is None else hd >= 1.0},
        "run": {k: v for k, v in run.items() if k not in DROP},
    }
    path = write_result(f"main_job_{max(1, args.context // 1024)}k.json", payload, args.out)
    print(f"wrote {path}: sparse-hier / sparse-gpu {hs}, sparse-hier / dense {hd}", flush=True)
    return payload


if __name__ == "__main__":
    main()
