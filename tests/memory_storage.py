"""An in-memory L3 backend for the tests: a dict of sealed pages behind a lock, with switches
that make it raise, stall or lose pages, so the tree's storage paths can be driven through
faults. It keeps the ``HiCacheStorage`` contract (one bool per key, only new keys written,
length + checksum verified on every read, faults served as misses and counted)."""
from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import torch

from hicache.storage.base import HiCacheStorage, StorageConfig
from hicache.storage.integrity import CorruptPage, seal, unseal


class BackendDown(RuntimeError):
    """Raised inside the backend when a fault switch is on (never escapes its methods)."""


class MemoryStorage(HiCacheStorage):
    def __init__(self, config: Optional[StorageConfig] = None, objects: Optional[dict[str, bytes]] = None) -> None:
        super().__init__(config or StorageConfig())
        self.objects: dict[str, bytes] = {} if objects is None else objects
        """Shared between instances when passed in (two "machines" over one store)."""
        self.lock = threading.Lock()
        self.fail_get = self.fail_set = self.fail_exists = False
        self.get_delay_s = 0.0
        """Sleep before each page read (a slow backend)."""
        self.get_gate: Optional[threading.Event] = None
        """When set to an Event, page reads wait for it (a backend that hangs) once
        ``block_after`` pages have been read (None: every read waits)."""
        self.block_after: Optional[int] = None
        self.set_gate: Optional[threading.Event] = None
        """When set to an Event, every write waits for it (a slow write)."""
        self.raise_in_reads = False
        """Break the contract: let an exception escape ``batch_get`` (and ``get_pages``)."""
        self.pages_read = 0
        self.set_calls: list[list[str]] = []
        self.set_waiting = 0  # writes that reached set_gate

    # -- switches helpers ------------------------------------------------------------------
    def _fault(self) -> None:
        with self.lock:
            self.stats.faults += 1

    # -- interface -------------------------------------------------------------------------
    def batch_get(self, keys: Sequence[str],
                  targets: Optional[Sequence[torch.Tensor]] = None) -> list[Optional[torch.Tensor]]:
        if self.raise_in_reads:
            raise BackendDown("connection reset")
        out: list[Optional[torch.Tensor]] = []
        for i, k in enumerate(keys):
            gate = self.get_gate
            if gate is not None and (self.block_after is None or self.pages_read >= self.block_after):
                gate.wait()
            if self.get_delay_s:
                time.sleep(self.get_delay_s)
            with self.lock:
                self.stats.gets += 1
                obj = self.objects.get(k)
            try:
                if self.fail_get:
                    raise BackendDown("get failed")
                if obj is None:
                    with self.lock:
                        self.stats.misses += 1
                    out.append(None)
                    continue
                payload = unseal(obj)
            except (BackendDown, CorruptPage) as e:
                with self.lock:
                    self.stats.misses += 1
                    self.stats.corrupt += isinstance(e, CorruptPage)
                self._fault()
                out.append(None)
                continue
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if targets is not None:
                t = targets[i].view(torch.uint8).view(-1)
                if t.numel() != data.numel():
                    with self.lock:
                        self.stats.misses += 1
                        self.stats.corrupt += 1
                    self._fault()
                    out.append(None)
                    continue
                t.copy_(data)
                data = targets[i]
            with self.lock:
                self.stats.hits += 1
                self.stats.bytes_read += len(payload)
                self.pages_read += 1
            out.append(data)
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        if self.set_gate is not None:
            with self.lock:
                self.set_waiting += 1
            self.set_gate.wait()
        with self.lock:
            self.set_calls.append(list(keys))
        if self.fail_set:
            self._fault()
            return [False] * len(keys)
        out = []
        for k, v in zip(keys, values):
            with self.lock:
                if k in self.objects:
                    self.stats.skipped_existing += 1
                    out.append(True)
                    continue
            obj = seal(v.contiguous())
            with self.lock:
                self.objects[k] = obj
                self.stats.sets += 1
                self.stats.bytes_written += len(obj)
            out.append(True)
        return out

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if self.fail_exists:
            self._fault()
            return [False] * len(keys)
        with self.lock:
            return [k in self.objects for k in keys]

    def clear(self) -> None:
        with self.lock:
            self.objects.clear()

    def corrupt(self, key: str) -> None:
        """Flip one payload byte of ``key`` (its checksum no longer matches)."""
        with self.lock:
            b = bytearray(self.objects[key])
            b[-1] ^= 0xFF
            self.objects[key] = bytes(b)
