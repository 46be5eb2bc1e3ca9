"""Host <-> device KV transfers of arbitrary slot lists, with per-layer completion events.

Two io backends (SGLang's ``--hicache-io-backend``):

- ``kernel``: the Triton gather/scatter of ``hicache.kernels.kv_copy`` reads/writes the
  pinned host pool directly from the GPU (zero-copy), one launch per layer (load) or per
  contiguous layer range (backup) over the whole index list.
- ``direct``: torch indexing plus non-blocking copies through pinned staging buffers; for
  ``page_first_direct`` pools and page-aligned lists, one ``cudaMemcpyAsync`` per (page,
  layer, buffer) block instead of a token gather.

Asynchronous calls (``load``/``backup``) run on the engine's own CUDA stream (ordered after
the caller's current stream) and return a :class:`TransferHandle` with one event per
layer. ``*_layer_now`` run on the caller's current stream (the sparse decode hot path) and
skip ``-1``/out-of-range entries without validating slot values (validation belongs at the
async boundary, ``validate=True``). Only the ``kernel`` backend is sync-free there: the
Triton kernel reads the index lists on the GPU and masks bad entries itself. The ``direct``
backend on CUDA needs the host slot list on the CPU (its gathers/scatters of host rows run
on the CPU) and filters bad entries with a host-side mask, so each call synchronises the
host with the current stream once (``.cpu()`` of the indices); a backup also waits for each
layer's staging copy before scattering it into the host pool. Use ``kernel`` on the decode
hot path. On a CPU-only machine every copy is synchronous and handles are complete on return.

An FP8 host pool (``HostKVPool(host_kv_dtype="fp8_e4m3")``) holds pages with per-page
scales: loads dequantise any slot list (``hicache.kernels.fp8_token_load``); writes take
whole pages only (``store_pages``, ``completed_pages + store_pages_now``), which quantise each page
and round its device rows to the stored values. The token-wise ``backup*`` calls refuse.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from hicache.config import IO_BACKENDS, check_layout_io  # IO_BACKENDS re-exported: ``from hicache.transfer import IO_BACKENDS``
from hicache.device_pool import DeviceKVPool, _same_device, check_slots
from hicache.host_pool import HostKVPool
from hicache.kernels.fp8_page_store import fp8_page_store
from hicache.kernels.fp8_token_load import fp8_token_load_reference, fp8_token_load_triton
from hicache.kernels.kv_copy import KVCopyConfig, kv_copy_reference, kv_copy_triton, row_ids, row_matrix, row_segments
from hicache.kernels.token_store import token_store_reference, token_store_triton
from hicache.triton_support import announce_path, interpreter_enabled


@dataclass
class TransferHandle:
    """Completion of one ``load``/``backup`` call: ``events[layer]`` fires when that layer's
    copy is done (CUDA); empty on CPU, where the copy already finished."""

    layers: tuple[int, ...]
    events: dict[int, torch.cuda.Event] = field(default_factory=dict)
    keepalive: list = field(default_factory=list)  # tensors the queued copies still read

    def _event(self, layer: int) -> torch.cuda.Event | None:
        if layer not in self.layers:
            raise ValueError(f"layer must be one of this transfer's layers {self.layers}, got {layer!r}")
        return self.events.get(layer)

    def wait_layer(self, layer: int) -> None:
        """Make the current CUDA stream wait for ``layer`` only (no host sync)."""
        ev = self._event(layer)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def wait(self) -> None:
        """Make the current stream wait for every layer of this transfer."""
        for layer in self.layers:
            self.wait_layer(layer)

    def synchronize(self) -> None:
        """Block the host until every layer is done."""
        for ev in self.events.values():
            ev.synchronize()
        self.keepalive.clear()

    def done(self) -> bool:
        finished = all(ev.query() for ev in self.events.values())
        if finished:
            self.keepalive.clear()
        return finished


def _layer_runs(layers: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted layers → [(start, count)] of consecutive runs."""
    runs: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][0] + runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((layer, 1))
    return runs


class KVTransferEngine:
    """Copies KV rows between a :class:`DeviceKVPool` and its :class:`HostKVPool`.

    ``validate`` (default on) checks slot values at the async boundary (range, duplicates
    among write targets); it reads the index tensors, a host sync for CUDA indices.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, io_backend: str = "kernel", *,
                 validate: bool = True, kernel_config: KVCopyConfig | None = None,
                 sort_threshold: int | None = 4096):
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend must be one of {IO_BACKENDS}, got {io_backend!r}")
        if not isinstance(device_pool, DeviceKVPool):
            raise ValueError(f"device_pool must be a DeviceKVPool, got {type(device_pool).__name__}")
        if not isinstance(host_pool, HostKVPool):
            raise ValueError(f"host_pool must be a HostKVPool, got {type(host_pool).__name__}")
        check_layout_io(host_pool.layout, io_backend, "host_pool.layout", "io_backend")
        if host_pool.spec != device_pool.spec:
            raise ValueError(f"host_pool.spec must equal device_pool.spec, got {host_pool.spec} vs {device_pool.spec}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = io_backend
        self.validate = validate
        self.kernel_config = kernel_config
        # Kernel backend: lists of at least this many rows are reordered by host slot first
        # (same pairs, ascending host addresses). Random 1152 B rows over an 8 GB pool went
        # from 35 to 49 GB/s on an H200 this way (address-translation locality on the host
        # side); None disables it. Pools whose host pages already give contiguous runs of
        # >= 16 KiB (64-token MHA pages: 128 KiB) gain nothing and skip the argsort
        # (measured 50.5 GB/s unsorted vs 49.1 sorted for 256 KiB pages).
        if sort_threshold is not None and (not isinstance(sort_threshold, int) or sort_threshold < 1):
            raise ValueError(f"sort_threshold must be None or a positive int, got {sort_threshold!r}")
        self.sort_threshold = sort_threshold
        self.device = device_pool.device
        self.is_cuda = self.device.type == "cuda"
        self.spec = device_pool.spec
        if self.is_cuda and io_backend == "kernel" and not host_pool.pin_memory:
            raise ValueError("io_backend='kernel' reads host memory from the GPU and needs a pinned host pool "
                             "(HostKVPool(pin_memory=True)); use io_backend='direct' otherwise")
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.fp8 = host_pool.kv_format.quantized
        """The host pool holds FP8 pages (whole-page writes, dequantising loads)."""
        self._dev_view = device_pool.paged_view()
        if self.fp8:
            self._host_view = None
            self._host_run_bytes = host_pool.page_nbytes
        else:
            self._host_view = host_pool.paged_view()
            _, row_len = row_segments(self._host_view, self._dev_view)
            self._host_run_bytes = host_pool.page_size * row_len * self.spec.element_size
        # The kernel backend runs Triton on CUDA, and under the interpreter on CPU tensors.
        self._triton = io_backend == "kernel" and (self.is_cuda or interpreter_enabled())
        announce_path("kv_transfer", f"{io_backend}:{'triton' if self._triton else 'torch'}")

    @property
    def uses_triton(self) -> bool:
        """True when copies run the Triton kernel (kernel backend on CUDA or interpreted)."""
        return self._triton

    # --- argument checks ---------------------------------------------------------------
    def _layers(self, layers: int | Iterable[int] | None) -> tuple[int, ...]:
        n = self.spec.num_layers
        if layers is None:
            return tuple(range(n))
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        try:
            out = tuple(layers)
        except TypeError:
            raise ValueError(f"layers must be None, an int or a sequence of ints in [0, {n}), got {layers!r}") from None
        if not out or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in out):
            raise ValueError(f"layers must be None, an int or a non-empty sequence of ints in [0, {n}), got {layers!r}")
        if len(set(out)) != len(out):
            raise ValueError(f"layers must not repeat a layer, got {layers!r}")
        return out

    def _allowed(self) -> tuple[torch.device, ...]:
        return (torch.device("cpu"), self.device) if self.is_cuda else (torch.device("cpu"),)

    def _check_pair(self, host_slots: torch.Tensor, device_slots: torch.Tensor, *, writes_device: bool,
                    allow_padding: bool, full: bool) -> None:
        hn, dn = self.host_pool.num_slots, self.device_pool.num_slots
        check = full and self.validate
        if check:
            check_slots(host_slots, "host_slots", hn, self._allowed(), allow_padding=allow_padding,
                        unique=not writes_device)
            check_slots(device_slots, "device_slots", dn, self._allowed(), allow_padding=allow_padding,
                        unique=writes_device)
        else:
            # Shape/dtype/device only: no value reads, so no host sync on the hot path.
            check_slots(host_slots[:0] if isinstance(host_slots, torch.Tensor) and host_slots.dim() == 1 else host_slots,
                        "host_slots", hn, self._allowed())
            check_slots(device_slots[:0] if isinstance(device_slots, torch.Tensor) and device_slots.dim() == 1 else device_slots,
                        "device_slots", dn, self._allowed())
        if host_slots.numel() != device_slots.numel():
            raise ValueError(f"host_slots and device_slots must have equal length, got {host_slots.numel()} "
                             f"and {device_slots.numel()}")

    def _on_device(self, slots: torch.Tensor) -> torch.Tensor:
        if self.is_cuda and not _same_device(slots.device, self.device):
            return slots.to(self.device, non_blocking=True)
        return slots

    # --- public API --------------------------------------------------------------------
    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor, layers: int | Iterable[int] | None = None,
             *, allow_padding: bool = False) -> TransferHandle:
        """Host → device: ``device[device_slots[i]] = host[host_slots[i]]`` for ``layers``
        (None = all). Slot lists ``int64|int32 [N]``; with ``allow_padding`` ``-1`` entries are
        skipped. Queued per layer on the engine stream; wait with the handle."""
        self._check_pair(host_slots, device_slots, writes_device=True, allow_padding=allow_padding, full=True)
        return self._run(self._host_view, self._dev_view, host_slots, device_slots, self._layers(layers), to_device=True)

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor, layers: int | Iterable[int] | None = None,
               *, allow_padding: bool = False) -> TransferHandle:
        """Device → host: ``host[host_slots[i]] = device[device_slots[i]]`` for ``layers``."""
        self._refuse_token_writes("backup")
        self._check_pair(host_slots, device_slots, writes_device=False, allow_padding=allow_padding, full=True)
        return self._run(self._dev_view, self._host_view, device_slots, host_slots, self._layers(layers), to_device=False)

    def load_layer_now(self, layer: int, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Host → device for one layer on the current stream; ``-1`` entries skipped.
        Sync-free with the ``kernel`` backend only (``direct`` reads the indices on the host)."""
        self._check_pair(host_slots, device_slots, writes_device=True, allow_padding=True, full=False)
        self._copy_now(self._host_view, self._dev_view, host_slots, device_slots, self._layers(layer), to_device=True)

    def backup_layer_now(self, layer: int, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Device → host for one layer on the current stream; ``-1`` entries skipped.
        Sync-free with the ``kernel`` backend only (``direct`` reads the indices on the host
        and waits for its staging copy)."""
        self._refuse_token_writes("backup_layer_now")
        self._check_pair(host_slots, device_slots, writes_device=False, allow_padding=True, full=False)
        self._copy_now(self._dev_view, self._host_view, device_slots, host_slots, self._layers(layer), to_device=False)

    def backup_tokens_from(self, layer: int, host_slots: torch.Tensor, *sources: torch.Tensor) -> None:
        """Device -> host for one layer from the caller's per-token tensors instead of pool
        slots: ``host[host_slots[i], layer] = (k[i], v[i])`` (MHA; MLA: the one ``kv``), each
        source ``[N, heads, dim]`` on the device pool's device (cast to the pool dtype when it
        differs), ``-1`` entries skipped, on the current stream. For rows that sit in no pool
        this engine addresses (e.g. a decoded token kept in another pool). The ``kernel``
        backend writes every buffer in one launch, sync-free; ``direct`` (and a CPU pool
        without the interpreter) goes through the host with torch (reads the indices there)."""
        self._refuse_token_writes("backup_tokens_from")
        layer = self._layers(layer)[0]
        nb = self.spec.num_buffers
        if len(sources) != nb:
            raise ValueError(f"sources must be {nb} tensor(s) for attention={self.spec.attention!r} "
                             f"({'k, v' if nb == 2 else 'kv'}), got {len(sources)}")
        check_slots(host_slots[:0] if isinstance(host_slots, torch.Tensor) and host_slots.dim() == 1 else host_slots,
                    "host_slots", self.host_pool.num_slots, self._allowed())
        want = (host_slots.numel(), *self._host_view.shape[4:])
        for i, src in enumerate(sources):
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != want:
                raise ValueError(f"sources[{i}] must be [N, heads, dim]={want} (N = len(host_slots)), got "
                                 f"{tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__}")
            if not _same_device(src.device, self.device):
                raise ValueError(f"sources[{i}] is on {src.device}, the device pool on {self.device}")
        srcs = [s.to(self.spec.dtype) for s in sources]
        srcs = [s if s.stride(-1) == 1 else s.contiguous() for s in srcs]
        if host_slots.numel() == 0:
            return
        if self._triton:
            token_store_triton(self._host_view, layer, self._on_device(host_slots), srcs)
        else:
            token_store_reference(self._host_view, layer, host_slots, srcs)

    # --- FP8 host pools: whole pages ---------------------------------------------------
    def _refuse_token_writes(self, call: str) -> None:
        if self.fp8:
            raise ValueError(f"{call} writes single tokens, which an FP8 host pool cannot take (a page's scale needs "
                             f"all of its tokens): use store_pages / completed_pages + store_pages_now")

    def store_pages(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> None:
        """FP8 host pools: whole pages of every layer, ``device_pages [P]`` -> ``host_pages
        [P]`` (int, page ids; ``-1`` skipped), quantised, and the device rows rounded to the
        stored values, on the current stream (sync-free on CUDA)."""
        if not self.fp8:
            raise ValueError("store_pages is for FP8 host pools (host_kv_dtype='fp8_e4m3'); use backup")
        hp = self.host_pool
        fp8_page_store(self._dev_view, self._on_device(device_pages), hp.fp8_values, hp.fp8_scales,
                       self._on_device(host_pages), 0, self.spec.num_layers, round_device=True)

    def completed_pages(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(host_pages, device_pages)``, each ``[N] int64``: for each ``i`` whose
        ``host_slots[i]`` is the last slot of its host page, that host page and the device
        page holding ``device_slots[i]``; ``-1`` host page elsewhere. Graph-safe; the same
        for every layer, so a step makes it once (``store_pages_now`` per layer)."""
        ps = self.spec.page_size
        h = self._on_device(host_slots).long()
        d = self._on_device(device_slots).long()
        last = (h >= 0) & (h % ps == ps - 1) & (d >= 0)
        return torch.where(last, h // ps, -1), d // ps

    def store_pages_now(self, layer: int, device_pages: torch.Tensor, host_pages: torch.Tensor,
                        pool: DeviceKVPool | None = None, pool_layer: int | None = None) -> None:
        """FP8 host pools, one layer, one launch on the current stream (CUDA-graph safe):
        device page ``device_pages[i]`` (``[N] int64``, of ``pool``'s layer ``pool_layer``;
        default this engine's device pool and ``layer``) quantised into host page
        ``host_pages[i]``'s ``layer`` and rounded in place to the stored values; ``-1``
        host pages are skipped."""
        if not self.fp8:
            raise ValueError("store_pages_now is for FP8 host pools (host_kv_dtype='fp8_e4m3')")
        layer = self._layers(layer)[0]
        pool = self.device_pool if pool is None else pool
        pool_layer = layer if pool_layer is None else pool_layer
        hp = self.host_pool
        fp8_page_store(pool.paged_view()[:, :, pool_layer:pool_layer + 1], device_pages, hp.fp8_values[:, layer:layer + 1],
                       hp.fp8_scales[:, layer:layer + 1], host_pages, 0, 1, round_device=True)

    # --- execution ---------------------------------------------------------------------
    def _run(self, src, dst, src_slots, dst_slots, layers: tuple[int, ...], *, to_device: bool) -> TransferHandle:
        handle = TransferHandle(layers=layers)
        if not self.is_cuda:
            self._copy_now(src, dst, src_slots, dst_slots, layers, to_device=to_device)
            return handle
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # indices / KV produced on the caller's stream
        with torch.cuda.stream(self.stream):
            given = (self._on_device(src_slots), self._on_device(dst_slots))
            s_idx, d_idx = self._host_ordered(*given, to_device=to_device)
            # The caller's own slot lists (allocated on its stream) are read here on the
            # engine stream, by the copy or by the reordering gather: the caching allocator
            # must not hand their blocks to the caller's next allocation before this stream is
            # done with them, even when only the reordered copies are used after.
            for t in (*given, s_idx, d_idx):
                if t.is_cuda:
                    t.record_stream(self.stream)
            handle.keepalive += [*given, s_idx, d_idx]
            if to_device:
                # One launch per layer so consumers can start on layer n while n+1 loads.
                for layer in layers:
                    self._copy(src, dst, s_idx, d_idx, (layer,), to_device=True, keepalive=handle.keepalive)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    handle.events[layer] = ev
            else:
                self._copy(src, dst, s_idx, d_idx, layers, to_device=False, keepalive=handle.keepalive)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                handle.events = {layer: ev for layer in layers}
        return handle

    def _host_ordered(self, src_slots, dst_slots, *, to_device: bool):
        """Pairs reordered by ascending host slot (kernel backend, long lists only)."""
        if (self._triton and self.sort_threshold is not None and src_slots.numel() >= self.sort_threshold
                and self._host_run_bytes < 16384):
            order = torch.argsort(src_slots if to_device else dst_slots)
            return src_slots[order], dst_slots[order]
        return src_slots, dst_slots

    def _copy_now(self, src, dst, src_slots, dst_slots, layers, *, to_device: bool) -> None:
        if self.is_cuda:
            src_slots, dst_slots = self._on_device(src_slots), self._on_device(dst_slots)
        src_slots, dst_slots = self._host_ordered(src_slots, dst_slots, to_device=to_device)
        self._copy(src, dst, src_slots, dst_slots, layers, to_device=to_device, keepalive=None)

    def _copy(self, src, dst, src_slots, dst_slots, layers, *, to_device: bool, keepalive: list | None) -> None:
        """Copy on the current stream (the engine stream inside ``_run``)."""
        if src_slots.numel() == 0:
            return
        if self.fp8:  # loads only (token writes refuse before they get here)
            load = fp8_token_load_triton if self._triton else fp8_token_load_reference
            for start, count in _layer_runs(layers):
                load(self.host_pool.fp8_values, self.host_pool.fp8_scales, dst, src_slots, dst_slots, start, count)
            return
        if self._triton:
            for start, count in _layer_runs(layers):
                kv_copy_triton(src, dst, src_slots, dst_slots, start, count, self.kernel_config)
            return
        if not self.is_cuda:
            for start, count in _layer_runs(layers):
                kv_copy_reference(src, dst, src_slots, dst_slots, start, count)
            return
        self._direct_cuda(src, dst, src_slots, dst_slots, layers, to_device=to_device, keepalive=keepalive)

    # --- direct backend on CUDA ----------------------------------------------------------
    def _page_blocks(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> list[tuple[int, int]] | None:
        """(src_page, dst_page) pairs when both lists are whole pages in order, else None."""
        ps = self.spec.page_size
        s, d = src_slots.cpu(), dst_slots.cpu()
        if s.numel() % ps:
            return None
        s, d = s.view(-1, ps), d.view(-1, ps)
        off = torch.arange(ps)
        if not (torch.equal(s - s[:, :1], off.expand_as(s)) and torch.equal(d - d[:, :1], off.expand_as(d))
                and bool((s[:, 0] % ps == 0).all()) and bool((d[:, 0] % ps == 0).all())):
            return None
        return list(zip((s[:, 0] // ps).tolist(), (d[:, 0] // ps).tolist()))

    def _direct_cuda(self, src, dst, src_slots, dst_slots, layers, *, to_device: bool, keepalive: list | None) -> None:
        # Host syncs here are inherent to this backend: host rows are gathered/scattered by
        # the CPU, so it needs the slot values there (see the module docstring).
        stream = torch.cuda.current_stream(self.device)
        ps = self.spec.page_size
        host_idx = (src_slots if to_device else dst_slots).cpu().to(torch.int64)
        dev_idx = (dst_slots if to_device else src_slots).to(self.device, torch.int64)
        ok = (host_idx >= 0) & (host_idx < self.host_pool.num_slots)
        ok_dev = ok.to(self.device) & (dev_idx >= 0) & (dev_idx < self.device_pool.num_slots)
        if not bool(ok_dev.all()):
            keep = ok_dev.cpu()
            host_idx, dev_idx = host_idx[keep], dev_idx[ok_dev]
        if host_idx.numel() == 0:
            return
        if self.host_pool.layout == "page_first_direct":
            blocks = self._page_blocks(host_idx, dev_idx)
            if blocks is not None:
                host = self.host_pool.kv_data  # [pages, L, B, ps, H, D]
                devd = self.device_pool.kv_data  # [B, L, slots, H, D]
                for layer in layers:
                    for hp, dp in blocks:
                        for b in range(self.spec.num_buffers):
                            h = host[hp, layer, b]
                            d = devd[b, layer, dp * ps:(dp + 1) * ps]
                            if to_device:
                                d.copy_(h, non_blocking=True)
                            else:
                                h.copy_(d, non_blocking=True)
                return
        hv, dv = self._host_view, self._dev_view
        nseg, row_len = row_segments(hv, dv)
        host_rows, dev_rows = row_matrix(hv, row_len), row_matrix(dv, row_len)
        parts = [(b, h) for b in range(self.spec.num_buffers) for h in range(nseg)]
        n = host_idx.numel()
        pending: list[tuple[torch.cuda.Event, torch.Tensor, list[torch.Tensor]]] = []
        for layer in layers:
            host_ids = [row_ids(hv, host_idx, layer, b, h, row_len) for b, h in parts]
            dev_ids = [row_ids(dv, dev_idx, layer, b, h, row_len) for b, h in parts]
            staging = torch.empty((len(parts), n, row_len), dtype=hv.dtype, pin_memory=True)
            if to_device:
                for i, ids in enumerate(host_ids):
                    torch.index_select(host_rows, 0, ids, out=staging[i])
                rows = staging.to(self.device, non_blocking=True)
                for i, ids in enumerate(dev_ids):
                    dev_rows.index_copy_(0, ids, rows[i])
                if keepalive is not None:
                    keepalive.append(rows)
            else:
                for i, ids in enumerate(dev_ids):
                    staging[i].copy_(dev_rows.index_select(0, ids), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                pending.append((ev, staging, host_ids))
                # Scatter the previous layer on the CPU while this one is in flight.
                if len(pending) > 1:
                    self._scatter_host(*pending.pop(0), host_rows)
        for item in pending:
            self._scatter_host(*item, host_rows)

    @staticmethod
    def _scatter_host(ev: torch.cuda.Event, staging: torch.Tensor, host_ids: list[torch.Tensor],
                      host_rows: torch.Tensor) -> None:
        ev.synchronize()
        for i, ids in enumerate(host_ids):
            host_rows.index_copy_(0, ids, staging[i])
