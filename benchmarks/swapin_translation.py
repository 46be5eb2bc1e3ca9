"""The swap-in copy of scattered host rows with cold and warm address translations.

Inside a decode step the copy of one layer's misses (``swap_in_copy``: zero-copy reads of
pinned host rows) runs between kernels that stream gigabytes of weights and KV through the
GPU, while an isolated copy (``bench_swapin``) runs between nothing. This benchmark copies
the same kind of misses (``--misses`` random rows of one request, page size 1, 1152-byte
MLA rows of one layer of a layer-first host pool) and, before each timed copy, touches
``--touch-gib`` of device memory (a ``fill_`` over that many bytes, outside the timed
interval): at 0 the host pages' translations stay cached from the previous copies; over
many GiB they are evicted, as in the decode. Each timed copy reads fresh rows (a new draw
per step). Also timed: the host allocation (the modes of ``alloc_pinned`` in
``hicache.host_pool``) and the copy's rows per program (``block_bytes``).

``us``: median of the CUDA-event intervals around the copy alone (a spin kernel queued
ahead of the first event keeps the host's launch out of the interval). ``gbps``: the rows' bytes
over that. ``anon_huge_mib``: the process's transparent huge pages after the allocation.

Usage: ``PYTHONPATH=. python benchmarks/swapin_translation.py`` on a GPU; writes
``results/swapin_translation.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from benchmarks.common import device_info, write_result

ROW_WORDS = 576  # bf16 values of a DeepSeek MLA latent row (512 + 64 RoPE)
SPIN_CYCLES = 400_000


def anon_huge_mib() -> float:
    """``AnonHugePages`` of this process (``/proc/self/smaps_rollup``) in MiB."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def system_settings() -> dict:
    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError as e:
            return f"unreadable: {e.strerror}"
    return {"thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "kernel_cmdline": read("/proc/cmdline"),
            "iommu_groups": len(os.listdir("/sys/kernel/iommu_groups")) if os.path.isdir("/sys/kernel/iommu_groups")
            else None}


def host_pool(alloc: str, layers: int, tokens: int) -> torch.Tensor:
    """A layer-first host view ``[tokens, 1, layers, 1, 1, 576] bf16`` over ``alloc``'s memory."""
    from hicache.host_pool import alloc_pinned
    raw = alloc_pinned(layers * tokens * ROW_WORDS * 2, alloc)
    base = raw.view(torch.bfloat16).view(layers, tokens, 1, 1, ROW_WORDS)
    base[:, :, 0, 0, :8].copy_(torch.arange(layers * tokens, dtype=torch.float32).view(layers, tokens, 1).to(
        torch.bfloat16))
    return base.permute(1, 0, 2, 3, 4).unsqueeze(1)


def run_case(src, dst, layer: int, misses: int, steps: int, touch: torch.Tensor, touch_bytes: int,
             block_bytes: int, gen: torch.Generator) -> dict:
    from sparsehi.kernels.swap_in_copy import swap_in_copy_triton
    dev = dst.device
    tokens, slots = src.shape[0], dst.shape[0]
    width = 2048
    host_pages = torch.arange(tokens, dtype=torch.int64, device=dev)[None, :]
    slot_pages = torch.arange(slots, dtype=torch.int32, device=dev)[None, :]
    rows = torch.zeros(1, dtype=torch.int64, device=dev)
    num_loads = torch.full((1,), misses, dtype=torch.int32, device=dev)
    times = []
    for step in range(steps + 3):
        ids = torch.randperm(tokens, generator=gen)[:misses].sort().values
        load_ids = torch.full((1, width), -1, dtype=torch.int32)
        load_ids[0, :misses] = ids.to(torch.int32)
        load_slots = torch.full((1, width), -1, dtype=torch.int32)
        load_slots[0, :misses] = torch.randperm(slots, generator=gen)[:misses].to(torch.int32)
        load_ids, load_slots = load_ids.to(dev), load_slots.to(dev)
        if touch_bytes:
            touch[:touch_bytes].fill_(step & 0xFF)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # a spin ahead of the first event: the copy's launch (host work) is queued before the
        # interval starts, which then holds GPU time only
        torch.cuda._sleep(SPIN_CYCLES)
        e0.record()
        swap_in_copy_triton(src, dst, layer, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, 1,
                            block_bytes=block_bytes)
        e1.record()
        torch.cuda.synchronize()
        if step >= 3:
            times.append(e0.elapsed_time(e1) * 1e3)
        got = dst[load_slots[0, :misses].long(), 0, layer, 0, 0, 0].float()
        want = (layer * tokens + ids.to(dev)).to(torch.bfloat16).float()
        if not torch.equal(got, want):
            raise RuntimeError("copied rows differ from the host rows")
    us = statistics.median(times)
    return {"us": round(us, 2), "gbps": round(misses * ROW_WORDS * 2 / us / 1e3, 2),
            "us_min": round(min(times), 2), "us_max": round(max(times), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--allocs", default="hugepage,register,torch")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--misses", default="177,1000")
    p.add_argument("--touch-gib", default="0,0.1,2,16")
    p.add_argument("--block-bytes", default="1152,2304,4096")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--out-dir", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("swapin_translation.py times a GPU copy from pinned host memory: run it on a CUDA machine")
    dev = torch.device("cuda")
    touches = [float(x) for x in a.touch_gib.split(",")]
    touch = torch.empty(int(max(touches) * (1 << 30)) + 1, dtype=torch.uint8, device=dev)
    dst = torch.zeros(4096, 1, a.layers, 1, 1, ROW_WORDS, dtype=torch.bfloat16, device=dev)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for alloc in a.allocs.split(","):
        before = anon_huge_mib()
        src = host_pool(alloc, a.layers, a.tokens)
        huge = anon_huge_mib() - before
        for misses in (int(x) for x in a.misses.split(",")):
            for tg in touches:
                for bb in (int(x) for x in a.block_bytes.split(",")):
                    r = run_case(src, dst, a.layers // 2, misses, a.steps, touch, int(tg * (1 << 30)), bb, gen)
                    row = {"alloc": alloc, "anon_huge_mib": round(huge, 1), "misses": misses, "touch_gib": tg,
                           "block_bytes": bb, **r}
                    print(row, flush=True)
                    rows.append(row)
        del src
    write_result("swapin_translation.json", {**device_info(), "system": system_settings(),
                                        "settings": vars(a), "rows": rows, "what": __doc__.split("\n\n")[0]},
                 a.out_dir)


if __name__ == "__main__":
    main()
