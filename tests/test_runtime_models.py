"""Runtime models: configs, RoPE, the MLA absorbed form, the peaky init, HF weight loading,
and the dense / offload-full KV caches against a cache-free recomputation."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from sparsehi.config import SparseConfig
from sparsehi.runtime.attention import causal_attention
from sparsehi.kernels.rope import rope_reference as apply_rope
from sparsehi.runtime.layers import rope_cos_sin
from sparsehi.runtime.model_config import BUILTIN_CONFIGS, ModelConfig, get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig, parse_modes
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model, load_hf_model


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(name: str, layers: int = 2) -> ModelConfig:
    return get_model_config(name, num_layers=layers)


def full_attention_fn(cfg: ModelConfig):
    """AttentionFn of a cache-free forward over a whole sequence (positions 0..T-1)."""
    def attn(layer, q, k, v, extra):
        if v is None:
            v = k[..., : cfg.kv_lora_rank]
        return causal_attention(q, k, v, cfg.sm_scale, 0)
    return attn


def greedy_no_cache(model, prompt: list[int], steps: int) -> list[int]:
    """Reference generation: recompute the whole sequence every step (no KV cache)."""
    seq = list(prompt)
    out = []
    for _ in range(steps + 1):
        ids = torch.tensor(seq)
        h = model(ids, torch.arange(len(seq)), full_attention_fn(model.cfg))
        t = int(model.logits(h[-1:]).argmax(-1)[0])
        out.append(t)
        seq.append(t)
    return out


# ----------------------------------------------------------------------------- configs
def test_builtin_configs_have_the_stated_shapes():
    ll = BUILTIN_CONFIGS["llama-8b-shape"]
    assert (ll.num_heads, ll.num_kv_heads, ll.head_dim, ll.num_layers) == (32, 8, 128, 32)
    ds = BUILTIN_CONFIGS["dsv32-shape"]
    assert (ds.num_heads, ds.kv_lora_rank, ds.qk_rope_head_dim, ds.index_head_dim, ds.index_n_heads) == (128, 512, 64, 128, 64)
    assert ds.cache_head_dim == 576 and ds.attention == "mla"
    for cfg in BUILTIN_CONFIGS.values():
        assert cfg.note


def test_bad_config_values_raise_valueerror():
    with pytest.raises(ValueError, match="family"):
        replace(BUILTIN_CONFIGS["tiny-gqa"], family="rnn")
    with pytest.raises(ValueError, match="num_kv_heads"):
        replace(BUILTIN_CONFIGS["tiny-gqa"], num_kv_heads=3)
    with pytest.raises(ValueError, match="allowed"):
        get_model_config("gpt-5")
    with pytest.raises(ValueError, match="mode"):
        RuntimeConfig(mode="sparse")
    with pytest.raises(ValueError, match="unknown"):
        parse_modes("dense,fast")


# ----------------------------------------------------------------------------- rope
def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 16, generator=g)
    k = torch.randn(1, 2, 16, generator=g)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq, sq = rope_cos_sin(torch.tensor([pq]), 16, 1e4)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 16, 1e4)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum(-1)

    torch.testing.assert_close(score(10, 3), score(107, 100), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(10, 3), score(10, 9), atol=1e-3)
    c, s = rope_cos_sin(torch.tensor([5]), 16, 1e4)
    torch.testing.assert_close(apply_rope(q, c, s).norm(dim=-1), q.norm(dim=-1))


# ----------------------------------------------------------------------------- models
def test_random_init_is_deterministic_and_seeded():
    a = build_model(config=tiny("tiny-gqa"))
    b = build_model(config=tiny("tiny-gqa"))
    c = build_model(config=replace(tiny("tiny-gqa"), seed=1))
    assert torch.equal(a.layers[1].self_attn.k_proj.weight, b.layers[1].self_attn.k_proj.weight)
    assert not torch.equal(a.layers[1].self_attn.k_proj.weight, c.layers[1].self_attn.k_proj.weight)


def _attention_mass_top_pages(cfg: ModelConfig, S: int = 512, ps: int = 16) -> float:
    """Mean share of the last query's attention (self page excluded) in its top 1/8 pages."""
    model = build_model(config=cfg)
    ids = torch.randint(0, cfg.vocab_size, (S,), generator=torch.Generator().manual_seed(0))
    shares = []

    def attn(layer, q, k, v, extra):
        group = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[-1], kk) * cfg.sm_scale, -1)
        pages = p[:, : S - ps].reshape(p.shape[0], -1, ps).sum(-1)
        pages = pages / pages.sum(-1, keepdim=True)
        shares.append(pages.topk(pages.shape[1] // 8, -1).values.sum(-1).mean().item())
        return causal_attention(q, k, v, cfg.sm_scale, 0)

    with torch.no_grad():
        model(ids, torch.arange(S), attn)
    return sum(shares) / len(shares)


def test_tied_qk_init_makes_attention_peaky():
    peaky = _attention_mass_top_pages(tiny("tiny-gqa"))
    flat = _attention_mass_top_pages(replace(tiny("tiny-gqa"), qk_tie=0.0, qk_gain=1.0))
    assert peaky > 0.8, peaky
    assert flat < 0.5, flat


def test_mla_absorbed_attention_equals_naive_multi_head_form():
    cfg = tiny("tiny-dsa", layers=1)
    model = build_model(config=cfg)
    a = model.layers[0].self_attn
    H, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    T = 24
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(3))
    got = {}

    def attn(layer, q, kv, v, extra):
        o = causal_attention(q, kv, kv[..., :r], cfg.sm_scale, 0)
        got["q"], got["kv"], got["o"] = q, kv, o
        return o

    with torch.no_grad():
        h = model.embed_tokens(ids)
        model(ids, torch.arange(T), attn)
        x = model.layers[0].input_layernorm(h)
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))).view(T, H, dn + dr)
        w = a.kv_b_proj.weight.view(H, dn + dv, r)
        c = got["kv"][:, 0, :r]
        k_nope = torch.einsum("tc,hnc->thn", c, w[:, :dn])
        vals = torch.einsum("tc,hvc->thv", c, w[:, dn:])
        q_pe = got["q"][..., r:]
        k_pe = got["kv"][:, :, r:].expand(T, H, dr)
        qf = torch.cat([q[..., :dn], q_pe], -1)
        kf = torch.cat([k_nope, k_pe], -1)
        naive = causal_attention(qf, kf, vals, cfg.sm_scale, 0)
        absorbed = torch.einsum("thc,hvc->thv", got["o"], w[:, dn:])
    torch.testing.assert_close(absorbed, naive, rtol=1e-4, atol=1e-4)


def test_mla_model_exposes_indexer_outputs():
    cfg = tiny("tiny-dsa", layers=1)
    model = build_model(config=cfg)
    seen = {}

    def attn(layer, q, kv, v, extra):
        seen.update(extra)
        return causal_attention(q, kv, kv[..., : cfg.kv_lora_rank], cfg.sm_scale, 0)

    with torch.no_grad():
        model(torch.arange(10), torch.arange(10), attn)
    assert seen["index_q"].shape == (10, cfg.index_n_heads, cfg.index_head_dim)
    assert seen["index_k"].shape == (10, cfg.index_head_dim)
    assert seen["index_w"].shape == (10, cfg.index_n_heads)


def test_mla_forward_without_the_indexer_gives_the_attention_the_same_inputs():
    cfg = tiny("tiny-dsa", layers=2)
    model = build_model(config=cfg)
    ids, pos = torch.arange(7, 19), torch.arange(12)
    runs = {}
    for with_indexer in (True, False):
        seen = runs[with_indexer] = []

        def attn(layer, q, kv, v, extra, seen=seen):
            seen.append((q.clone(), kv.clone(), sorted(extra)))
            return causal_attention(q, kv, kv[..., : cfg.kv_lora_rank], cfg.sm_scale, 0)

        with torch.no_grad():
            seen.append(model(ids, pos, attn, with_indexer=with_indexer))
    assert [e for _, _, e in runs[True][:-1]] == [["index_k", "index_q", "index_w"]] * 2
    assert [e for _, _, e in runs[False][:-1]] == [[], []]
    for (qa, kva, _), (qb, kvb, _) in zip(runs[True][:-1], runs[False][:-1]):
        torch.testing.assert_close(qb, qa, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kvb, kva, rtol=0, atol=0)
    torch.testing.assert_close(runs[False][-1], runs[True][-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,indexer_runs", [("dense", False), ("offload-full", False), ("sparse-gpu", True)])
def test_only_a_mode_that_selects_runs_the_mla_indexer(mode, indexer_runs, monkeypatch):
    import sparsehi.runtime.mla_model as mla_model

    model = build_model(config=tiny("tiny-dsa"))
    calls = []
    real = mla_model.dsa_index_inputs

    def counted(*args, **kwargs):  # the indexer's own step, called through
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_model, "dsa_index_inputs", counted)
    sc = SparseConfig(algorithm="dsa", page_size=1, top_k=16, device_buffer_size=32, min_sparse_prompt_len=0)
    rt = RuntimeConfig(mode=mode, sparse=sc, max_num_reqs=1, max_context_len=64)
    ModelRunner(model, rt).generate([list(range(40))], 3)
    assert bool(calls) == indexer_runs


def test_mla_forward_equals_its_unfused_form():
    # the model stacks projections into two GEMMs, rotates RoPE columns in place and fuses
    # each residual add with the next norm; here every step is its own module call
    cfg = tiny("tiny-dsa", layers=2)
    model = build_model(config=cfg)
    H, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    T = 12
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(3, 3 + T)
    seen = []

    def attn(layer, q, kv, v, extra):
        seen.append((q.clone(), kv.clone(), {k: t.clone() for k, t in extra.items()}))
        return causal_attention(q, kv, kv[..., :r], cfg.sm_scale, 0)

    with torch.no_grad():
        out = model(ids, pos, attn)
        cos, sin = rope_cos_sin(pos, dr, cfg.rope_theta)
        h = model.embed_tokens(ids)
        for i, layer in enumerate(model.layers):
            a, ix = layer.self_attn, layer.indexer
            x = layer.input_layernorm(h)
            cq = a.q_a_layernorm(a.q_a_proj(x))
            q = a.q_b_proj(cq).view(T, H, dn + dr)
            kv_a = a.kv_a_proj_with_mqa(x)
            w = a.kv_b_proj.weight.view(H, dn + dv, r)
            q_full = torch.cat([torch.einsum("thn,hnc->thc", q[..., :dn], w[:, :dn]),
                                apply_rope(q[..., dn:], cos, sin)], -1)
            kv = torch.cat([a.kv_a_layernorm(kv_a[:, :r])[:, None], apply_rope(kv_a[:, None, r:], cos, sin)], -1)
            iq = ix.wq_b(cq).view(T, Hi, Di)
            iq = torch.cat([apply_rope(iq[..., :dr], cos, sin), iq[..., dr:]], -1)
            ik = ix.k_norm(ix.wk(x))
            ik = torch.cat([apply_rope(ik[:, None, :dr], cos, sin)[:, 0], ik[:, dr:]], -1)
            iw = ix.weights_proj(x).float() * (Hi ** -0.5) * (Di ** -0.5)
            got_q, got_kv, got_extra = seen[i]
            for name, want, got in (("q", q_full, got_q), ("kv", kv, got_kv), ("index_q", iq, got_extra["index_q"]),
                                    ("index_k", ik, got_extra["index_k"]), ("index_w", iw, got_extra["index_w"])):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"layer {i} {name}")
            o = torch.einsum("thc,hvc->thv", causal_attention(q_full, kv, kv[..., :r], cfg.sm_scale, 0),
                             w[:, dn:])
            h = h + a.o_proj(o.reshape(T, H * dv))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        want = model.norm(h)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_fused_projections_are_the_weights_only_copy_and_follow_checkpoint_loads():
    # the stacked projection matrices hold the weights themselves (each weight a view of its
    # rows, no second copy); loading new weights in place changes what the fused GEMMs use, and
    # a weight replaced by a new tensor is stacked again
    from sparsehi.runtime.layers import fused_weight

    for name in ("tiny-gqa", "tiny-dsa"):
        cfg = tiny(name, layers=2)
        model = build_model(config=cfg)
        other = build_model(config=cfg)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(6)
        attn = full_attention_fn(cfg)
        with torch.no_grad():
            model(ids, pos, attn)
            mlp = model.layers[0].mlp
            fused = mlp._gate_up[0]
            assert fused.untyped_storage().data_ptr() == mlp.gate_proj.weight.untyped_storage().data_ptr()
            assert fused.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
            stored = {p.untyped_storage().data_ptr() for p in model.parameters()}
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            unique = sum(s.nbytes() for s in {p.untyped_storage().data_ptr(): p.untyped_storage()
                                              for p in model.parameters()}.values())
            assert len(stored) < len(list(model.parameters())) and unique == params
            model.load_state_dict(other.state_dict())
            assert mlp._gate_up[0] is fused                        # written in place, not stacked again
            torch.testing.assert_close(model(ids, pos, attn), other(ids, pos, attn), rtol=0, atol=0)
            new = torch.nn.Parameter(torch.randn_like(mlp.up_proj.weight))
            mlp.up_proj.weight = new
            again = fused_weight(mlp, "_gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight])
            assert again is not fused and torch.equal(again[mlp.gate_proj.weight.shape[0]:], new)
            assert again.untyped_storage().data_ptr() == new.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- caches
@pytest.mark.parametrize("name,ps", [("tiny-gqa", 16), ("tiny-dsa", 1)])
def test_dense_and_offload_full_match_cache_free_generation(name, ps):
    model = build_model(config=tiny(name))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (37, 50)]
    ref = [greedy_no_cache(model, p, 6) for p in prompts]
    algo = "dsa" if ps == 1 else "quest"
    for mode in ("dense", "offload-full"):
        sc = SparseConfig(algorithm=algo, page_size=ps, top_k=16, device_buffer_size=32)
        rt = RuntimeConfig(mode=mode, sparse=sc, max_num_reqs=2, max_context_len=64)
        res = ModelRunner(model, rt).generate(prompts, 6)
        assert res.tokens == ref, mode


# ----------------------------------------------------------------------------- weights
def _write_checkpoint(tmp_path, model_type: str, bias: bool):
    from safetensors.torch import save_file

    from sparsehi.runtime.gqa_model import GQAModel

    hf = {"model_type": model_type, "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "rope_theta": 10000.0,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    cfg = ModelConfig(name="ckpt", family="gqa", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48, seed=7)
    src = GQAModel(cfg, qkv_bias=bias)
    src.random_init()
    with torch.no_grad():
        for p in src.parameters():  # non-trivial norms and biases too
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.contiguous()
             for k, v in src.state_dict().items()}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(state, str(tmp_path / "model.safetensors"))
    return src


@pytest.mark.parametrize("model_type,bias", [("llama", False), ("qwen2", True)])
def test_hf_safetensors_checkpoint_loads(tmp_path, model_type, bias):
    src = _write_checkpoint(tmp_path, model_type, bias)
    model = load_hf_model(tmp_path)
    assert model.layers[0].self_attn.q_proj.bias is not None if bias else model.layers[0].self_attn.q_proj.bias is None
    ids = torch.arange(12)
    with torch.no_grad():
        want = src.logits(src(ids, torch.arange(12), full_attention_fn(src.cfg)))
        got = model.logits(model(ids, torch.arange(12), full_attention_fn(model.cfg)))
    torch.testing.assert_close(got, want)


def test_hf_checkpoint_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(tmp_path)
    _write_checkpoint(tmp_path, "llama", False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_model(tmp_path)
    cfg["model_type"] = "llama"
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks"):
        load_hf_model(tmp_path)


def test_hf_checkpoint_with_tensors_the_model_lacks_is_refused(tmp_path):
    # a Llama checkpoint with attention biases (attention_bias: true) must not load as a bias-free model
    from safetensors.torch import load_file, save_file

    _write_checkpoint(tmp_path, "llama", False)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="does not use"):
        load_hf_model(tmp_path)


# ----------------------------------------------------------------------------- traces
def test_topk_overlap_counts_only_the_topk_range():
    from sparsehi.runtime.traces import topk_overlap

    prev = torch.tensor([[0, 5, 6, 7, 20, -1], [1, 2, 3, 4, -1, -1]])
    cur = torch.tensor([[0, 5, 6, 9, 20, -1], [9, 8, 3, -1, -1, -1]])
    lo = torch.tensor([1, 1])
    hi = torch.tensor([20, 20])
    got = topk_overlap(prev, cur, lo, hi)  # row 0: {5,6,9} vs {5,6,7}; row 1: {9,8,3} vs {1,2,3,4}
    torch.testing.assert_close(got, torch.tensor([2 / 3, 1 / 3]))


def test_query_trace_drifts_with_the_calibrated_correlation():
    from sparsehi.runtime.traces import QueryTrace

    tr = QueryTrace(0.9, seed=0)
    like = torch.empty(64, 8, 32)
    a = tr.next(3, like)
    b = tr.next(3, like)
    corr = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert abs(float(corr) - 0.9) < 0.03
    q = torch.randn(64, 4, 16) * 3
    outs = [tr(0, q, {}) for _ in range(6)]
    # the model's query scale (mean per-head norm), and the calibrated drift between calls
    for out in outs:
        assert abs(float(out.norm(dim=-1).mean()) / float(q.norm(dim=-1).mean()) - 1) < 0.1
    step = torch.nn.functional.cosine_similarity(outs[-2].flatten(), outs[-1].flatten(), dim=0)
    assert abs(float(step) - 0.9) < 0.05
    extra = {"index_q": torch.randn(2, 4, 16), "index_w": -torch.ones(2, 4)}
    dsa = QueryTrace(0.5, dsa=True)
    same_q = dsa(0, q, extra)
    assert same_q is q and bool((extra["index_w"] > 0).all())
    # a mode without index inputs (dense): nothing to trace, nothing added
    none = {}
    assert dsa(1, q, none) is q and none == {} and 1 not in dsa._scaled


def test_calibrate_rho_hits_the_target_of_a_monotone_measure():
    from sparsehi.runtime.traces import calibrate_rho

    rho, got = calibrate_rho(lambda r: r ** 8, target=0.85, iters=12)
    assert abs(got - 0.85) < 0.01 and abs(rho ** 8 - got) < 1e-12


def test_llama3_rope_scaling_slows_only_long_wavelengths():
    from sparsehi.runtime.layers import llama3_inv_freq
    from sparsehi.runtime.weights import hf_config_to_model_config

    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    got = llama3_inv_freq(inv, 8.0, 1.0, 4.0, 8192)
    wl = 2 * torch.pi / inv
    torch.testing.assert_close(got[wl < 8192 / 4], inv[wl < 8192 / 4])          # short: unchanged
    torch.testing.assert_close(got[wl > 8192], inv[wl > 8192] / 8.0)             # long: / factor
    mid = (wl >= 8192 / 4) & (wl <= 8192)
    assert bool(((got[mid] < inv[mid]) & (got[mid] > inv[mid] / 8.0)).all())
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 8}
    cfg, _ = hf_config_to_model_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}}, "x")
    assert cfg.rope_scaling == (8.0, 1.0, 4.0, 8192)
    with pytest.raises(ValueError, match="rope_scaling"):
        hf_config_to_model_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "x")


def test_sparse_config_backend_chooses_the_adapter():
    from sparsehi.adapters import DSAAdapter, FlashAttentionAdapter, TritonAdapter
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.model_config import get_model_config
    from sparsehi.runtime.runtime_config import RuntimeConfig
    from sparsehi.runtime.sparse_mode import SparseCoordinatorMode

    gqa, mla = get_model_config("tiny-gqa", num_layers=2), get_model_config("tiny-dsa", num_layers=2)
    for backend, cls in (("flashattention", FlashAttentionAdapter), ("triton", TritonAdapter)):
        sc = SparseConfig(page_size=16, top_k=64, device_buffer_size=128, backend=backend)
        mode = SparseCoordinatorMode(gqa, RuntimeConfig(mode="sparse-gpu", sparse=sc, adapter="auto", max_context_len=256))
        assert type(mode.coord.adapter) is cls
    sc = SparseConfig(algorithm="dsa", page_size=1, top_k=64, device_buffer_size=128, backend="flashattention")
    mode = SparseCoordinatorMode(mla, RuntimeConfig(mode="sparse-gpu", sparse=sc, adapter="auto", max_context_len=256))
    assert type(mode.coord.adapter) is DSAAdapter  # the latent cache always goes through dsa
    with pytest.raises(ValueError, match="backend='dsa' needs an MLA model"):
        SparseCoordinatorMode(gqa, RuntimeConfig(mode="sparse-gpu", sparse=SparseConfig(page_size=16, top_k=64,
                           device_buffer_size=128, backend="dsa"), adapter="auto", max_context_len=256))


def test_host_pool_is_sized_by_the_host_to_device_ratio():
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.runtime_config import RuntimeConfig

    sizes = [RuntimeConfig(mode="sparse-hier", sparse=SparseConfig(page_size=16, top_k=64, device_buffer_size=128,
                                                                   host_to_device_ratio=r),
                           max_num_reqs=2, max_context_len=1000).auto_host_tokens() for r in (2.0, 3.0)]
    assert sizes[1] > sizes[0] >= 2 * 2 * 1008
    assert abs(sizes[1] / sizes[0] - 1.5) < 0.01


@pytest.mark.parametrize("mode", ["dense", "sparse-gpu", "sparse-hier", "offload-full"])
def test_every_mode_passes_each_layers_query_through_the_query_hook(mode):
    """``RuntimeMode.query_hook`` (what the decode benchmarks' query traces plug into) sees
    every layer of a decode step, and the step attends with the query it returns."""
    cfg = tiny("tiny-gqa", layers=3)
    sc = SparseConfig(algorithm="quest", page_size=16, top_k=64, device_buffer_size=128, sink_tokens=16,
                      recent_tokens=16, min_sparse_prompt_len=0)
    rt = RuntimeConfig(mode=mode, sparse=sc, max_num_reqs=1, max_context_len=160, prefix_cache=False)
    tokens = {}
    for hooked in (False, True):
        runner = ModelRunner(build_model(config=cfg), rt)
        seen = []

        def hook(layer, q, extra):
            seen.append(layer)
            return -q

        if hooked:
            runner.mode.query_hook = hook
        req = runner.new_requests([list(range(100))])[0]
        runner.prefill(req)
        tokens[hooked] = [runner.decode_step([req])[0] for _ in range(3)]
        assert seen == (list(range(cfg.num_layers)) * 3 if hooked else [])
    assert tokens[True] != tokens[False]
