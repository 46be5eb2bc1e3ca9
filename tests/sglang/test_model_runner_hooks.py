"""The plugin's model-runner and attention hooks over SGLang 0.5.23's real pools, batch
and attention layer (CPU): the hooked decode equals the runtime's ``sparse-hier`` decode
for the same K/V, queries and budgets; without the flags the hooks change nothing.
"""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

from contextlib import contextmanager  # noqa: E402

import torch  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402

from sparsehi.sglang_plugin import hooks  # noqa: E402
from sgl_kit import HKV, HQ, LORA, PS, ROPE, D, L, ReferenceHier, World, qkv, sparse_config  # noqa: E402


def _prefill(world: World, row: int, n: int, gen: torch.Generator):
    layers = qkv(n, gen, mla=world.mla)
    world.run(world.extend([row], [n]), layers)
    return [k for _, k, _ in layers], [v for _, _, v in layers]


@pytest.mark.parametrize("lookahead", [0, 1])
def test_hooked_decode_equals_runtime_sparse_hier(lookahead):
    """Also loading pages ahead (``--sparsehi-lookahead-tokens``): the same outputs."""
    cfg = sparse_config(lookahead_tokens=lookahead * PS)
    world, ref = World(cfg), ReferenceHier(cfg)
    gen = torch.Generator().manual_seed(0)
    lens = {1: 61, 2: 50}
    for row, n in lens.items():
        k_all, v_all = _prefill(world, row, n, gen)
        ref.prefill(row, k_all, v_all)
    assert not world.bridge.registered.any()  # extend forwards are SGLang's own
    rows = [1, 2]
    for _ in range(6):
        for r in rows:
            lens[r] += 1
        layers = qkv(len(rows), gen)
        fb = world.decode(rows, [lens[r] for r in rows])
        got = world.run(fb, layers)
        want = ref.decode(rows, layers)
        for i in range(L):
            assert got[i].shape == (len(rows), HQ * D)
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    b = world.bridge
    assert b.registered[[1, 2]].all() and b.registrations == 2  # at the first decode
    st = b.coord.stats()
    assert st["steps"] == 6 and st["misses"] > 0  # pages really came back from host
    assert ("ahead_loads" in st) == bool(lookahead)
    if lookahead:
        assert st["ahead_loads"] > 0  # pages were loaded ahead through the hooks
    # every token's KV is in the host pool at its SGLang slot (its radix cache can keep the
    # request), and of SGLang's pages only each row's newest token's is on the GPU
    for r in rows:
        vids = world.req_pool.req_to_token[r, : lens[r]].long()
        assert torch.equal(b.host_pool.read_tokens(1, vids[-1:])[0][0],
                           layers[1][1].view(len(rows), HKV, D)[rows.index(r)])
        assert (b.residency.v2p[vids[:-1]] == 0).all() and int(b.residency.v2p[vids[-1]]) > 0
    assert b.residency.counts()["resident"] == len(rows)


def test_hooked_mla_decode_equals_runtime_sparse_hier():
    """SGLang's MLA pool: the latent row is written, offloaded and attended through the dsa
    adapter; equal to the sparse-hier decode over hicache's MLA pool, and SGLang's own
    attention (its CPU backend) for a short request beside it is untouched."""
    cfg = sparse_config(backend="dsa")
    world, ref, plain = World(cfg, mla=True), ReferenceHier(cfg, mla=True), World(None, mla=True)
    gen = torch.Generator().manual_seed(6)
    k_all, v_all = _prefill(world, 1, 66, gen)
    ref.prefill(1, k_all, v_all)
    short = qkv(12, gen, mla=True)
    world.run(world.extend([2], [12]), short)
    plain.run(plain.extend([2], [12]), short, hooked=False)
    n, m = 66, 12
    for _ in range(3):
        n, m = n + 1, m + 1
        layers = qkv(2, gen, mla=True)
        got = world.run(world.decode([1, 2], [n, m]), layers)
        want = ref.decode([1], [(q[:1], k[:1], v[:1]) for q, k, v in layers])
        solo = plain.run(plain.decode([2], [m]), [(q[1:], k[1:], v[1:]) for q, k, v in layers], hooked=False)
        for i in range(L):
            assert got[i].shape == (2, HQ * LORA)
            torch.testing.assert_close(got[i][:1], want[i], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[i][1:], solo[i], rtol=1e-5, atol=1e-5)
    assert world.bridge.coord.stats()["misses"] > 0


def test_sglangs_triton_kernel_reads_the_rewritten_metadata():
    """SGLang's own Triton decode kernel (run by the Triton interpreter on CPU) over the
    kv_indptr / kv_indices our adapter rewrote gives the runtime's sparse-hier output."""
    cfg = sparse_config(backend="triton")
    world, ref = World(cfg), ReferenceHier(cfg)
    world.bridge.attend_with = "sglang_triton"
    gen = torch.Generator().manual_seed(5)
    k_all, v_all = _prefill(world, 1, 57, gen)
    ref.prefill(1, k_all, v_all)
    for n in (58, 59):
        layers = qkv(1, gen)
        got = world.run(world.decode([1], [n]), layers)
        want = ref.decode([1], layers)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)


def test_sparse_selection_differs_from_dense_and_dense_budget_equals_sglang():
    """With top-k below the context the hooked output is not SGLang's dense one (the path
    is really sparse); with top-k covering the context it equals SGLang's own attention."""
    gen = torch.Generator().manual_seed(1)
    for top_k, same in ((8, False), (96, True)):
        world = World(sparse_config(top_k=top_k, device_buffer_size=max(12, top_k), max_sparse_requests=1))
        plain = World(None)
        pre = qkv(70, gen)
        world.run(world.extend([1], [70]), pre)
        plain.run(plain.extend([1], [70]), pre, hooked=False)
        layers = qkv(1, gen)
        got = world.run(world.decode([1], [71]), layers)
        with_plain = plain.run(plain.decode([1], [71]), layers, hooked=False)  # SGLang alone
        for i in range(1, L):  # layer 0 is a dense layer in both cases
            close = torch.allclose(got[i], with_plain[i], rtol=1e-5, atol=1e-5)
            assert close == same, (top_k, i)
        torch.testing.assert_close(got[0], with_plain[0], rtol=1e-5, atol=1e-5)


def test_without_flags_hooks_are_no_ops():
    gen = torch.Generator().manual_seed(2)
    hooked, plain = World(None), World(None)
    assert hooked.bridge is None
    pre = qkv(45, gen)
    outs = [hooked.run(hooked.extend([1], [45]), pre), plain.run(plain.extend([1], [45]), pre, hooked=False)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    step = qkv(1, gen)
    a = hooked.run(hooked.decode([1], [46]), step)
    b = plain.run(plain.decode([1], [46]), step, hooked=False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for i in range(L):
        assert torch.equal(hooked.kv_pool.k_buffer[i], plain.kv_pool.k_buffer[i])


def test_short_request_takes_sglangs_path_next_to_a_sparse_one():
    """A prompt shorter than min_sparse_prompt_len is never registered; in a batch with a
    sparse request its rows get exactly SGLang's output."""
    cfg = sparse_config()
    world, plain = World(cfg), World(None)
    gen = torch.Generator().manual_seed(3)
    long_pre, short_pre = qkv(60, gen), qkv(20, gen)
    for w, hooked in ((world, True), (plain, False)):
        w.run(w.extend([1], [60]), long_pre, hooked=hooked)
        w.run(w.extend([2], [20]), short_pre, hooked=hooked)
    lens = [60, 20]
    for _ in range(3):
        lens = [n + 1 for n in lens]
        layers = qkv(2, gen)
        got = world.run(world.decode([1, 2], lens), layers)
        want = plain.run(plain.decode([1, 2], lens), layers, hooked=False)
        for i in range(L):
            torch.testing.assert_close(got[i][1], want[i][1], rtol=0, atol=0)
    assert world.bridge.registered[1] and not world.bridge.registered[2] and world.bridge.declined[2]
    # a batch of short rows only never reaches the coordinator
    steps = world.bridge.coord.stats()["steps"]
    layers = qkv(1, gen)
    lens[1] += 1
    got = world.run(world.decode([2], [lens[1]]), layers)
    want = plain.run(plain.decode([2], [lens[1]]), layers, hooked=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert world.bridge.coord.stats()["steps"] == steps


def test_freeing_the_row_ends_the_request():
    """SGLang frees a registered row and its slots: the coordinator's request ends (its
    buffer pages come back), no GPU page stays held, the virtual slots are all free."""
    world = World(sparse_config())
    b = world.bridge
    gen = torch.Generator().manual_seed(4)
    buffer_free = b.device_pool.allocator.num_free_pages()
    _prefill(world, 3, 48, gen)
    world.run(world.decode([3], [49]), qkv(1, gen))  # registers the prompt
    assert b.registered[3] and b.device_pool.allocator.num_free_pages() < buffer_free
    world.finish(3)
    assert not b.registered[3] and b.slot_of_row[3] == -1 and len(b.free_slots) == b.max_sparse
    assert b.device_pool.allocator.num_free_pages() == buffer_free
    assert b.residency.counts() == {"free": b.physical_pages, "resident": 0, "pinned": 0}
    assert world.alloc.available_size() == b.virtual_tokens
    b.residency.check()


def test_load_plugins_hooks_attention_and_the_request_pool():
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sparsehi.sglang_plugin import hooks

    assert hasattr(RadixAttention.forward, "__wrapped__")
    assert hasattr(ReqToTokenPool.free_rows, "__wrapped__") and hasattr(ReqToTokenPool.clear, "__wrapped__")
    seen = []
    hooks.register_hooks(type("Registry", (), {"register": staticmethod(lambda t, h, k: seen.append(t))}),
                         type("HookType", (), {"AFTER": 1, "AROUND": 2, "BEFORE": 3}))
    assert f"{hooks.MODEL_RUNNER}.alloc_memory_pool" in seen and f"{hooks.MODEL_RUNNER}._forward_raw" in seen


def test_a_failed_prefill_registers_nothing():
    world = World(sparse_config())
    b = world.bridge
    gen = torch.Generator().manual_seed(7)

    def broken(runner, fb):
        raise RuntimeError("model failed")

    fb = world.extend([1], [50])
    with pytest.raises(RuntimeError, match="model failed"):
        hooks.around_forward_raw(broken, world.runner, fb)
    assert not b.registered[1] and b.slot_of_row[1] == -1 and b.pinned_len[1] == 0
    assert b.residency.counts()["pinned"] == 0  # its pins were undone
    world.run(fb, qkv(50, gen))  # SGLang's retry of the same forward goes through
    world.run(world.decode([1], [51]), qkv(1, gen))
    assert world.bridge.registered[1]


def test_chunked_prefill_is_registered_once_at_the_first_decode():
    """A prompt prefilled in three chunks (SGLang's chunked prefill: each chunk an extend
    with the earlier chunks as its prefix) stays on the GPU while it is prefilled, each
    chunk written through to host; it is registered once, at its first decode forward, and
    then leaves the GPU; decode equals the runtime's sparse-hier decode of the whole prompt."""
    cfg = sparse_config()
    world, ref = World(cfg), ReferenceHier(cfg)
    b = world.bridge
    gen = torch.Generator().manual_seed(12)
    chunks = [qkv(24, gen), qkv(24, gen), qkv(17, gen)]
    done = 0
    for c in chunks:
        n = len(c[0][1])
        world.run(world.extend([1], [done + n], prefix=[done], prompts=[65]), c)
        done += n
        assert not b.registered[1] and b.registrations == 0
        assert b.slot_of_row[1] >= 0  # a sparse request from its first chunk on (representations built)
        assert b.residency.counts()["pinned"] == done
    ref.prefill(1, [torch.cat([c[i][1] for c in chunks]) for i in range(L)],
                [torch.cat([c[i][2] for c in chunks]) for i in range(L)])
    n = done
    for _ in range(4):
        n += 1
        layers = qkv(1, gen)
        got = world.run(world.decode([1], [n]), layers)
        want = ref.decode([1], layers)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    assert b.registrations == 1
    vids = world.req_pool.req_to_token[1, :65].long()
    for i in range(L):  # the host copy of the prompt, at its SGLang slots
        torch.testing.assert_close(b.host_pool.read_tokens(i, vids)[0],
                                   torch.cat([c[i][1] for c in chunks]).view(65, HKV, D))
    assert b.residency.counts()["resident"] == 1


def test_sglangs_own_quest_through_the_hooks_equals_the_runtime_path():
    """--sparsehi-algorithm naming SGLang's QuestAlgorithm: the model-runner hook builds it
    over SGLang's real pools (wrapped, unchanged), and the hooked decode equals the same
    algorithm in the hierarchical coordinator over our own pools, with pages loaded from host."""
    from sparsehi.sglang_plugin.sglang_algorithm import SGLangAlgorithm

    cfg = sparse_config(algorithm="sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm:QuestAlgorithm")
    world, ref = World(cfg), ReferenceHier(cfg)
    assert isinstance(world.bridge.algorithm, SGLangAlgorithm)
    gen = torch.Generator().manual_seed(3)
    lens = {1: 61, 2: 57}
    for row, n in lens.items():
        k_all, v_all = _prefill(world, row, n, gen)
        ref.prefill(row, k_all, v_all)
    rows = [1, 2]
    for _ in range(6):
        for r in rows:
            lens[r] += 1
        layers = qkv(len(rows), gen)
        got = world.run(world.decode(rows, [lens[r] for r in rows]), layers)
        want = ref.decode(rows, layers)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    assert world.bridge.coord.stats()["misses"] > 0


@pytest.fixture
def triton_kernels(monkeypatch):
    """The coordinator's kernels on their Triton path (interpreted on CPU), as on a GPU."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without CUDA)")
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")


launched: list[str] = []


@contextmanager
def triton_launches_unwatched(mode):
    """Pause ``mode`` (a TorchFunctionMode) inside Triton launches: the interpreter's own
    copies to NumPy are not what a GPU launch does."""
    import triton.runtime.interpreter as interp

    original = interp.InterpretedFunction.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            launched.append(getattr(self, "fn", self).__name__)
        with torch._C.DisableTorchFunction():
            return original(self, *args, **kwargs)

    interp.InterpretedFunction.run = run
    try:
        yield
    finally:
        interp.InterpretedFunction.run = original


@pytest.mark.parametrize("lookahead", [0, 1])
def test_layer_hook_makes_no_host_sync_on_the_capture_path(triton_kernels, lookahead):
    """The plugin's per-layer decode path (selection, LRU diff, swap-in from host, adapter
    metadata, attention, backup, representation update) with the Triton kernels, run on
    the path it takes under CUDA-graph capture: no torch call reads a tensor back to the
    host or has a data-dependent shape (what ``torch.cuda.set_sync_debug_mode`` would
    stop on a GPU). Only the model runner's hook, outside the layers, does host work.
    Also with a page loaded ahead per layer (the side stream's work runs in order here)."""
    from sparsehi.algorithms.graph_safety import HostSyncDetector, simulated_capture

    cfg = sparse_config(backend="triton", lookahead_tokens=lookahead * PS)
    world = World(cfg)
    gen = torch.Generator().manual_seed(11)
    lens = {1: 61, 2: 50}
    for row, n in lens.items():
        _prefill(world, row, n, gen)
    watched = []

    def model(runner, fb, layers):
        with forward_context(ForwardContext(attn_backend=world.backend)):
            world.backend.init_forward_metadata(fb)
            out = []
            detector = HostSyncDetector("RadixAttention.forward (sparsehi decode)")
            for i, (q, k, v) in enumerate(layers):
                with simulated_capture(), detector, triton_launches_unwatched(detector):
                    out.append(world.layers[i].forward(q, k, v, fb))
                watched.append(i)
            return out

    for _ in range(5):  # crosses a page boundary (page 4)
        for r in lens:
            lens[r] += 1
        layers = qkv(2, gen)
        fb = world.decode([1, 2], [lens[1], lens[2]])
        hooks.around_forward_raw(lambda runner, fb: model(runner, fb, layers), world.runner, fb)
    assert watched == list(range(L)) * 5
    assert world.bridge.coord.stats()["misses"] > 0  # the swap-in really loaded pages
    assert {"_lru_diff_kernel", "_swap_in_and_table_kernel"} <= set(launched), launched
    if lookahead:
        assert world.bridge.coord.stats()["ahead_loads"] > 0
        assert {"_fold_marks_kernel", "_swap_in_copy_kernel"} <= set(launched), launched
        return
    # the detector does watch this path: a planted read-back in the selection is caught
    from sparsehi.algorithms.graph_safety import CaptureUnsafe

    algo = world.bridge.coord.algorithm
    real = algo.retrieve_topk
    algo.retrieve_topk = lambda q, *a, **kw: (int(q.abs().sum()), real(q, *a, **kw))[1]
    lens[1] += 1
    lens[2] += 1
    layers = qkv(2, gen)
    with pytest.raises(CaptureUnsafe, match="retrieve_topk|lambda"):
        hooks.around_forward_raw(lambda runner, fb: model(runner, fb, layers), world.runner,
                                 world.decode([1, 2], [lens[1], lens[2]]))


def test_a_failed_registration_leaves_the_row_on_sglangs_path():
    """The registration at a row's first decode fails (here: the coordinator's adoption
    raises once): the row is not registered, the coordinator holds no request for it, and
    it decodes on SGLang's own path over its prompt, which stayed on the GPU — equal to a
    server without sparsehi."""
    world, plain = World(sparse_config()), World(None)
    b = world.bridge
    gen = torch.Generator().manual_seed(13)
    pre = qkv(50, gen)
    world.run(world.extend([1], [50]), pre)
    plain.run(plain.extend([1], [50]), pre, hooked=False)
    coord = b.coord
    real = coord.adopt_prompts

    def failing(*a, **kw):
        raise RuntimeError("buffer pages out of space")

    coord.adopt_prompts = failing
    for n in (51, 52):
        layers = qkv(1, gen)
        got = world.run(world.decode([1], [n]), layers)
        want = plain.run(plain.decode([1], [n]), layers, hooked=False)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-6, atol=1e-6)
    coord.adopt_prompts = real
    assert not b.registered[1] and b.declined[1] and b.registrations == 0
    assert coord.live_rows() == [] and len(b.free_slots) == b.max_sparse
    assert b.residency.counts()["pinned"] == 52  # SGLang decodes it: its whole context stays on the GPU


def test_mla_split_rope_form_equals_the_joined_row():
    """SGLang's DeepSeek attention hands MLA layers the latent q / k with their rope parts
    apart (``attn_mqa(q_nope, k_nope, k_nope, fb, q_rope=q_pe, k_rope=k_pe)``): the hooked
    decode joins them and equals the runtime's sparse-hier decode of the joined rows; other
    extra arguments (e.g. an attention sink) are refused by name."""
    cfg = sparse_config(backend="dsa")
    world, ref = World(cfg, mla=True), ReferenceHier(cfg, mla=True)
    gen = torch.Generator().manual_seed(14)
    k_all, v_all = _prefill(world, 1, 66, gen)
    ref.prefill(1, k_all, v_all)

    def split_model(layers, extra=None):
        def forward_raw(runner, fb):
            with forward_context(ForwardContext(attn_backend=world.backend)):
                world.backend.init_forward_metadata(fb)
                out = []
                for i, (q, k, _) in enumerate(layers):
                    q3 = q.view(q.shape[0], HQ, LORA + ROPE)
                    kw = dict(q_rope=q3[..., LORA:].reshape(q.shape[0], -1), k_rope=k[:, LORA:], **(extra or {}))
                    out.append(world.layers[i].forward(q3[..., :LORA].reshape(q.shape[0], -1), k[:, :LORA],
                                                       k[:, :LORA], fb, **kw))
                return out
        return forward_raw

    n = 66
    for _ in range(4):
        n += 1
        layers = qkv(1, gen, mla=True)
        got = hooks.around_forward_raw(split_model(layers), world.runner, world.decode([1], [n]))
        want = ref.decode([1], layers)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    assert world.bridge.coord.stats()["misses"] > 0
    with pytest.raises(NotImplementedError, match="attn_sink"):
        hooks.around_forward_raw(split_model(qkv(1, gen, mla=True), {"attn_sink": torch.zeros(HQ)}), world.runner,
                                 world.decode([1], [n + 1]))


@contextmanager
def attention_end_raising_at_layer_1(coord):
    """The coordinator's attention end raises at layer 1 (a fault part-way through a forward)."""
    real = coord.attention_end

    def failing(layer, *a, **kw):
        if layer == 1:
            raise RuntimeError("device fault")
        return real(layer, *a, **kw)

    coord.attention_end = failing
    try:
        yield
    finally:
        coord.attention_end = real


def test_a_decode_forward_raising_part_way_hands_its_rows_to_sglangs_path():
    """A decode forward raises after its first layers (here: the coordinator's attention end
    of layer 1): the rows of that step leave the coordinator (host pages given back) and
    are declined, so SGLang's retry of the step and the steps after it run SGLang's own
    attention over the KV its slots hold, equal to a server without sparsehi."""
    world, plain = World(sparse_config()), World(None)
    gen = torch.Generator().manual_seed(15)
    layers = qkv(50, gen)
    for w in (world, plain):
        w.run(w.extend([1], [50]), layers, hooked=w is world)
    layers = qkv(1, gen)
    for w in (world, plain):
        w.run(w.decode([1], [51]), layers, hooked=w is world)
    assert world.bridge.registered[1] and world.bridge.residency.counts()["resident"] == 1
    coord = world.bridge.coord
    step, fb = qkv(1, gen), world.decode([1], [52])
    with attention_end_raising_at_layer_1(coord), pytest.raises(RuntimeError, match="device fault"):
        world.run(fb, step)
    assert not world.bridge.registered[1] and world.bridge.declined[1]
    assert 1 not in coord.live_rows() and len(world.bridge.free_slots) == world.bridge.max_sparse
    assert world.bridge.residency.counts()["pinned"] == 52  # brought back to the GPU for SGLang's path
    for n in (52, 53):  # SGLang's retry of the step, then the next one
        layers = step if n == 52 else qkv(1, gen)
        got = world.run(fb if n == 52 else world.decode([1], [n]), layers)
        want = plain.run(plain.decode([1], [n]), layers, hooked=False)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("host_kv_dtype", ["auto", "fp8_e4m3"])
def test_a_raising_decode_forward_keeps_the_page_a_row_is_filling(host_kv_dtype):
    """With whole SGLang pages the newest page of a registered row is partly filled; an FP8
    host pool has no record of it yet (pages are stored once complete). When a decode
    forward raises and the row goes back to SGLang's path, that page must stay on the GPU
    with its KV (bf16 host pools hold every token, FP8 ones do not)."""
    world = World(sparse_config(host_kv_dtype=host_kv_dtype), sgl_page=PS)
    gen = torch.Generator().manual_seed(15)
    layers = qkv(50, gen)  # the last page holds positions 48 and 49 only
    world.run(world.extend([1], [50]), layers)
    keys = [k for _, k, _ in layers]
    step = qkv(1, gen)
    world.run(world.decode([1], [51]), step)  # registered; position 50 into the same page
    keys = [torch.cat([keys[i], step[i][1]]) for i in range(L)]
    bridge = world.bridge
    assert bridge.registered[1]
    with attention_end_raising_at_layer_1(bridge.coord), pytest.raises(RuntimeError, match="device fault"):
        world.run(world.decode([1], [52]), qkv(1, gen))
    assert bridge.declined[1] and not bridge.registered[1]
    vids = world.req_pool.req_to_token[1, 48:51].long()
    phys = bridge.residency.physical_slots(vids, PS)
    assert (phys >= 0).all()
    for i in range(L):
        got = bridge.device_pool.get_key_buffer(i)[phys].reshape(3, HKV * D)
        torch.testing.assert_close(got, keys[i][48:51], rtol=0, atol=0)
    # the pins: the whole context once, nothing left of the slot's own pin
    assert bridge.residency.counts()["pinned"] == -(-51 // PS)


def test_decode_batches_carry_the_schedulers_host_rows():
    """SGLang's ``ForwardBatch.init_new`` keeps ``req_pool_indices_cpu`` for extend batches
    only; the plugin's hook on it (applied by ``load_plugins()``) keeps the scheduler
    batch's copy on a decode batch of a runner with sparsehi on, which the bridge reads
    instead of the device tensor; a copy of another length (a batch padded since) is not
    used."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sparsehi.sglang_plugin.bridge_state import ROWS_CPU_ATTR, host_rows

    assert hasattr(ForwardBatch.init_new, "__wrapped__")
    world, plain = World(sparse_config()), World(None)
    fb = plain.decode([3, 1], [7, 9])
    assert not hasattr(fb, ROWS_CPU_ATTR)  # sparsehi off: nothing added
    fb = world.decode([3, 1], [7, 9])
    assert getattr(fb, ROWS_CPU_ATTR).tolist() == [3, 1] and fb.req_pool_indices_cpu is None
    fb.req_pool_indices = torch.tensor([5, 6])  # the device tensor is not read while the host copy fits
    assert host_rows(fb).tolist() == [3, 1]
    fb.req_pool_indices = torch.tensor([3, 1, 0])  # padded after init_new: the device tensor is read
    assert host_rows(fb).tolist() == [3, 1, 0]
    ext = world.extend([2], [8])
    hooks.after_forward_batch_init_new(ext, ForwardBatch, SimpleNamespace(req_pool_indices_cpu=torch.tensor([9])),
                                       world.runner)
    assert not hasattr(ext, ROWS_CPU_ATTR)  # SGLang's own copy is there


def test_admission_shut_for_lack_of_memory_opens_when_a_prompt_leaves_the_gpu():
    """SGLang stops admitting while ``running_batch.batch_is_full`` (a request did not fit)
    until a request leaves; with the plugin GPU memory also comes back when a prompt is
    registered, so the scheduler hook clears the flag in the forwards after that, and not
    otherwise."""
    from types import SimpleNamespace

    world = World(sparse_config())
    gen = torch.Generator().manual_seed(21)
    scheduler = SimpleNamespace(token_to_kv_pool_allocator=world.alloc)
    calls = []

    def original(sched, batch):
        calls.append(batch.batch_is_full)
        return None, batch

    full = SimpleNamespace(batch_is_full=True)
    hooks.around_get_new_batch_prefill(original, scheduler, full)
    assert calls == [True]  # nothing came back yet: SGLang's own decision stands
    _prefill(world, 1, 60, gen)
    world.run(world.decode([1], [61]), qkv(1, gen))  # registers: the prompt leaves the GPU
    hooks.around_get_new_batch_prefill(original, scheduler, full)
    assert calls[-1] is False and full.batch_is_full is False
    for n in range(62, 67):  # forwards later the host's count has caught up: the flag stays as SGLang sets it
        world.run(world.decode([1], [n]), qkv(1, gen))
    full.batch_is_full = True
    hooks.around_get_new_batch_prefill(original, scheduler, full)
    assert calls[-1] is True
