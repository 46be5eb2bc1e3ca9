"""Build a model: a built-in fixed-seed random config, or a local HF-layout checkpoint
(Llama / Qwen2 / Mistral without a sliding window: ``config.json`` + ``model*.safetensors``;
plain RoPE or Llama-3.1 ``llama3`` rope scaling)."""
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
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

Model = Union[GQAModel, MLAModel]


class CheckpointError(ValueError):
    """A ``--model-path`` checkpoint this runtime cannot load. The message is one line that
    starts with the file (or directory) at fault and says what is wrong with it."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _hf_int(hf: dict, key: str, source: str, default: Optional[int] = None) -> int:
    val = hf.get(key, default)
    try:
        ok = isinstance(val, (int, float)) and not isinstance(val, bool) and val == int(val)
    except (OverflowError, ValueError):  # inf, nan
        ok = False
    if not ok:
        raise CheckpointError(f"{source}: {key}={val!r} is not an integer")
    return int(val)


def _hf_float(hf: dict, key: str, source: str, default: float) -> float:
    val = hf.get(key, default)
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise CheckpointError(f"{source}: {key}={val!r} is not a number")
    return float(val)


def hf_config_to_model_config(hf: dict, name: str, source: str = "config.json") -> tuple[ModelConfig, bool]:
    """Map an HF ``config.json`` dict to (ModelConfig, qkv_bias). Every problem is a
    :class:`CheckpointError` naming ``source`` (the file the dict came from)."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{source}: expected a JSON object of model settings, got a JSON "
                              f"{'array' if isinstance(hf, list) else type(hf).__name__}")
    mtype = hf.get("model_type")
    if mtype not in HF_MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type={mtype!r} is not supported: allowed {HF_MODEL_TYPES}")
    missing = [k for k in _HF_REQUIRED if k not in hf]
    if missing:
        raise CheckpointError(f"{source}: missing {', '.join(missing)} (needed to build the {mtype} model)")
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True):
        # Mistral-7B-v0.1 style: this runtime attends the full context, which differs past the window
        raise CheckpointError(f"{source}: sliding_window={window!r} is not supported (this runtime attends the "
                              f"full context; set it to null only if the model was trained without it)")
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"{source}: rope_scaling={scaling!r} is not supported: null or an object")
    rope_scaling = None
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind == "llama3":
        try:
            rope_scaling = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: rope_scaling={scaling!r} is not a complete llama3 rope scaling "
                                  f"({_one_line(e)})") from None
    elif kind not in (None, "default"):
        raise CheckpointError(f"{source}: rope_scaling={scaling!r} is not supported: plain RoPE or rope_type 'llama3'")
    heads = _hf_int(hf, "num_attention_heads", source)
    hidden = _hf_int(hf, "hidden_size", source)
    if heads <= 0:
        raise CheckpointError(f"{source}: num_attention_heads={heads} must be > 0")
    try:
        cfg = ModelConfig(
            name=name, family="gqa", vocab_size=_hf_int(hf, "vocab_size", source), hidden_size=hidden,
            num_layers=_hf_int(hf, "num_hidden_layers", source), num_heads=heads,
            num_kv_heads=_hf_int(hf, "num_key_value_heads", source, heads),
            head_dim=_hf_int(hf, "head_dim", source, None) if hf.get("head_dim") else hidden // heads,
            intermediate_size=_hf_int(hf, "intermediate_size", source),
            rope_theta=_hf_float(hf, "rope_theta", source, 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=_hf_float(hf, "rms_norm_eps", source, 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            note=f"weights loaded from {name} ({mtype})",
        )
    except CheckpointError:
        raise
    except ValueError as e:  # ModelConfig's own checks (sizes > 0, heads divisible, ...)
        raise CheckpointError(f"{source}: {_one_line(e)}") from None
    return cfg, mtype == "qwen2"


def checkpoint_files(root: Path) -> tuple[Path, list[Path]]:
    """``config.json`` and the ``model*.safetensors`` files (sorted) of a checkpoint directory:
    what the loader reads."""
    cfg_path = root / "config.json"
    files = sorted(root.glob("model*.safetensors")) if root.is_dir() else []
    if not cfg_path.is_file() or not files:
        raise CheckpointError(f"{root}: expected a local HF-layout checkpoint directory with config.json and "
                              f"model*.safetensors" + ("" if root.is_dir() else " (no such directory)"))
    return cfg_path, files


def read_hf_config(path: Union[str, Path]) -> tuple[ModelConfig, bool]:
    """(ModelConfig, qkv_bias) of the checkpoint directory ``path`` from its ``config.json``."""
    root = Path(path)
    cfg_path, _ = checkpoint_files(root)
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot be read ({_one_line(e)})") from None
    return hf_config_to_model_config(hf, root.name, source=str(cfg_path))


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``files``, ``model.`` prefix dropped, read from the
    safetensors headers only (no tensor data)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    shapes[key[len("model."):] if key.startswith("model.") else key] = tuple(st.get_slice(key).get_shape())
        except Exception as e:  # SafetensorError (not exported under one name across versions), OSError
            raise CheckpointError(f"{f}: not a readable safetensors file ({_one_line(e)})") from None
    return shapes


def check_hf_checkpoint(path: Union[str, Path]) -> ModelConfig:
    """Check a local HF-layout checkpoint without loading its tensors: ``config.json``
    parses to a supported model, every ``model*.safetensors`` header reads, and the tensor
    names and shapes are exactly what that model needs. Returns its ModelConfig; raises
    :class:`CheckpointError`."""
    return _checked(Path(path))[0]


def _checked(root: Path) -> tuple[ModelConfig, bool, list[Path]]:
    """(ModelConfig, qkv_bias, safetensors files) of a checkpoint that passed every check."""
    cfg, bias = read_hf_config(root)
    _, files = checkpoint_files(root)
    shapes = _tensor_shapes(files)
    if cfg.tie_word_embeddings and "lm_head.weight" not in shapes and "embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["embed_tokens.weight"]
    with torch.device("meta"):
        model = GQAModel(cfg, qkv_bias=bias)
    expected = {k: tuple(p.shape) for k, p in model.named_parameters()}
    missing = sorted(k for k in expected if k not in shapes)
    if missing:
        raise CheckpointError(f"{root}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    # a tensor the model has no place for (attention bias, sliding-window extras, ...) means
    # an architecture this runner does not implement: refuse rather than drop it silently
    buffers = {k for k, _ in model.named_buffers()}
    unexpected = sorted(k for k in shapes if k not in expected and k not in buffers
                        and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointError(f"{root}: checkpoint has {len(unexpected)} tensors this model does not use, "
                              f"e.g. {unexpected[:3]} (unsupported architecture variant)")
    for k, shape in expected.items():
        if shapes[k] != shape:
            raise CheckpointError(f"{root}: {k} has shape {shapes[k]}, config.json implies {shape}")
    return cfg, bias, files


def load_hf_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu",
                  dtype: torch.dtype = torch.float32) -> GQAModel:
    """Load a local HF-layout Llama/Qwen2/Mistral checkpoint; every model parameter must be
    found (:func:`check_hf_checkpoint` runs first; its errors are :class:`CheckpointError`)."""
    from safetensors.torch import load_file

    cfg, bias, files = _checked(Path(path))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:  # a data section that fails after a readable header
            raise CheckpointError(f"{f}: not a readable safetensors file ({_one_line(e)})") from None
        for key, t in tensors.items():
            state[key[len("model."):] if key.startswith("model.") else key] = t
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = GQAModel(cfg, qkv_bias=bias)
    expected = dict(model.named_parameters())
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
