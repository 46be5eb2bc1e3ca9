"""``RuntimeConfig.batch_invariant``: a prompt prefilled whole, and the same prompt
prefilled as a reused prefix plus its last tokens, give bitwise the same KV and hidden
states for those last tokens (both model families), and the runtime turns the model's
row-invariant ops on."""
from __future__ import annotations

import pytest
import torch

from sparsehi.runtime.attention import causal_attention
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model


class CachingAttention:
    """An AttentionFn that keeps each layer's KV rows, as a prefix cache does: a call with
    ``T`` new tokens appends them and attends over everything kept so far."""

    def __init__(self, cfg, batch_invariant: bool) -> None:
        self.cfg = cfg
        self.batch_invariant = batch_invariant
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer, q, k, v, extra):
        if v is None:  # MLA: values are the latent's first kv_lora_rank columns
            v = k[..., : self.cfg.kv_lora_rank]
        old = self.k.get(layer)
        off = 0 if old is None else old.shape[0]
        self.k[layer] = k if old is None else torch.cat([old, k])
        self.v[layer] = v if old is None else torch.cat([self.v[layer], v])
        return causal_attention(q, self.k[layer], self.v[layer], self.cfg.sm_scale, off, self.batch_invariant)


def _whole_and_split(name: str, device: str, T: int, split: int):
    cfg = get_model_config(name, num_layers=2)
    model = build_model(config=cfg, device=device)
    model.use_batch_invariant_ops()
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(5)).to(device)
    pos = torch.arange(T, device=device)
    with torch.no_grad():
        whole = CachingAttention(cfg, True)
        h_whole = model(ids, pos, whole)
        split_attn = CachingAttention(cfg, True)
        model(ids[:split], pos[:split], split_attn)
        h_tail = model(ids[split:], pos[split:], split_attn)
    return whole, split_attn, h_whole, h_tail


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-dsa"])
def test_reused_prefix_gives_bitwise_the_same_tail_interpreted(name, monkeypatch):
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")  # the interpreted kernels, not the torch references
    T, split = 40, 33
    whole, split_attn, h_whole, h_tail = _whole_and_split(name, "cpu", T, split)
    assert torch.equal(h_tail, h_whole[split:])
    for layer in whole.k:
        assert torch.equal(split_attn.k[layer], whole.k[layer]), layer


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-dsa"])
@pytest.mark.parametrize("T,split", [(4133, 4112), (2048, 64)])
def test_reused_prefix_gives_bitwise_the_same_tail_on_gpu(name, T, split):
    whole, split_attn, h_whole, h_tail = _whole_and_split(name, "cuda", T, split)
    assert torch.equal(h_tail, h_whole[split:])
    for layer in whole.k:
        assert torch.equal(split_attn.k[layer], whole.k[layer]), layer


def test_runtime_turns_the_models_row_invariant_ops_on():
    cfg = get_model_config("tiny-gqa", num_layers=1)
    model = build_model(config=cfg)
    assert not model.batch_invariant
    ModelRunner(model, RuntimeConfig(mode="dense", batch_invariant=True))
    assert model.batch_invariant

    class Plain(torch.nn.Module):
        cfg = model.cfg

    with pytest.raises(ValueError, match="batch_invariant=True needs a model with use_batch_invariant_ops"):
        ModelRunner(Plain(), RuntimeConfig(mode="dense", batch_invariant=True))
