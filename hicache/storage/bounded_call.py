"""Blocking calls into native clients, bounded by a deadline.

A storage client's call can block far longer than a request may wait (a hung master holds an
RPC for its own deadline, tens of seconds). ``BoundedCaller.call`` runs the call on a daemon
thread and waits at most ``timeout`` seconds; a call that overruns is *abandoned*: the caller
gets ``CallTimeout`` at once, the thread finishes in its own time, and ``stuck`` counts it
until then. The caller must not hand an abandoned call memory it will reuse — the call may
still write there when it finally returns.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional


class CallTimeout(TimeoutError):
    """The call did not return within its deadline (it may still be running)."""


class BoundedCaller:
    """Runs calls on daemon threads (so a stuck call never blocks interpreter exit)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._inflight = 0
        self._stuck = 0
        self._idle = threading.Condition(self._lock)

    @property
    def stuck(self) -> int:
        """Abandoned calls that have not returned yet."""
        with self._lock:
            return self._stuck

    @property
    def inflight(self) -> int:
        """Calls running now, abandoned ones included."""
        with self._lock:
            return self._inflight

    def call(self, fn: Callable[[], Any], timeout: float,
             on_abandoned_result: Optional[Callable[[Any], None]] = None) -> Any:
        """``fn()``'s result, or its exception re-raised, or ``CallTimeout`` after ``timeout``
        seconds. ``on_abandoned_result(result)`` runs on the worker thread when an abandoned
        call returns normally (e.g. to close a client whose set-up finished too late)."""
        state = {"done": False, "abandoned": False}
        box: dict[str, Any] = {}
        finished = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised on the caller's thread
                box["error"] = exc
            with self._lock:
                state["done"] = True
                self._inflight -= 1
                abandoned = state["abandoned"]
                if abandoned:
                    self._stuck -= 1
                self._idle.notify_all()
            finished.set()
            if abandoned and on_abandoned_result is not None and "value" in box:
                try:
                    on_abandoned_result(box["value"])
                except Exception:  # nothing is waiting for it; never kill the thread noisily
                    pass

        with self._lock:
            self._inflight += 1
        threading.Thread(target=run, name=f"{self.name}-call", daemon=True).start()
        if not finished.wait(timeout):
            with self._lock:
                if not state["done"]:
                    state["abandoned"] = True
                    self._stuck += 1
                    raise CallTimeout(f"{self.name}: call did not return within {timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call runs; False when some still run after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True
