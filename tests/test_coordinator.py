"""SparseCoordinator end to end on a toy attention layer: prefill + decode steps in
hierarchical and gpu_only mode must give identical attention outputs, and each output
must equal attention over the ground-truth KV of the selected pages."""
from __future__ import annotations

import math

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from sparsehi.algorithms.registry import create_algorithm
from sparsehi.config import SparseConfig
from sparsehi.coordinator import SparseCoordinator
from sparsehi.forward_batch import ForwardBatch
from sparsehi.selection import SparseSelection

L, HKV, HQ, D = 3, 2, 4, 8


class ToyKV:
    """Ground truth: k/v of every (layer, request, position), q of every (layer, request, step)."""

    def __init__(self, n_req: int, max_len: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(L, n_req, max_len, HKV, D, generator=g)
        self.v = torch.randn(L, n_req, max_len, HKV, D, generator=g)
        # A slowly drifting query keeps adjacent selections overlapping (as real decoding does).
        base = torch.randn(L, n_req, HQ, D, generator=g) * 2
        self.q = base[:, :, None] + 0.6 * torch.randn(L, n_req, max_len, HQ, D, generator=g)


def expected_attention(kv: ToyKV, layer: int, reqs: list[int], q: torch.Tensor, sel, scale: float) -> torch.Tensor:
    out = []
    ps = sel.page_size
    for b, r in enumerate(reqs):
        n = int(sel.num_valid[b])
        ids = sel.logical_ids[b, :n].long()
        pos = (ids[:, None] * ps + torch.arange(ps)).reshape(-1)
        pos = pos[pos < int(sel.seq_lens[b])]
        k, v = kv.k[layer, r, pos], kv.v[layer, r, pos]  # [T, HKV, D]
        qg = q[b].view(HKV, HQ // HKV, D)
        att = torch.softmax(torch.einsum("grd,tgd->grt", qg, k) * scale, -1)
        out.append(torch.einsum("grt,tgd->grd", att, v).reshape(HQ, D))
    return torch.stack(out)


def run_mode(mode: str, cfg: SparseConfig, kv: ToyKV, prompts: list[int], steps: int, io_backend: str = "direct",
             device: str = "cpu", validate: bool = True, ascending: bool | None = None):
    spec = KVCacheSpec("mha", L, HKV, D, torch.float32, cfg.page_size)
    dev_pool = DeviceKVPool(spec, num_slots=cfg.page_size * 256, device=device)
    host_pool = (HostKVPool(dev_pool, hicache_ratio=2.0, pin_memory=device != "cpu")
                 if mode == "hierarchical" else None)
    algo = create_algorithm(cfg, device)
    if ascending is not None:  # False: the coordinator materialises (and sorts) the selection itself
        algo.selects_ascending = ascending
    transfer = None
    if host_pool is not None:
        from hicache.transfer import KVTransferEngine

        transfer = KVTransferEngine(dev_pool, host_pool, io_backend=io_backend)
    coord = SparseCoordinator(cfg, algo, dev_pool, mode=mode, host_pool=host_pool, transfer=transfer,
                              max_num_reqs=4, max_context_len=256, validate=validate)
    reqs = list(range(len(prompts)))
    for r in reqs:
        coord.on_request_begin(r)
    # prefill: the runtime allocates slots and writes the prompt's KV
    max_len = max(prompts)
    token_slots = torch.full((len(reqs), max_len), -1, dtype=torch.int64)
    for b, (r, n) in enumerate(zip(reqs, prompts)):
        token_slots[b, :n] = dev_pool.allocator.alloc(n)[:n]
    token_slots = token_slots.to(device)
    batch = ForwardBatch.prefill(torch.tensor(reqs, device=device), torch.tensor(prompts, dtype=torch.int32, device=device),
                                 token_slots)
    for layer in range(L):
        for b, (r, n) in enumerate(zip(reqs, prompts)):
            dev_pool.set_kv(layer, token_slots[b, :n], kv.k[layer, r, :n].to(device), kv.v[layer, r, :n].to(device))
        coord.attention_end(layer, batch)
    coord.forward_end(batch)
    outs, sels = [], []
    seq = list(prompts)
    scale = 1 / math.sqrt(D)
    for _ in range(steps):
        seq = [s + 1 for s in seq]
        batch = ForwardBatch.decode(torch.tensor(reqs, device=device), torch.tensor(seq, dtype=torch.int32, device=device))
        coord.forward_begin(batch)
        step_out = []
        for layer in range(L):
            pos = torch.tensor(seq) - 1
            q = kv.q[layer, reqs, pos].to(device)
            k, v = kv.k[layer, reqs, pos].to(device), kv.v[layer, reqs, pos].to(device)
            plan = coord.attention_begin(layer, batch, q=q)
            plan.write_kv(k, v)
            o = plan.attend(q, scale).cpu()
            sel_cpu = SparseSelection(*(t.cpu() for t in (plan.selection.logical_ids, plan.selection.physical_ids,
                                                          plan.selection.num_valid, plan.selection.seq_lens)),
                                      plan.selection.page_size, plan.selection.mode)
            exp = expected_attention(kv, layer, reqs, q.cpu(), sel_cpu, scale)
            torch.testing.assert_close(o, exp, atol=1e-4, rtol=1e-4)
            step_out.append(o)
            sels.append(plan.selection.logical_ids.cpu().clone())
            coord.attention_end(layer, batch, k=k, v=v)
        coord.forward_end(batch)
        outs.append(torch.stack(step_out))
    return coord, torch.stack(outs), sels


def _cfg(**kw) -> SparseConfig:
    base = dict(algorithm="oracle", page_size=4, top_k=16, device_buffer_size=24, sink_tokens=4,
                recent_tokens=8, dense_layers=(0,), min_sparse_prompt_len=0)
    base.update(kw)
    return SparseConfig(**base)


def test_hierarchical_matches_gpu_only_and_ground_truth():
    cfg = _cfg()
    kv = ToyKV(3, 256, seed=1)
    prompts = [61, 23, 100]  # sparse, dense-fitting (short), sparse
    c_h, out_h, sel_h = run_mode("hierarchical", cfg, kv, prompts, steps=22)
    c_g, out_g, sel_g = run_mode("gpu_only", cfg, kv, prompts, steps=22)
    assert all(torch.equal(a, b) for a, b in zip(sel_h, sel_g))
    torch.testing.assert_close(out_h, out_g, atol=1e-6, rtol=1e-6)
    st = c_h.stats()
    assert st["steps"] == 22
    assert st["misses"] > 0 and st["hits"] > 0  # loads really happened and buffers were reused
    assert st["per_layer_hit_rate"][0] == 1.0  # dense layer: nothing loaded
    # Sparse rows selected fewer pages than their context: the test exercises sparsity.
    last = sel_h[-1]
    assert int((last[2] >= 0).sum()) < -(-(100 + 22) // 4)


def test_quest_hierarchical_matches_gpu_only():
    cfg = _cfg(algorithm="quest", dense_layers=None)  # Quest's own dense layers (0, 1)
    kv = ToyKV(2, 256, seed=6)
    c_h, out_h, sel_h = run_mode("hierarchical", cfg, kv, [70, 45], steps=20)
    _, out_g, sel_g = run_mode("gpu_only", cfg, kv, [70, 45], steps=20)
    assert all(torch.equal(a, b) for a, b in zip(sel_h, sel_g))
    torch.testing.assert_close(out_h, out_g, atol=1e-6, rtol=1e-6)
    st = c_h.stats()
    assert st["per_layer_hit_rate"][:2] == [1.0, 1.0] and st["misses"] > 0


def run_mla(mode: str, cfg: SparseConfig, steps: int, seed: int = 8):
    """MLA latent cache (kv [slots, 1, C], value = kv[..., :R]) with token-wise selection."""
    C, RANK, H = 12, 8, 4
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(L, 1, 160, 1, C, generator=g)
    qs = torch.randn(L, 1, 160, H, C, generator=g) + 2 * torch.randn(L, 1, 1, H, C, generator=g)
    spec = KVCacheSpec("mla", L, 1, C, torch.float32, 1, kv_lora_rank=RANK)
    pool = DeviceKVPool(spec, 512, "cpu")
    host = HostKVPool(pool, hicache_ratio=2.0, pin_memory=False) if mode == "hierarchical" else None
    coord = SparseCoordinator(cfg, create_algorithm(cfg, "cpu"), pool, mode=mode, host_pool=host,
                              max_num_reqs=2, max_context_len=160)
    coord.on_request_begin(1)
    n = 40
    slots = pool.allocator.alloc(n)
    batch = ForwardBatch.prefill(torch.tensor([1]), torch.tensor([n], dtype=torch.int32), slots[None, :])
    for layer in range(L):
        pool.set_kv(layer, slots, lat[layer, 0, :n])
        coord.attention_end(layer, batch)
    coord.forward_end(batch)
    outs = []
    for t in range(n, n + steps):
        batch = ForwardBatch.decode(torch.tensor([1]), torch.tensor([t + 1], dtype=torch.int32))
        coord.forward_begin(batch)
        for layer in range(L):
            q, k = qs[layer, 0, t][None], lat[layer, 0, t][None]
            plan = coord.attention_begin(layer, batch, q=q)
            plan.write_kv(k)
            o = plan.attend(q, 0.3)
            assert o.shape == (1, H, RANK)
            outs.append(o)
            coord.attention_end(layer, batch, k=k)
        coord.forward_end(batch)
    return coord, torch.stack(outs)


@pytest.mark.parametrize("mode,io_backend,device", [
    ("hierarchical", "kernel", "cpu"), ("gpu_only", "direct", "cpu"),
    pytest.param("hierarchical", "kernel", "cuda", marks=pytest.mark.gpu),
    pytest.param("hierarchical", "direct", "cuda", marks=pytest.mark.gpu),  # diff, engine load, table: 3 launches
    pytest.param("gpu_only", "direct", "cuda", marks=pytest.mark.gpu)])
def test_kernels_choosing_rows_match_the_substituted_selection(mode, io_backend, device, monkeypatch):
    """Unchecked steps (as in a CUDA graph) hand the algorithm's Top-k and the rows' plain
    candidate lists to the LRU diff and the selection table, which choose per row; the
    earlier path materialised the choice first (what the coordinator still does for an
    algorithm whose ids need sorting). Same selections, same outputs, same hits and misses,
    with the Triton kernels on both paths (interpreted on CPU); a dense row (short prompt)
    and a row whose candidates fit in top-k for its first steps included."""
    if device == "cpu":
        if torch.cuda.is_available():
            pytest.skip("CPU tensors through the Triton interpreter")
        from sparsehi.kernels import lru_diff, selection_table, swap_in_fused

        for mod in (lru_diff, selection_table, swap_in_fused):  # these kernels interpreted, the rest in torch
            monkeypatch.setattr(mod, "dispatch", lambda kernel, probe, triton_impl, reference_impl, **kw: triton_impl)
    cfg = _cfg(algorithm="quest", dense_layers=(0,), min_sparse_prompt_len=20)
    kv = ToyKV(3, 256, seed=4)
    prompts = [61, 17, 26]  # sparse; a dense row; 7 pages (4 candidates: all fit in top-k), 8 from step 3
    runs = [run_mode(mode, cfg, kv, prompts, steps=5, io_backend=io_backend, device=device, validate=False,
                     ascending=a) for a in (True, False)]
    (c_new, out_new, sel_new), (c_old, out_old, sel_old) = runs
    assert all(torch.equal(a, b) for a, b in zip(sel_new, sel_old))
    assert torch.equal(out_new, out_old)
    n_sel = [int((s[2] >= 0).sum()) for s in sel_new[1::L]]  # layer 1 (sparse), row 2, per step
    assert n_sel[0] == 7 and n_sel[-1] < 8, n_sel  # every page first, a sparse selection later
    if mode == "hierarchical":
        new, old = c_new.stats(), c_old.stats()
        assert (new["hits"], new["misses"]) == (old["hits"], old["misses"]) and new["misses"] > 0


def test_mla_latent_cache_hierarchical_matches_gpu_only():
    cfg = _cfg(page_size=1, top_k=8, device_buffer_size=12, sink_tokens=2, recent_tokens=4, dense_layers=(2,))
    c_h, out_h = run_mla("hierarchical", cfg, steps=15)
    _, out_g = run_mla("gpu_only", cfg, steps=15)
    torch.testing.assert_close(out_h, out_g, atol=1e-6, rtol=1e-6)
    assert c_h.stats()["misses"] > 0


def test_token_mode_and_kernel_transfer():
    cfg = _cfg(page_size=1, top_k=6, device_buffer_size=8, sink_tokens=2, recent_tokens=3, dense_layers=())
    kv = ToyKV(2, 256, seed=2)
    _, out_h, sel_h = run_mode("hierarchical", cfg, kv, [30, 9], steps=20, io_backend="kernel")
    _, out_g, sel_g = run_mode("gpu_only", cfg, kv, [30, 9], steps=20)
    assert all(torch.equal(a, b) for a, b in zip(sel_h, sel_g))
    torch.testing.assert_close(out_h, out_g, atol=1e-6, rtol=1e-6)


def test_request_end_returns_host_kv_and_frees_buffers():
    cfg = _cfg()
    kv = ToyKV(1, 256, seed=3)
    coord, _, _ = run_mode("hierarchical", cfg, kv, [50], steps=3)
    pool = coord.device_pool
    free_before = pool.allocator.num_free_pages()
    out = coord.on_request_end(0)
    assert out.host_slots.shape == (53,)
    assert pool.allocator.num_free_pages() == free_before + cfg.sink_units + cfg.recent_units + cfg.buffer_units
    host = coord.host_pool
    for layer in range(L):
        k, v = host.read_tokens(layer, out.host_slots)
        torch.testing.assert_close(k, kv.k[layer, 0, :53])
        torch.testing.assert_close(v, kv.v[layer, 0, :53])
    with pytest.raises(ValueError, match="not a live request"):
        coord.on_request_end(0)


def test_bad_batches_are_rejected():
    cfg = _cfg()
    kv = ToyKV(1, 256, seed=4)
    coord, _, _ = run_mode("hierarchical", cfg, kv, [40], steps=1)
    with pytest.raises(ValueError, match="not a live request"):
        coord.forward_begin(ForwardBatch.decode(torch.tensor([3]), torch.tensor([10], dtype=torch.int32)))
    with pytest.raises(ValueError, match="previous length"):
        coord.forward_begin(ForwardBatch.decode(torch.tensor([0]), torch.tensor([60], dtype=torch.int32)))
    with pytest.raises(ValueError, match="mode"):
        ForwardBatch("verify", torch.tensor([0]), torch.tensor([3], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [4, 1])
def test_gpu_hierarchical_matches_gpu_only(page_size):
    if page_size == 1:
        cfg = _cfg(page_size=1, top_k=6, device_buffer_size=8, sink_tokens=2, recent_tokens=3, dense_layers=())
        prompts = [30, 9]
    else:
        cfg = _cfg()
        prompts = [61, 23, 100]
    kv = ToyKV(len(prompts), 256, seed=5)
    c_h, out_h, sel_h = run_mode("hierarchical", cfg, kv, prompts, steps=24, io_backend="kernel", device="cuda")
    _, out_g, sel_g = run_mode("gpu_only", cfg, kv, prompts, steps=24, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(sel_h, sel_g))
    torch.testing.assert_close(out_h, out_g, atol=1e-5, rtol=1e-5)
    assert c_h.stats()["misses"] > 0


def test_dense_layers_beyond_the_model_are_rejected():
    cfg = _cfg(dense_layers=(0, L))
    spec = KVCacheSpec("mha", L, HKV, D, torch.float32, cfg.page_size)
    pool = DeviceKVPool(spec, num_slots=cfg.page_size * 32, device="cpu")
    with pytest.raises(ValueError, match=r"SparseConfig\.dense_layers=\(0, 3\).*\[0, 3\)"):
        SparseCoordinator(cfg, create_algorithm(cfg, "cpu"), pool, mode="gpu_only", max_num_reqs=2, max_context_len=64)


def _tensor_state(obj) -> dict:
    out = {}
    for name, val in vars(obj).items():
        if isinstance(val, torch.Tensor):
            out[name] = val.clone()
        elif isinstance(val, dict):
            out.update({f"{name}[{k}]": t.clone() for k, t in val.items() if isinstance(t, torch.Tensor)})
    return out


def test_failed_backup_leaves_representations_unchanged(monkeypatch):
    cfg = _cfg(algorithm="quest", dense_layers=(0,))
    kv = ToyKV(1, 256, seed=11)
    coord, _, _ = run_mode("hierarchical", cfg, kv, [61], steps=2)
    seq = 64
    batch = ForwardBatch.decode(torch.tensor([0]), torch.tensor([seq], dtype=torch.int32))
    coord.forward_begin(batch)
    layer = 2
    q = kv.q[layer, [0], seq - 1]
    k, v = kv.k[layer, [0], seq - 1] * 5, kv.v[layer, [0], seq - 1]  # a key that moves Quest's page bounds
    plan = coord.attention_begin(layer, batch, q=q)
    plan.write_kv(k, v)
    before = _tensor_state(coord.algorithm)
    assert before, "the algorithm keeps its representations in tensors"

    def failing_backup(*a, **kw):
        raise RuntimeError("host backup failed")

    monkeypatch.setattr(coord.transfer, "backup_layer_now", failing_backup)
    with pytest.raises(RuntimeError, match="host backup failed"):
        coord.attention_end(layer, batch, k=k, v=v)
    after = _tensor_state(coord.algorithm)
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    monkeypatch.undo()
    coord.attention_end(layer, batch, k=k, v=v)  # the retry backs up and then updates
    after = _tensor_state(coord.algorithm)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_short_prompts_stay_dense_in_both_modes():
    """A request whose prompt is shorter than min_sparse_prompt_len attends every token of
    its context at every step (as in SGLang's sparse coordinator), long after its context
    has outgrown sink + top_k + recent; a longer prompt in the same batch decodes sparsely;
    hierarchical and gpu_only agree exactly (run_mode checks every output against attention
    over the ground-truth KV of what was selected)."""
    kv = ToyKV(2, 256, seed=12)
    cfg = _cfg(min_sparse_prompt_len=40)
    prompts, steps = [61, 23], 40  # the short request ends at 63 tokens: 16 pages > 1 + 4 + 2
    c_h, out_h, sel_h = run_mode("hierarchical", cfg, kv, prompts, steps=steps)
    c_g, out_g, sel_g = run_mode("gpu_only", cfg, kv, prompts, steps=steps)
    assert all(torch.equal(a, b) for a, b in zip(sel_h, sel_g))
    torch.testing.assert_close(out_h, out_g, atol=1e-6, rtol=1e-6)
    ps = cfg.page_size
    for i, sel in enumerate(sel_h):
        step = i // L
        short_pages = -(-(23 + step + 1) // ps)
        assert (sel[1, :short_pages] == torch.arange(short_pages)).all(), "the short prompt attends every page"
        assert int((sel[1] >= 0).sum()) == short_pages
    assert int((sel_h[-1][0] >= 0).sum()) < -(-(61 + steps) // ps)  # the long prompt decodes sparsely
    # the same short prompt without the threshold goes sparse once it outgrows the selection
    _, _, sel_0 = run_mode("gpu_only", _cfg(min_sparse_prompt_len=0), kv, prompts, steps=steps)
    assert int((sel_0[-1][1] >= 0).sum()) < -(-(23 + steps) // ps)


def test_buffer_fill_is_the_least_filled_lru_buffer_share():
    cfg = _cfg()
    kv = ToyKV(2, 256, seed=3)
    rows = torch.tensor([0, 1])
    fills = [run_mode("hierarchical", cfg, kv, [61, 100], steps=s)[0].buffer_fill(rows) for s in (1, 22)]
    # the first step's selection in some of the 6 LRU slots, all of them later
    assert 0.0 < fills[0] < 1.0
    assert fills[1] == 1.0
    c_g = run_mode("gpu_only", cfg, kv, [61, 100], steps=1)[0]
    assert c_g.buffer_fill(rows) == 1.0  # no LRU buffers
    assert run_mode("hierarchical", cfg, kv, [61, 100], steps=1)[0].buffer_fill(rows[:0]) == 1.0
