"""Host <-> device KV transfer bandwidth: the `kernel` (zero-copy Triton gather/scatter) and
`direct` (torch indexing + staged copies) io backends against one large pinned copy
measured in the same run.

Cases (one layer each, scattered distinct slots over a multi-GB host pool, >= 256 MiB per call):
  1152 B rows  — one MLA token (576 × bf16), page_size 1
  4096 B rows  — a 4 KiB token row, page_size 1
  256 KiB rows — one 64-token Llama-8B MHA page per layer (64 × 8 heads × 128 × 2 B × k,v)

Usage: PYTHONPATH=. python benchmarks/bench_transfer.py [--quick] [--sweep] [--host-gb 8]
Writes transfer.json (+ transfer.png) to --out (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, large_d2h_copy_gbps, large_h2d_copy_gbps, write_result
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kernels.kv_copy import KVCopyConfig
from hicache.kv_spec import KVCacheSpec
from hicache.transfer import KVTransferEngine

CASES = {
    # name: (spec, row_bytes label)
    "mla_token_1152B": (KVCacheSpec("mla", 1, 1, 576, torch.bfloat16, 1), 1152),
    "token_4KiB": (KVCacheSpec("mla", 1, 1, 2048, torch.bfloat16, 1), 4096),
    "mha_page64_256KiB": (KVCacheSpec("mha", 1, 8, 128, torch.bfloat16, 64), 256 * 1024),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median wall time of fn() incl. device completion: fair to both backends (direct
    spends part of its time on the CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(spec: KVCacheSpec, call_bytes: int, host_gb: float, layout: str, device: torch.device):
    """Device pool holding one call's rows (+ padding page) and a host pool of host_gb GB."""
    rows = max(1, call_bytes // spec.page_bytes_per_layer) * spec.page_size  # slots per call
    dev = DeviceKVPool(spec, rows + spec.page_size, device)
    host = HostKVPool(dev, hicache_size=host_gb, layout=layout)
    return dev, host, rows


def scattered_slots(pool_slots: int, n: int, page_size: int, g: torch.Generator) -> torch.Tensor:
    """n distinct slots in random page order (whole pages), page 0 excluded."""
    pages = torch.randperm(pool_slots // page_size - 1, generator=g)[: n // page_size] + 1
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def measure(eng: KVTransferEngine, host_idx, dev_idx, call_bytes: int, device, iters: int) -> dict[str, float]:
    h2d = wall_ms(lambda: eng.load_layer_now(0, host_idx, dev_idx), device, iters)
    d2h = wall_ms(lambda: eng.backup_layer_now(0, dev_idx, host_idx), device, iters)
    return {"h2d": call_bytes / (h2d * 1e-3) / 1e9, "d2h": call_bytes / (d2h * 1e-3) / 1e9}


def check_round_trip(eng: KVTransferEngine, dev: DeviceKVPool, host_idx, dev_idx) -> bool:
    """Backup then load over the benchmark's own index list must reproduce the rows."""
    probe = dev_idx[:4096]
    before = dev.kv_data[:, :, probe.to(dev.device)].clone()
    eng.backup_layer_now(0, dev_idx, host_idx)
    dev.kv_data.zero_()
    eng.load_layer_now(0, host_idx, dev_idx)
    _sync(dev.device)
    return bool(torch.equal(dev.kv_data[:, :, probe.to(dev.device)].view(torch.int16), before.view(torch.int16)))


SWEEP = [KVCopyConfig(flat=f, rows=r, num_warps=w) for f in (False, True) for r in (8, 32) for w in (4, 8)]


def run_variants(args, device, call_bytes: int, g: torch.Generator) -> list[dict]:
    """Kernel backend on scattered token rows: host allocation (4 KiB pages vs THP-advised)
    × index order (as given vs sorted by host slot)."""
    out = []
    for name in ("mla_token_1152B", "token_4KiB"):
        spec, row_bytes = CASES[name]
        for alloc in ("register", "hugepage"):
            os.environ["SPARSEHI_HOST_ALLOC"] = alloc
            dev, host, rows = build(spec, call_bytes, args.host_gb, "layer_first", device)
            nbytes = rows * spec.token_bytes_per_layer
            thp = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                        if ln.startswith("AnonHugePages")), "?") if Path("/proc/meminfo").exists() else "?"
            print(f"  host pool {host.nbytes() / 1e9:.1f} GB alloc={alloc} AnonHugePages={thp} kB", flush=True)
            hi = scattered_slots(host.num_slots, rows, 1, g).to(device)
            di = scattered_slots(dev.num_slots, rows, 1, g).to(device)
            for sort in (None, 1):
                eng = KVTransferEngine(dev, host, "kernel", sort_threshold=sort)
                bw = measure(eng, hi, di, nbytes, device, args.iters)
                out.append({"case": name, "row_bytes": row_bytes, "alloc": alloc, "sorted": sort is not None,
                            "h2d_gbps": round(bw["h2d"], 2), "d2h_gbps": round(bw["d2h"], 2)})
                print(f"  variant {name} alloc={alloc:8s} sorted={sort is not None!s:5} h2d {bw['h2d']:6.1f} "
                      f"d2h {bw['d2h']:6.1f}", flush=True)
            del dev, host, eng
            gc.collect()
        os.environ.pop("SPARSEHI_HOST_ALLOC", None)
    return out


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    call_bytes = args.call_mib << 20
    iters = args.iters
    g = torch.Generator().manual_seed(0)
    rows_out, sweep_out, checks = [], [], {}
    large = {"h2d": large_h2d_copy_gbps(), "d2h": large_d2h_copy_gbps()} if device.type == "cuda" else {"h2d": float("nan"), "d2h": float("nan")}
    print(f"device={device} large copy h2d={large['h2d']:.1f} GB/s d2h={large['d2h']:.1f} GB/s", flush=True)
    for name, (spec, row_bytes) in CASES.items():
        layouts = ["layer_first"] + (["page_first_direct"] if spec.page_size > 1 else [])
        for layout in layouts:
            dev, host, rows = build(spec, call_bytes, args.host_gb, layout, device)
            dev.kv_data.view(torch.int16).random_()
            nbytes = rows * spec.token_bytes_per_layer
            host_idx = scattered_slots(host.num_slots, rows, spec.page_size, g)
            dev_idx = scattered_slots(dev.num_slots, rows, spec.page_size, g)
            backends = ["kernel", "direct"] if layout == "layer_first" else ["direct"]
            for backend in backends:
                eng = KVTransferEngine(dev, host, backend, kernel_config=None)
                hi = host_idx.to(device)
                di = dev_idx.to(device)
                checks[f"{name}/{layout}/{backend}"] = check_round_trip(eng, dev, hi, di)
                bw = measure(eng, hi, di, nbytes, device, iters if backend == "kernel" else max(3, iters // 4))
                for direction in ("h2d", "d2h"):
                    rows_out.append({
                        "direction": direction, "backend": backend, "layout": layout, "row_bytes": row_bytes,
                        "case": name, "bytes_per_call": nbytes, "host_pool_gb": round(host.nbytes() / 1e9, 2),
                        "gbps": round(bw[direction], 2), "large_copy_gbps": round(large[direction], 2),
                        "fraction_of_large_copy": round(bw[direction] / large[direction], 3) if device.type == "cuda" else None,
                    })
                print(f"{name:20s} {layout:18s} {backend:6s} h2d {bw['h2d']:6.1f} GB/s  d2h {bw['d2h']:6.1f} GB/s"
                      f"  ok={checks[f'{name}/{layout}/{backend}']}", flush=True)
                if args.sweep and backend == "kernel" and spec.page_size == 1:
                    for cfg in SWEEP:
                        eng.kernel_config = cfg
                        bw = measure(eng, hi, di, nbytes, device, max(3, iters // 2))
                        sweep_out.append({"case": name, "flat": cfg.flat, "rows": cfg.rows, "num_warps": cfg.num_warps,
                                          "h2d_gbps": round(bw["h2d"], 2), "d2h_gbps": round(bw["d2h"], 2)})
                        print(f"   sweep flat={cfg.flat!s:5} rows={cfg.rows:3d} warps={cfg.num_warps} "
                              f"h2d {bw['h2d']:6.1f} d2h {bw['d2h']:6.1f}", flush=True)
                    eng.kernel_config = None
            del dev, host, eng
            gc.collect()
    variants = run_variants(args, device, call_bytes, g) if args.variants else []
    return {"rows": rows_out, "large_copy": large, "round_trip_ok": checks, "sweep": sweep_out, "variants": variants,
            "method": "median wall time per call incl. device sync; one layer; distinct random slots (whole "
                      "random pages for page_size 64) over a host pool of host_pool_gb GB; kernel via "
                      "load_layer_now/backup_layer_now (current stream), direct via the same calls"}


def plot(payload: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, direction in zip(axes, ("h2d", "d2h")):
        rows = [r for r in payload["rows"] if r["direction"] == direction]
        labels = sorted({(r["row_bytes"], r["case"]) for r in rows})
        series = sorted({(r["backend"], r["layout"]) for r in rows})
        width = 0.8 / max(1, len(series))
        for i, (backend, layout) in enumerate(series):
            ys = [next((r["gbps"] for r in rows if r["case"] == c and r["backend"] == backend and r["layout"] == layout), 0)
                  for _, c in labels]
            ax.bar([x + i * width for x in range(len(labels))], ys, width, label=f"{backend} ({layout})")
        ax.axhline(payload["large_copy"][direction], color="k", ls="--", label="one large pinned copy")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels([f"{b} B" if b < 65536 else f"{b // 1024} KiB page" for b, _ in labels])
        ax.set_title(f"{'host→device gather' if direction == 'h2d' else 'device→host scatter'}")
        ax.set_xlabel("row size")
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"KV transfer bandwidth — {payload.get('device', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU dry run)")
    p.add_argument("--sweep", action="store_true", help="also sweep kernel launch configs")
    p.add_argument("--variants", action="store_true", help="also compare host allocation / index order")
    p.add_argument("--host-gb", type=float, default=8.0)
    p.add_argument("--call-mib", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--plot-only", metavar="JSON", help="only redraw the plot from a result file")
    p.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = p.parse_args()
    if args.plot_only:
        import json
        src = Path(args.plot_only)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        return
    if args.quick:
        args.host_gb, args.call_mib, args.iters = 0.05, 2, 2
    payload = run(args)
    out_dir = Path(args.out or RESULTS_DIR)
    path = write_result("transfer.json" if not args.quick else "transfer_quick.json", payload, out_dir)
    print(f"wrote {path}")
    try:
        plot({**payload, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
             path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
    except ImportError as e:  # the GPU box may lack matplotlib; re-plot from the JSON with --plot-only
        print(f"plot skipped: {e}")


if __name__ == "__main__":
    main()
