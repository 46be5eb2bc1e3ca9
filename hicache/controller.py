"""HiCacheController: moves KV between the device pool (L1) and the host pool (L2) for the
HiRadixTree, as SGLang's ``HiCacheController``.

* ``write`` / ``load`` only *queue* an operation (slots already allocated by the tree);
  ``start_writing`` / ``start_loading`` issue everything queued as one batched transfer on
  the transfer engine's own CUDA stream. They run on the scheduler thread, so the transfer
  stream is ordered after the compute that produced the KV being written.
* Loads are issued layer by layer (one event per layer); ``start_loading`` registers the
  batch with :class:`~hicache.layer_sync.LayerLoadCounter` so layer N of the forward pass
  waits for layer N only.
* A worker thread waits for each issued batch to finish and puts an :class:`AckBatch` (its
  ack ids and whether the copy succeeded) on ``ack_write_queue`` / ``ack_load_queue``; the
  scheduler polls them every step through the tree's ``writing_check`` / ``loading_check``
  (which hold lock refs until the ack).
* A transfer that raises (when issued or while the worker waits for it) is not re-raised on
  the scheduler thread: its batch is acknowledged with ``ok=False`` so the tree can undo what
  it reserved for it (a failed backup leaves the node device-only, a failed load leaves it
  host-only) — faults degrade to a cache miss, never to KV that is claimed but wrong. The
  error is logged, kept in ``last_error`` and counted in ``stats()``.

On CPU the transfer engine copies synchronously; the same queues, worker and acks run, so
the tests exercise the scheduler-visible behaviour.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hicache.config import HiCacheConfig, IO_BACKENDS, WRITE_POLICIES
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.layer_sync import LayerLoadCounter

logger = logging.getLogger(__name__)


@dataclass
class AckBatch:
    """One finished (or failed) batch of transfers: ``ack_ids`` as queued by ``write`` /
    ``load``; ``ok`` False when the copy raised (``error``), so its destination holds no
    valid KV."""

    ack_ids: list[int]
    ok: bool = True
    error: Optional[BaseException] = None
    producer: int = -1  # LayerLoadCounter id of a load batch (-1: none)


@dataclass
class _Pending:
    """Queued (not yet issued) transfers of one direction."""

    src: list[torch.Tensor] = field(default_factory=list)
    dst: list[torch.Tensor] = field(default_factory=list)
    acks: list[int] = field(default_factory=list)

    def clear(self) -> None:
        self.src.clear()
        self.dst.clear()
        self.acks.clear()


class HiCacheController:
    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, write_policy: str = "write_through",
                 io_backend: str = "kernel", tp_group: Any = None, transfer: Any = None,
                 poll_interval_s: float = 5e-5) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend must be one of {IO_BACKENDS}, got {io_backend!r}")
        if host_pool.page_size != device_pool.page_size:
            raise ValueError(f"host_pool.page_size={host_pool.page_size} must equal device_pool.page_size="
                             f"{device_pool.page_size}")
        if transfer is None:
            from hicache.transfer import KVTransferEngine

            transfer = KVTransferEngine(device_pool, host_pool, io_backend=io_backend)
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.transfer = transfer
        self.write_policy = write_policy
        self.io_backend = io_backend
        self.tp_group = tp_group
        self.page_size = device_pool.page_size
        self.device_num_slots = device_pool.num_slots
        self.host_num_slots = host_pool.num_slots
        self._token_bytes = device_pool.spec.token_bytes
        self.layer_counter = LayerLoadCounter(device_pool.spec.num_layers)

        self._write_q = _Pending()
        self._load_q = _Pending()
        self.ack_write_queue: "queue.Queue[AckBatch]" = queue.Queue()
        self.ack_load_queue: "queue.Queue[AckBatch]" = queue.Queue()
        self._inflight: "queue.Queue[Optional[tuple[str, Any, int, list[int], Optional[BaseException]]]]" = queue.Queue()
        self._cv = threading.Condition()
        self._issued = {"write": 0, "load": 0}
        self._finished = {"write": 0, "load": 0}
        self._failed = {"write": 0, "load": 0}
        self.last_error: Optional[BaseException] = None
        self._poll = poll_interval_s
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self._worker = threading.Thread(target=self._run, name="hicache-transfer-ack", daemon=True)
        self._worker.start()

    @classmethod
    def from_config(cls, config: HiCacheConfig, device_pool: DeviceKVPool, host_pool: HostKVPool,
                    tp_group: Any = None) -> "HiCacheController":
        if config.page_size != device_pool.page_size:
            raise ValueError(f"--page-size={config.page_size} must equal the device pool's page_size="
                             f"{device_pool.page_size}")
        if config.hicache_mem_layout != host_pool.layout:
            raise ValueError(f"--hicache-mem-layout={config.hicache_mem_layout} but the host pool was built "
                             f"with layout={host_pool.layout}")
        if config.hicache_host_kv_dtype != host_pool.kv_format.host_kv_dtype:
            raise ValueError(f"--hicache-host-kv-dtype={config.hicache_host_kv_dtype} but the host pool was built "
                             f"with host_kv_dtype={host_pool.kv_format.host_kv_dtype}")
        return cls(device_pool, host_pool, config.hicache_write_policy, config.hicache_io_backend, tp_group)

    # ------------------------------------------------------------------ slots
    def alloc_device(self, n: int) -> Optional[torch.Tensor]:
        return self.device_pool.allocator.alloc(n)

    def free_device(self, slots: torch.Tensor) -> None:
        self.device_pool.allocator.free(slots)

    def alloc_host(self, n: int) -> Optional[torch.Tensor]:
        return self.host_pool.alloc(n)

    def free_host(self, slots: torch.Tensor) -> None:
        self.host_pool.free(slots)

    # ------------------------------------------------------------------ queueing
    def write(self, device_indices: torch.Tensor, host_indices: torch.Tensor, ack_id: int) -> None:
        """Queue a device -> host copy (int64 [N] each); acked as ``ack_id``."""
        if device_indices.numel() != host_indices.numel():
            raise ValueError(f"device_indices ({device_indices.numel()}) and host_indices ({host_indices.numel()}) "
                             "must have the same length")
        self._write_q.src.append(device_indices)
        self._write_q.dst.append(host_indices)
        self._write_q.acks.append(ack_id)

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, ack_id: int) -> None:
        """Queue a host -> device copy (int64 [N] each); acked as ``ack_id``."""
        if device_indices.numel() != host_indices.numel():
            raise ValueError(f"host_indices ({host_indices.numel()}) and device_indices ({device_indices.numel()}) "
                             "must have the same length")
        self._load_q.src.append(host_indices)
        self._load_q.dst.append(device_indices)
        self._load_q.acks.append(ack_id)

    def _cat(self, xs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        return torch.cat([x.to(device=device, dtype=torch.int64) for x in xs])

    def start_writing(self) -> int:
        """Issue every queued write as one transfer; returns tokens issued (a batch whose
        transfer raises is acknowledged as failed instead)."""
        q = self._write_q
        if not q.acks:
            return 0
        dev = self._cat(q.src, self.device_pool.device)
        host = self._cat(q.dst, torch.device("cpu"))
        acks = list(q.acks)
        q.clear()
        try:
            handle = self.transfer.backup(dev, host)
        except Exception as e:  # acked as failed by the worker, in issue order
            self._submit("write", None, -1, acks, e)
            return 0
        self.bytes_d2h += int(dev.numel()) * self._token_bytes
        self._submit("write", handle, -1, acks)
        return int(dev.numel())

    def start_loading(self) -> int:
        """Issue every queued load as one layer-wise transfer; returns the producer id for
        ``layer_counter.set_consumer`` (-1: nothing queued, or the transfer raised and the
        batch is acknowledged as failed)."""
        q = self._load_q
        if not q.acks:
            return -1
        host = self._cat(q.src, torch.device("cpu"))
        dev = self._cat(q.dst, self.device_pool.device)
        acks = list(q.acks)
        q.clear()
        try:
            handle = self.transfer.load(host, dev)
        except Exception as e:
            self._submit("load", None, -1, acks, e)
            return -1
        pid = self.layer_counter.register(handle)
        self.layer_counter.set_consumer(pid)
        self.bytes_h2d += int(dev.numel()) * self._token_bytes
        self._submit("load", handle, pid, acks)
        return pid

    # ------------------------------------------------------------------ worker + acks
    def _submit(self, kind: str, handle: Any, pid: int, acks: list[int],
                error: Optional[BaseException] = None) -> None:
        with self._cv:
            self._issued[kind] += 1
        self._inflight.put((kind, handle, pid, acks, error))

    def _run(self) -> None:
        while True:
            item = self._inflight.get()
            if item is None:
                return
            kind, handle, pid, acks, error = item
            if error is None:
                try:
                    while not handle.done():
                        time.sleep(self._poll)
                except Exception as e:
                    error = e
            if error is not None:
                # The destination slots hold partial or no KV: the ack says so, and the tree
                # undoes the node's claim on them instead of marking the copy complete.
                logger.warning("hicache %s of %d ack(s) failed: %r", kind, len(acks), error)
                self.last_error = error
            batch = AckBatch(acks, ok=error is None, error=error, producer=pid)
            (self.ack_write_queue if kind == "write" else self.ack_load_queue).put(batch)
            with self._cv:
                self._finished[kind] += 1
                if error is not None:
                    self._failed[kind] += 1
                self._cv.notify_all()

    def _wait(self, kind: str, timeout: Optional[float]) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._finished[kind] >= self._issued[kind], timeout=timeout)
        if not ok:
            raise TimeoutError(f"hicache: {kind}s still in flight after {timeout} s")

    def wait_writes(self, timeout: Optional[float] = 60.0) -> None:
        """Block until every issued write has been acknowledged (acks stay queued; failed
        copies are acknowledged with ``ok=False``, not raised)."""
        self._wait("write", timeout)

    def wait_loads(self, timeout: Optional[float] = 60.0) -> None:
        self._wait("load", timeout)

    def write_acks_ready(self) -> int:
        return self.ack_write_queue.qsize()

    def load_acks_ready(self) -> int:
        return self.ack_load_queue.qsize()

    def pop_write_result(self) -> AckBatch:
        """Oldest finished write batch, with its success flag (call at most
        write_acks_ready() times)."""
        return self.ack_write_queue.get_nowait()

    def pop_load_result(self) -> AckBatch:
        """Oldest finished load batch; its layer producer is released."""
        batch = self.ack_load_queue.get_nowait()
        self.layer_counter.release(batch.producer)
        return batch

    def pop_write_ack(self) -> list[int]:
        """Ack ids of the oldest finished write batch (success flag dropped: see
        ``pop_write_result``)."""
        return self.pop_write_result().ack_ids

    def pop_load_ack(self) -> list[int]:
        return self.pop_load_result().ack_ids

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, int]:
        with self._cv:
            failed = dict(self._failed)
            w_inflight = self._issued["write"] - self._finished["write"]
            l_inflight = self._issued["load"] - self._finished["load"]
        return {
            "bytes_d2h": self.bytes_d2h,
            "bytes_h2d": self.bytes_h2d,
            "write_queue_depth": len(self._write_q.acks),
            "load_queue_depth": len(self._load_q.acks),
            "writes_in_flight": w_inflight,
            "loads_in_flight": l_inflight,
            "write_acks_pending": self.ack_write_queue.qsize(),
            "load_acks_pending": self.ack_load_queue.qsize(),
            "write_batches_failed": failed["write"],
            "load_batches_failed": failed["load"],
            "device_free_tokens": self.device_pool.allocator.available_size(),
            "host_free_tokens": self.host_pool.available_size(),
        }

    def close(self) -> None:
        """Stop the worker thread (after the transfers already issued)."""
        if self._worker.is_alive():
            self._inflight.put(None)
            self._worker.join(timeout=10)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
