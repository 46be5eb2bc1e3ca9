"""Build a model: a built-in fixed-seed random config, or a local HF-layout checkpoint
(Llama / Qwen2 / Mistral: ``config.json`` + ``model*.safetensors``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from sparsehi.runtime.gqa_model import GQAModel
from sparsehi.runtime.mla_model import MLAModel
from sparsehi.runtime.model_config import ModelConfig, get_model_config

HF_MODEL_TYPES = ("llama", "qwen2", "mistral")

Model = Union[GQAModel, MLAModel]


def hf_config_to_model_config(hf: dict, name: str) -> tuple[ModelConfig, bool]:
    """Map an HF ``config.json`` dict to (ModelConfig, qkv_bias)."""
    mtype = hf.get("model_type")
    if mtype not in HF_MODEL_TYPES:
        raise ValueError(f"config.json model_type={mtype!r} is not supported: allowed {HF_MODEL_TYPES}")
    scaling = hf.get("rope_scaling")
    rope_scaling = None
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind == "llama3":
        rope_scaling = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                        float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
    elif kind not in (None, "default"):
        raise ValueError(f"config.json rope_scaling={scaling!r} is not supported: plain RoPE or rope_type 'llama3'")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    cfg = ModelConfig(
        name=name, family="gqa", vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        intermediate_size=int(hf["intermediate_size"]), rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        note=f"weights loaded from {name} ({mtype})",
    )
    return cfg, mtype == "qwen2"


def load_hf_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu",
                  dtype: torch.dtype = torch.float32) -> GQAModel:
    """Load a local HF-layout Llama/Qwen2 checkpoint; every model parameter must be found."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"--model-path {root}: no config.json (expected an HF-layout checkpoint directory)")
    files = sorted(root.glob("model*.safetensors"))
    if not files:
        raise ValueError(f"--model-path {root}: no model*.safetensors files")
    cfg, bias = hf_config_to_model_config(json.loads(cfg_path.read_text()), root.name)
    with torch.device("meta"):
        model = GQAModel(cfg, qkv_bias=bias)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for key, t in load_file(str(f)).items():
            state[key[len("model."):] if key.startswith("model.") else key] = t
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("embed_tokens.weight")
    expected = dict(model.named_parameters())
    missing = sorted(k for k in expected if k not in state or state[k] is None)
    if missing:
        raise ValueError(f"--model-path {root}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    # a tensor the model has no place for (attention bias, sliding-window extras, ...) means
    # an architecture this runner does not implement: refuse rather than drop it silently
    buffers = {k for k, _ in model.named_buffers()}
    unexpected = sorted(k for k in state if k not in expected and k not in buffers and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"--model-path {root}: checkpoint has {len(unexpected)} tensors this model does not use, "
                         f"e.g. {unexpected[:3]} (unsupported architecture variant)")
    for k, p in expected.items():
        if tuple(state[k].shape) != tuple(p.shape):
            raise ValueError(f"--model-path {root}: {k} has shape {tuple(state[k].shape)}, config implies {tuple(p.shape)}")
    model = model.to_empty(device=device)
    model.load_state_dict({k: state[k].to(dtype) for k in expected}, strict=False, assign=False)
    return model.to(dtype).eval()


def build_model(name: Optional[str] = None, *, model_path: Optional[Union[str, Path]] = None,
                device: Union[str, torch.device] = "cpu", dtype: torch.dtype = torch.float32,
                num_layers: Optional[int] = None, config: Optional[ModelConfig] = None) -> Model:
    """A ready model: from ``model_path`` when given, else the built-in ``name`` (or an
    explicit ``config``) with fixed-seed random weights initialised on ``device``."""
    if model_path is not None:
        return load_hf_model(model_path, device=device, dtype=dtype)
    cfg = config if config is not None else get_model_config(name or "tiny-gqa", num_layers)
    with torch.device(device):
        model: nn.Module = GQAModel(cfg) if cfg.family == "gqa" else MLAModel(cfg)
    model = model.to(dtype)
    model.random_init()
    return model.eval()
