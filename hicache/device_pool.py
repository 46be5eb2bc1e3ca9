"""Paged KV pool on the GPU (or the CPU in tests): the layout attention kernels read."""
from __future__ import annotations

import torch

from hicache.allocator import PagedSlotAllocator
from hicache.kv_spec import KVCacheSpec


def check_slots(slots: torch.Tensor, name: str, num_slots: int, allowed_devices: tuple[torch.device, ...],
                *, allow_padding: bool = False, unique: bool = False) -> None:
    """Validate a slot list at an API boundary: ``int64``/``int32`` 1-D tensor on an allowed
    device, entries in ``[0, num_slots)`` (``-1`` too when ``allow_padding``), optionally
    distinct. Raises ValueError naming ``name``. Range/uniqueness checks read the values
    (a device sync for CUDA tensors)."""
    if not isinstance(slots, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(slots).__name__}")
    if slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must have dtype int64 or int32, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    if not any(_same_device(slots.device, d) for d in allowed_devices):
        raise ValueError(f"{name} must be on one of {[str(d) for d in allowed_devices]}, got {slots.device}")
    if slots.numel() == 0:
        return
    lo = -1 if allow_padding else 0
    mn, mx = int(slots.min()), int(slots.max())
    if mn < lo or mx >= num_slots:
        pad = " or -1 (padding)" if allow_padding else ""
        raise ValueError(f"{name} must be in [0, {num_slots}){pad}, got range [{mn}, {mx}]")
    if unique:
        real = slots[slots >= 0] if allow_padding else slots
        if torch.unique(real).numel() != real.numel():
            raise ValueError(f"{name} contains duplicate slots (a write target must be unique)")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


class DeviceKVPool:
    """KV of every layer in one allocation ``kv_data [num_buffers, layers, num_slots, heads, dim]``.

    ``layer_buffers(l)`` are views ``[num_slots, heads, dim]`` (MHA: k, v; MLA: kv), the
    contract attention backends use. Keeping all layers in one tensor lets one kernel
    launch address any layer/buffer from a single base pointer.

    An MLA spec of FP8 latent rows (``KVCacheSpec.mla_fp8``) makes ``kv_data`` uint8 rows
    of the FP8 layout: ``set_kv`` takes rows already quantised, and only readers that know
    the layout (the sparse MLA decode kernel, a dequantising reader) may read them.
    """

    def __init__(self, spec: KVCacheSpec, num_slots: int, device: torch.device | str):
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a cuda or cpu device, got {device}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.spec = spec
        self.page_size = spec.page_size
        self.device = device
        self.allocator = PagedSlotAllocator(num_slots, spec.page_size, device)
        self.num_slots = num_slots
        self.kv_data = torch.zeros(
            (spec.num_buffers, spec.num_layers, num_slots, spec.kv_heads, spec.head_dim),
            dtype=spec.dtype, device=device)

    # --- views -------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.spec.num_layers}), got {layer!r}")

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """(k, v) for MHA, (kv,) for MLA; each ``[num_slots, heads, dim]`` view."""
        self._check_layer(layer)
        return tuple(self.kv_data[b, layer] for b in range(self.spec.num_buffers))

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        self._check_layer(layer)
        return self.kv_data[0, layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        """MHA: v. MLA: the latent part ``kv[..., :kv_lora_rank]`` (a view; FP8 latent rows:
        the latent's E4M3 bytes, without their scales)."""
        self._check_layer(layer)
        if self.spec.attention == "mha":
            return self.kv_data[1, layer]
        return self.kv_data[0, layer][..., : self.spec.value_dim]

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer), self.get_value_buffer(layer)

    def paged_view(self) -> torch.Tensor:
        """6-D view ``[num_slots, 1, layers, buffers, heads, dim]`` (pages of one slot) —
        the common shape ``hicache.kernels.kv_copy`` addresses every layout by."""
        return self.kv_data.permute(2, 1, 0, 3, 4).unsqueeze(1)

    # --- writes ------------------------------------------------------------------------
    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Write ``k``/``v`` ``[N, heads, dim]`` (MLA: ``kv`` as ``k``, ``v`` None) at ``slots``
        ``int64 [N]``. Values are cast to the pool dtype; FP8 latent rows take uint8 rows
        (``quantize_mla_latents``), never values to cast."""
        self._check_layer(layer)
        if self.spec.fp8_latent_rows and getattr(k, "dtype", None) != torch.uint8:
            raise ValueError(f"k must be uint8 FP8 latent rows [N, 1, {self.spec.head_dim}] for "
                             f"kv_cache_dtype='fp8_e4m3' (quantise the latents first), got {getattr(k, 'dtype', k)}")
        check_slots(slots, "slots", self.num_slots, (self.device, torch.device("cpu")))
        n = slots.numel()
        want = (n, self.spec.kv_heads, self.spec.head_dim)
        bufs = (k, v) if self.spec.attention == "mha" else (k,)
        if self.spec.attention == "mla" and v is not None:
            raise ValueError("v must be None for attention='mla' (pass the whole kv as k)")
        for name, t in zip(("k", "v"), bufs):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor of shape {want}, got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        idx = slots.to(device=self.device, dtype=torch.int64)
        for b, t in enumerate(bufs):
            self.kv_data[b, layer].index_copy_(0, idx, t.to(device=self.device, dtype=self.spec.dtype))

    def nbytes(self) -> int:
        return self.kv_data.numel() * self.kv_data.element_size()

    def __repr__(self) -> str:
        return f"DeviceKVPool({self.spec}, num_slots={self.num_slots}, device={self.device})"
