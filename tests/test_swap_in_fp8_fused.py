"""swap_in_fp8_copy_and_table: the dequantising copy of the misses out of FP8 host pages and
the selection table in one launch (Triton interpreted on CPU, native on GPU) equals, bit for
bit, swap_in_fp8_copy's reference followed by selection_table's, over two LRU-diff steps of
MHA page_first pages (misses, then hits and misses), a padding row whose load lists are not
empty, rows that read a RowChoice, and every copy program size; afterwards every selected
page of the buffer holds its host page dequantised."""
from __future__ import annotations

import pytest
import torch

from hicache.kernels.fp8_page_quantize import fp8_page_quantize_reference
from sparsehi.kernels.lru_diff_reference import lru_diff_reference
from sparsehi.kernels.selection_table import selection_table_reference
from sparsehi.kernels.swap_in_fp8 import swap_in_fp8_copy_reference
from sparsehi.kernels.swap_in_fp8_fused import (swap_in_fp8_copy_and_table_reference,
                                                swap_in_fp8_copy_and_table_triton, tokens_per_program)
from sparsehi.row_choice import RowChoice
from test_row_choice import split

DEVS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
L, NB, H, D = 2, 2, 2, 24  # MHA: k and v, two kv heads
R, M, S, K = 5, 16, 8, 6  # request rows, logical pages per row, buffer slots per row, top-k width
SINK, RECENT = 2, 3
ROWS = [3, -1, 0, 4]  # batch row 1 is padding
PAGES = [16, 0, 14, 11]  # pages in context per batch row


def _host(ps: int, device, seed: int = 1):
    """FP8 page records of ``R * M + 2`` host pages (page_first: ``HostKVPool.fp8_values`` /
    ``fp8_scales`` shapes), magnitudes spread over the heads so the scales differ."""
    g = torch.Generator().manual_seed(seed)
    n = R * M + 2
    x = torch.randn(n, L * NB, ps, H, D, generator=g) * torch.logspace(-3, 3, H)[:, None]
    q = torch.empty(x.shape, dtype=torch.uint8)
    s = torch.empty(n, L * NB, H)
    fp8_page_quantize_reference(x, q, s)
    host_pages = (torch.randperm(n - 1, generator=g)[: R * M] + 1).view(R, M)
    return q.view(n, L, NB, ps, H, D).to(device), s.view(n, L, NB, H).to(device), host_pages.to(device)


def _selections(seed: int):
    """Two steps of ascending selections ``[B, K] int32`` in ``[SINK, PAGES - RECENT)``; the
    second keeps half of the first's ids (hits) and draws new ones (misses)."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for step in range(2):
        topk = torch.full((len(ROWS), K), -1, dtype=torch.int32)
        valid = torch.zeros(len(ROWS), dtype=torch.int32)
        for b, n in enumerate(PAGES):
            if n == 0:
                continue
            cand = torch.arange(SINK, n - RECENT)
            v = min(K, cand.numel()) - b % 2
            if step and int(steps[0][1][b]):
                prev = steps[0][0][b, : steps[0][1][b]].long()
                keep = prev[torch.randperm(prev.numel(), generator=g)[: prev.numel() // 2]]
                rest = cand[~torch.isin(cand, keep)]
                ids = torch.cat([keep, rest[torch.randperm(rest.numel(), generator=g)[: v - keep.numel()]]])
            else:
                ids = cand[torch.randperm(cand.numel(), generator=g)[:v]]
            topk[b, :v] = ids.sort().values.int()
            valid[b] = v
        steps.append((topk, valid))
    return steps


def _tables(ps: int, device, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    pages = torch.tensor(PAGES, dtype=torch.int32)
    seq = ((pages - 1).clamp(min=0) * ps + 1 + torch.arange(len(ROWS)) % ps).int()
    slot_pages = (torch.randperm(R * S + 3, generator=g)[: R * S] + 1).view(R, S).int()
    sink_t = torch.randint(1, 50, (R, SINK), generator=g, dtype=torch.int32)
    ring_t = torch.randint(1, 50, (R, RECENT), generator=g, dtype=torch.int32)
    return tuple(t.to(device) for t in (pages, seq, slot_pages, sink_t, ring_t))


def _dequantised(values, scales, hp: int, layer: int) -> torch.Tensor:
    """``[page_size, buffers, heads, dim]`` float32: host page ``hp`` of ``layer``, dequantised."""
    q = values[hp, layer].view(torch.float8_e4m3fn).float()
    return (q * scales[hp, layer][:, None, :, None]).permute(1, 0, 2, 3)


def _same_table(got, want) -> None:
    for name in ("logical", "physical", "page_table", "num_valid", "attended"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype,ps,dev_page", [(torch.bfloat16, 4, 4), (torch.float32, 6, 1)])
@pytest.mark.parametrize("with_choice", [False, True])
def test_fused_launch_equals_the_copy_then_the_table(device, dtype, ps, dev_page, with_choice):
    layer = 1
    values, scales, host_pages = _host(ps, device)
    pages, seq, slot_pages, sink_t, ring_t = _tables(ps, device)
    rows = torch.tensor(ROWS, device=device)
    table_rows = rows.clamp(min=0)
    n_dev_pages = R * S + 4
    lru = [torch.full((R, S), -1, dtype=torch.int32, device=device) for _ in range(2)]
    lru.append(torch.full((R, M), -1, dtype=torch.int32, device=device))
    block_bytes = (1, 2 * D * torch.finfo(dtype).bits // 8, 4096)  # one token, two tokens, whole pages
    assert [-(-ps // tokens_per_program(ps, D, torch.finfo(dtype).bits // 8, bb)) for bb in block_bytes] == \
        [ps, -(-ps // 2), 1]
    devs = {bb: torch.full((n_dev_pages * ps // dev_page, dev_page, L, NB, H, D), 7.0, dtype=dtype, device=device)
            for bb in ("ref",) + block_bytes}
    loaded = []  # device pages the diff's misses of live rows name
    for step, (topk, valid) in enumerate(_selections(seed=2)):
        topk, valid = topk.to(device), valid.to(device)
        diff = lru_diff_reference(topk, valid, *lru, step + 1, rows=rows)
        assert int(diff.num_loads.sum()) > 0
        for b, r in enumerate(ROWS):
            if r >= 0:
                loaded += slot_pages[r, diff.load_slots[b, : int(diff.num_loads[b])].long()].tolist()
        if step == 0:  # the padding row's lists name real pages: the copy must skip the row
            diff.load_ids[1, :2], diff.load_slots[1, :2], diff.num_loads[1] = 0, 0, 2
        else:
            assert int(((diff.device_slots >= 0).sum(1) - diff.num_loads).sum()) > 0  # some hits
        kw = dict(sink=SINK, recent=RECENT, sink_table=sink_t, ring_table=ring_t, device_slots=diff.device_slots)
        copy = (layer, diff.load_ids, diff.load_slots, diff.num_loads, rows, host_pages, slot_pages)
        tail = (pages, seq, table_rows)
        swap_in_fp8_copy_reference(values, scales, devs["ref"], *copy)
        want = selection_table_reference(topk, valid, *tail, page_size=ps, topk_phys=diff.device_slots,
                                         slot_table=slot_pages, sink_table=sink_t, ring_table=ring_t,
                                         sink=SINK, recent=RECENT)
        sel, val, choice = topk, valid, None
        if with_choice:
            s, v, c = split(topk.cpu(), valid.cpu(), torch.tensor([True, False, False, True]), seed=5 + step)
            sel, val, choice = s.to(device), v.to(device), RowChoice(*(x.to(device) for x in (c.use, c.ids, c.count)))
        for bb in block_bytes:
            got = swap_in_fp8_copy_and_table_triton(values, scales, devs[bb], *copy, sel, val, *tail, **kw,
                                                    block_bytes=bb, choice=choice)
            assert torch.equal(devs[bb], devs["ref"]), (step, bb)
            _same_table(got, want)
        fused_ref = swap_in_fp8_copy_and_table_reference(values, scales, devs["ref"].clone(), *copy, sel, val, *tail,
                                                         **kw, choice=choice)
        _same_table(fused_ref, want)
    # every selected page of a live row holds its host page, dequantised; no other page, and
    # no other layer, was written
    flat = devs["ref"].view(n_dev_pages, ps, L, NB, H, D)
    for b, r in enumerate(ROWS):
        for j in range(SINK, SINK + int(valid[b])):
            lid, phys = int(want.logical[b, j]), int(want.physical[b, j])
            page = _dequantised(values, scales, int(host_pages[r, lid]), layer).to(dtype)
            assert torch.equal(flat[phys, :, layer], page), (b, lid)
    untouched = torch.ones(n_dev_pages, dtype=torch.bool, device=device)
    untouched[loaded] = False
    assert (flat[:, :, 0] == 7).all() and (flat[untouched] == 7).all() and not untouched.all()


@pytest.mark.parametrize("device", DEVS)
def test_bad_arguments_are_named(device):
    ps = 4
    values, scales, host_pages = _host(ps, device)
    pages, seq, slot_pages, sink_t, ring_t = _tables(ps, device)
    dev = torch.zeros(R * S + 4, ps, L, NB, H, D, dtype=torch.bfloat16, device=device)
    b = len(ROWS)
    z = torch.full((b, K), -1, dtype=torch.int32, device=device)
    n = torch.zeros(b, dtype=torch.int32, device=device)
    rows = torch.tensor(ROWS, device=device)
    kw = dict(sink=SINK, recent=RECENT, sink_table=sink_t, ring_table=ring_t, device_slots=z)

    def call(*, layer=0, scales_=scales, load_ids=z, table_rows=rows.clamp(min=0), **over):
        return swap_in_fp8_copy_and_table_triton(values, scales_, dev, layer, load_ids, z[: load_ids.shape[0]],
                                                 n[: load_ids.shape[0]], rows[: load_ids.shape[0]], host_pages,
                                                 slot_pages, z, n, pages, seq, table_rows, **(kw | over))

    call()  # the baseline arguments are accepted
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        call(layer=2)
    with pytest.raises(ValueError, match="scales must be float32"):
        call(scales_=scales.double())
    with pytest.raises(ValueError, match="block_bytes=0 is invalid"):
        call(block_bytes=0)
    with pytest.raises(ValueError, match="load_ids has 3 rows, topk 4"):
        call(load_ids=z[:3])
    with pytest.raises(ValueError, match="device_slots must be"):
        call(device_slots=z[:, :2])
    with pytest.raises(ValueError, match="table_rows must be"):
        call(table_rows=rows[:2])
    with pytest.raises(ValueError, match="ring_table must have recent=3 columns"):
        call(ring_table=ring_t[:, :2])


@pytest.mark.usefixtures("one_thread")
def test_the_decode_path_with_the_interpreted_launch_generates_what_fp8_sparse_gpu_does(monkeypatch):
    """sparse-hier with FP8 host KV, its per-layer copy + table launch on the Triton
    interpreter (the rest on the torch references), generates exactly the tokens of
    sparse-gpu over the same FP8-rounded KV (tests/test_fp8_host_kv.py runs every kernel
    natively on CUDA)."""
    if torch.cuda.is_available():
        pytest.skip("CPU tensors through the Triton interpreter")
    from sparsehi.config import SparseConfig
    from sparsehi.kernels import swap_in_fp8_fused
    from test_e2e import prompts_of
    from test_fp8_host_kv import model_for, run

    launches = []

    def interpreted(*a, **kw):
        launches.append(a[3])  # the layer
        return swap_in_fp8_copy_and_table_triton(*a, **kw)

    monkeypatch.setattr(swap_in_fp8_fused, "dispatch", lambda kernel, probe, triton_impl, reference_impl: interpreted)
    model = model_for("tiny-gqa")
    sc = SparseConfig(algorithm="quest", page_size=16, top_k=48, device_buffer_size=64, sink_tokens=16,
                      recent_tokens=16, min_sparse_prompt_len=0, io_backend="kernel", host_kv_dtype="fp8_e4m3")
    prompts = prompts_of((300, 333))
    hier = run(model, "sparse-hier", sc, prompts, steps=12)
    assert launches and hier.stats["misses"] > 0
    assert hier.tokens == run(model, "sparse-gpu", sc, prompts, steps=12).tokens
