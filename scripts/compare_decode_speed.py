"""Decode speed of two source trees side by side on one GPU: ``benchmarks/bench_decode.py``
run in each tree in turn (old, new, then new, old, ... so that a slow drift of the device
weighs on both), and every row's tokens/s compared as new over old medians.

The old tree is a plain copy of an earlier commit (``git archive COMMIT | tar -x -C DIR``);
each run imports its own tree's code (``PYTHONPATH`` = the tree).

    mkdir -p /tmp/old && git archive 7519166 | tar -x -C /tmp/old
    PYTHONPATH=. python scripts/compare_decode_speed.py --old /tmp/old --rounds 2 \\
        --bench-args="--contexts 65536 --skip-b --skip-dsv32" --out benchmarks/results/decode_path_speed.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RowKey = tuple[str, str, str, int, int]
"""(mode, scenario, query source, context, batch) of a ``decode.json`` row: one context and
batch has a row per query source (``trace85`` and the model's own queries)."""


def row_key(row: dict[str, Any]) -> RowKey:
    return (row["mode"], str(row.get("scenario", "")), str(row.get("trace_source", "")), int(row["context"]),
            int(row["batch"]))


def run_bench(tree: Path, bench_args: list[str]) -> list[dict[str, Any]]:
    """One ``bench_decode`` run in ``tree``; its result rows."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, "benchmarks/bench_decode.py", *bench_args, "--out", out], cwd=tree,
                       env=env, check=True)
        return json.loads((Path(out) / "decode.json").read_text())["rows"]


def compare(old_runs: list[list[dict]], new_runs: list[list[dict]], tolerance: float = 0.03) -> dict[str, Any]:
    """Per row present in every run: the old and new tokens/s of each run, the ratio of the
    medians; and per (mode, scenario, context) whether batch 1 and the best batch (the new
    tree's fastest) are within ``tolerance``."""
    def by_key(runs: list[list[dict]]) -> dict[RowKey, list[float]]:
        out: dict[RowKey, list[float]] = {}
        for rows in runs:
            for r in rows:
                if r.get("tokens_per_s"):
                    out.setdefault(row_key(r), []).append(float(r["tokens_per_s"]))
        return {k: v for k, v in out.items() if len(v) == len(runs)}

    old, new = by_key(old_runs), by_key(new_runs)
    rows = {}
    for k in sorted(old.keys() & new.keys()):
        ratio = statistics.median(new[k]) / statistics.median(old[k])
        rows[" ".join(map(str, k))] = {"key": list(k), "old": old[k], "new": new[k], "new_over_old": round(ratio, 4)}
    checks = {}
    for group in sorted({tuple(v["key"][:4]) for v in rows.values()}):
        members = [v for v in rows.values() if tuple(v["key"][:4]) == group]
        best = max(members, key=lambda v: statistics.median(v["new"]))
        for name, v in (("batch 1", next((m for m in members if m["key"][4] == 1), None)), ("best batch", best)):
            if v is not None:
                checks[f"{' '.join(map(str, group))} {name} (B={v['key'][4]})"] = {
                    "new_over_old": v["new_over_old"], "within": abs(v["new_over_old"] - 1.0) <= tolerance}
    return {"rows": rows, "checks": checks, "tolerance": tolerance,
            "all_within": bool(checks) and all(c["within"] for c in checks.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the old tree (a copy of the earlier commit)")
    ap.add_argument("--new", type=Path, default=Path("."), help="the new tree (default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree")
    ap.add_argument("--bench-args", default="--contexts 65536 --skip-b --skip-dsv32",
                    help="arguments of benchmarks/bench_decode.py, quoted, after an = sign (--bench-args=\"--quick\")")
    ap.add_argument("--old-name", default=None, help="the old commit, for the record")
    ap.add_argument("--new-name", default=None, help="the new commit, for the record")
    ap.add_argument("--out", type=Path, default=None, help="result file (default: print only)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    for name in ("old", "new"):
        if not (getattr(a, name) / "benchmarks" / "bench_decode.py").is_file():
            ap.error(f"--{name} {getattr(a, name)} holds no benchmarks/bench_decode.py")
    bench_args = shlex.split(a.bench_args)
    old_runs, new_runs, order = [], [], []
    for i in range(a.rounds):
        for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
            rows = run_bench((a.old if which == "old" else a.new).resolve(), bench_args)
            (old_runs if which == "old" else new_runs).append(rows)
            order.append(which)
    result = {"date": datetime.date.today().isoformat(), "bench_args": a.bench_args, "order": order,
              "old": a.old_name, "new": a.new_name, **compare(old_runs, new_runs)}
    print(json.dumps(result["checks"], indent=1))
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
