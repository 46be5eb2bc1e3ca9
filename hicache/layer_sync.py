"""LayerLoadCounter: lets the forward pass of layer N wait for layer N of a load-back only,
while later layers are still crossing PCIe (SGLang's ``LayerDoneCounter``).

A *producer* is one batch of host -> device loads issued together (``start_loading``);
its transfer handle records one event per layer on the transfer stream. The scheduler
marks which producer the next forward pass consumes (``set_consumer``); each attention
layer calls ``wait_until(layer)``, which makes the *current* stream wait for that layer's
event of the consumed producer and of every earlier producer still outstanding (their
slots may be read by the same batch). Nothing blocks the host.
"""
from __future__ import annotations

import threading
from typing import Protocol


class LayerHandle(Protocol):
    """What a producer must offer (``hicache.transfer.TransferHandle`` does)."""

    def wait_layer(self, layer: int) -> None: ...


class LayerLoadCounter:
    def __init__(self, num_layers: int) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._next = 0
        self._producers: dict[int, LayerHandle] = {}
        self._consumer = -1
        self.waits = 0  # wait_until calls that had something to wait for (metrics)

    def register(self, handle: LayerHandle) -> int:
        """Add one issued batch of loads; returns its producer id (increasing)."""
        with self._lock:
            pid = self._next
            self._next += 1
            self._producers[pid] = handle
            return pid

    def release(self, producer: int) -> None:
        """Forget a producer whose loads are complete (acknowledged)."""
        with self._lock:
            self._producers.pop(producer, None)

    def set_consumer(self, producer: int) -> None:
        """The next forward pass reads the slots of ``producer`` (and earlier ones); -1: none."""
        if not isinstance(producer, int) or producer < -1 or producer >= self._next:
            raise ValueError(f"producer must be -1 or an id returned by register() (< {self._next}), got {producer!r}")
        self._consumer = producer

    @property
    def consumer(self) -> int:
        return self._consumer

    def outstanding(self) -> int:
        with self._lock:
            return len(self._producers)

    def wait_until(self, layer: int) -> None:
        """Make the current stream wait until ``layer`` of every outstanding producer up to
        the consumer has landed on the device."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        with self._lock:
            handles = [h for pid, h in sorted(self._producers.items()) if pid <= self._consumer]
        if handles:
            self.waits += 1
        for h in handles:
            h.wait_layer(layer)
