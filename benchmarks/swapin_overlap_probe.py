"""Can the misses' host -> GPU copy hide under the hits' sparse MLA attention?

At the dsv32 decode's shape (FP8 latent rows of 656 bytes, 128 heads, 2176 indices a row,
``NMISS`` misses a row and layer) this times, as CUDA-graph replays on one GPU:

- ``attn``: the attention over every index; ``copy``: the misses' copy (``swap_in_copy``);
- ``serial``: the copy, then the attention (what a layer does today);
- ``attn+miss``: the attention, then a second one over ``[B, 128]`` indices (the misses'
  own attention a split layer would add, without the merge);
- ``overlap_g{G}_bb{bytes}_{lo|hi}``: the copy on a side stream (``G`` programs a row or
  one a miss, ``bytes`` a program's block, low or high stream priority) beside the
  attention, then the misses' attention.

    PYTHONPATH=. python benchmarks/swapin_overlap_probe.py --batch 39 --misses 123 --out-dir DIR
"""
import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import graph_replay_best_us
from sparsehi.kernels.sparse_mla_decode import sparse_mla_decode
from sparsehi.kernels.swap_in_copy import swap_in_copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=39)
    ap.add_argument("--misses", type=int, default=123, help="misses a row (1..128)")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    args = ap.parse_args()
    if not 1 <= args.misses <= 128:
        ap.error(f"--misses must be in 1..128 (the misses' attention reads [B, 128] indices), got {args.misses}")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    B, H, DQ, DL, ROW = args.batch, 128, 576, 512, 656
    S, M, W, NMISS = 4096, 32768, 2176, args.misses
    nslots = B * S
    kv = torch.randint(0, 60, (nslots, ROW), dtype=torch.uint8, device=dev)
    # valid FP8 rows: scales (float32 at 512..528) = 1, rope bf16 = small
    kv[:, 512:528].view(torch.float32)[:] = 1.0
    kv[:, 528:].view(torch.bfloat16)[:] = 0.01
    host = torch.empty(B * M, ROW, dtype=torch.uint8).pin_memory()
    host.copy_(kv[:1].cpu().expand(B * M, ROW))
    q = (torch.randn(B, H, DQ, device=dev) * 0.1).to(torch.bfloat16)
    picks = torch.stack([torch.randperm(S, device=dev)[:W] for _ in range(B)])
    idx = (torch.arange(B, device=dev)[:, None] * S + picks).int()
    load_ids = torch.full((B, 2048), -1, dtype=torch.int32, device=dev)
    load_slots = torch.full((B, 2048), -1, dtype=torch.int32, device=dev)
    for b in range(B):
        load_ids[b, :NMISS] = torch.randperm(M, device=dev)[:NMISS].int()
        load_slots[b, :NMISS] = torch.randperm(S, device=dev)[:NMISS].int()
    num_loads = torch.full((B,), NMISS, dtype=torch.int32, device=dev)
    rows = torch.arange(B, device=dev)
    host_pages = (torch.arange(B, device=dev)[:, None] * M + torch.arange(M, device=dev)[None, :])
    slot_pages = (torch.arange(B, device=dev)[:, None] * S + torch.arange(S, device=dev)[None, :]).int()
    src = host.view(B * M, 1, 1, 1, 1, ROW)
    dst = kv.view(nslots, 1, 1, 1, 1, ROW)
    miss_idx = torch.full((B, 128), -1, dtype=torch.int32, device=dev)
    miss_idx[:, :NMISS] = slot_pages.gather(1, load_slots[:, :NMISS].long().clamp(min=0))[:, :NMISS]
    sm = DQ ** -0.5


    def attend(ix):
        return sparse_mla_decode(q, kv, ix, kv_lora_rank=DL, sm_scale=sm)


    def copy(g=None, bb=4096):
        swap_in_copy(src, dst, 0, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, 1,
                     block_bytes=bb, programs_per_row=g)


    side_lo = torch.cuda.Stream()
    side_hi = torch.cuda.Stream(priority=-1)


    def variant(name):
        if name == "attn":
            return lambda: attend(idx)
        if name == "copy":
            return lambda: copy()
        if name == "serial":
            return lambda: (copy(), attend(idx))
        if name == "attn+miss":
            return lambda: (attend(idx), attend(miss_idx))
        # overlap_g{g}_bb{bb}_{lo|hi}
        _, gs, bbs, pr = name.split("_")
        g = None if gs == "gdef" else int(gs[1:])
        bb = int(bbs[2:])
        st = side_hi if pr == "hi" else side_lo

        def f():
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                copy(g, bb)
            o = attend(idx)
            torch.cuda.current_stream().wait_stream(st)
            o2 = attend(miss_idx)
            return o, o2
        return f


    names = ["attn", "copy", "serial", "attn+miss"]
    for g in (1, 2, 4, 8):
        for bb in (4096, 16384, 65536):
            for pr in ("lo", "hi"):
                names.append(f"overlap_g{g}_bb{bb}_{pr}")
    names += ["overlap_gdef_bb4096_lo", "overlap_gdef_bb4096_hi"]
    res = {}
    for n in names:
        res[n] = round(graph_replay_best_us(variant(n)), 2)
        print(n, res[n], flush=True)
    (args.out_dir / f"overlap_probe_B{B}.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "B": B, "misses_per_row": NMISS, "us": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
