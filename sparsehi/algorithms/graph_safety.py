"""Capture safety of algorithm hooks, as the author test kit checks it.

The decode step runs inside a CUDA graph: captured once per batch-size bucket, then
replayed with new contents copied into the same input tensors. A hook
(``retrieve_topk``, ``update_representations``) is capture safe when

1. it makes no host synchronisation (``.item()``, ``.tolist()``, ``bool(t)``,
   ``int(t)``, ``.cpu()``, ...): under capture those raise, and no Python runs at replay;
2. it produces no data-dependent shapes (``nonzero``, boolean-mask indexing,
   ``masked_select``, ``unique``, ...): those read a count back to the host;
3. everything it derives from its input tensors is computed inside the call: a tensor
   derived from one call's inputs and cached on the host side (keyed on tensor identity,
   version or ``data_ptr``) is baked into the graph at capture and served, stale, by every
   replay.

Two ways to check them (:class:`EmulatedReplay` everywhere, :class:`CudaGraphReplay` on
CUDA) behind one interface, :class:`StaticCall`: ``load`` new input contents, ``capture``
once, ``replay`` as often as needed.
"""
from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclass
class CaptureFinding:
    """One capture-safety problem: which hook, which call, where in the author's code."""

    hook: str
    call: str
    where: str
    why: str

    def __str__(self) -> str:
        return f"{self.hook}: {self.call} at {self.where}: {self.why}"


class CaptureUnsafe(Exception):
    """Raised inside a hook by :class:`HostSyncDetector` (or around a failed CUDA capture)."""

    def __init__(self, finding: CaptureFinding) -> None:
        super().__init__(str(finding))
        self.finding = finding


# ----------------------------------------------------------------------------- detector
_SYNC = "reads a tensor value back to the host (a device sync; raises under CUDA-graph capture)"
_SHAPE = "has a data-dependent output shape (reads a count back to the host; raises under capture)"
_HOST_COPY = "copies device data to the host (a device sync; raises under CUDA-graph capture)"

_T = torch.Tensor
# calls that are unsafe whatever their arguments
_ALWAYS: dict[Any, tuple[str, str]] = {
    _T.item: ("Tensor.item", _SYNC),
    _T.tolist: ("Tensor.tolist", _SYNC),
    _T.__bool__: ("Tensor.__bool__ (bool(t), `if t:`, `and`/`or` on a tensor)", _SYNC),
    _T.__int__: ("Tensor.__int__ (int(t))", _SYNC),
    _T.__float__: ("Tensor.__float__ (float(t))", _SYNC),
    _T.__index__: ("Tensor.__index__ (a tensor used as a Python index or size)", _SYNC),
    _T.__contains__: ("Tensor.__contains__ (`x in t`)", _SYNC),
    _T.__format__: ("Tensor.__format__ (formatting a tensor's values)", _SYNC),
    _T.__repr__: ("Tensor.__repr__ (printing a tensor)", _SYNC),
    _T.numpy: ("Tensor.numpy", _HOST_COPY),
    _T.cpu: ("Tensor.cpu", _HOST_COPY),
    _T.is_nonzero: ("Tensor.is_nonzero", _SYNC),
    torch.is_nonzero: ("torch.is_nonzero", _SYNC),
    _T.equal: ("Tensor.equal (returns a Python bool)", _SYNC),
    torch.equal: ("torch.equal (returns a Python bool)", _SYNC),
    _T.allclose: ("Tensor.allclose (returns a Python bool)", _SYNC),
    torch.allclose: ("torch.allclose (returns a Python bool)", _SYNC),
    _T.nonzero: ("Tensor.nonzero", _SHAPE),
    torch.nonzero: ("torch.nonzero", _SHAPE),
    _T.argwhere: ("Tensor.argwhere", _SHAPE),
    torch.argwhere: ("torch.argwhere", _SHAPE),
    _T.masked_select: ("Tensor.masked_select", _SHAPE),
    torch.masked_select: ("torch.masked_select", _SHAPE),
    _T.unique: ("Tensor.unique", _SHAPE),
    torch.unique: ("torch.unique", _SHAPE),
    _T.unique_consecutive: ("Tensor.unique_consecutive", _SHAPE),
    torch.unique_consecutive: ("torch.unique_consecutive", _SHAPE),
}
if hasattr(_T, "__array__"):
    _ALWAYS[_T.__array__] = ("Tensor.__array__ (numpy conversion)", _HOST_COPY)


def _is_mask(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8)


def _has_mask_index(index: Any) -> bool:
    if isinstance(index, (tuple, list)):
        return any(_is_mask(i) for i in index)
    return _is_mask(index)


def _names_host(device: Any) -> bool:
    """A ``.to`` target spelled as the host: the string ``'cpu'`` (``.to(self.device)``
    with a CPU device is the normal path on a CPU run and is not flagged here)."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _argument_finding(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[str, str]]:
    """Unsafe calls that depend on their arguments (checked before the call)."""
    if func is _T.__getitem__ and len(args) >= 2 and _has_mask_index(args[1]):
        return "boolean-mask indexing t[mask]", _SHAPE
    # t[mask] = <number> becomes masked_fill_ (no sync); a tensor value goes through
    # index_put_, which turns the mask into indices with nonzero
    if (func is _T.__setitem__ and len(args) >= 3 and _has_mask_index(args[1])
            and isinstance(args[2], torch.Tensor) and (args[2].numel() != 1 or args[2].device.type != "cpu")):
        return "boolean-mask assignment t[mask] = values", _SHAPE
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "torch.where(condition) with one argument (= nonzero)", _SHAPE
    if func in (torch.repeat_interleave, _T.repeat_interleave) and kwargs.get("output_size") is None:
        name = "torch.repeat_interleave" if func is torch.repeat_interleave else "Tensor.repeat_interleave"
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if repeats is None or isinstance(repeats, torch.Tensor):
            return f"{name} with tensor repeats and no output_size", _SHAPE
    if func is _T.to:
        targets = list(args[1:]) + [kwargs.get("device")]
        if any(_names_host(t) for t in targets):
            return "Tensor.to('cpu')", _HOST_COPY
    return None


def _result_finding(func: Any, args: tuple, result: Any) -> Optional[tuple[str, str]]:
    """Unsafe calls seen from their result: device data landing on the host."""
    if func is _T.to and isinstance(result, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
        if args[0].device.type != "cpu" and result.device.type == "cpu":
            return "Tensor.to(<host device>)", _HOST_COPY
    if func is _T.copy_ and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]):
        if args[0].device.type == "cpu" and args[1].device.type != "cpu":
            return "Tensor.copy_ from the device into a host tensor", _HOST_COPY
    return None


def caller_location(frames: Optional[list] = None) -> str:
    """``path:line in function`` of the innermost frame outside torch and this module (the
    author's line that made the call)."""
    frames = frames if frames is not None else traceback.extract_stack()
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        if path == _THIS_FILE or path.startswith(_TORCH_DIR) or "<frozen" in fr.filename:
            continue
        try:
            shown = os.path.relpath(path)
        except ValueError:  # another drive (Windows)
            shown = path
        if shown.startswith(".."):
            shown = path
        return f"{shown}:{fr.lineno} in {fr.name}"
    return "<unknown>"


class HostSyncDetector(TorchFunctionMode):
    """Raise :class:`CaptureUnsafe` at the first graph-unsafe torch call made while active.

    Intercepts, through ``torch.overrides.TorchFunctionMode``: host read-backs
    (``Tensor.item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``,
    ``torch.equal``, ...), data-dependent shapes (``nonzero``, ``argwhere``,
    ``masked_select``, ``unique``, boolean-mask indexing ``t[mask]``, one-argument
    ``torch.where``, ``repeat_interleave`` without ``output_size``) and copies to the
    host (``.cpu()``, ``.numpy()``, ``.to('cpu')``; any ``.to``/``copy_`` that moves device
    data to the host). On a CPU run every tensor is a "device" tensor: a read-back of a
    helper tensor that would live on the host in serving is flagged too.
    """

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook = hook

    def _raise(self, call: str, why: str) -> None:
        raise CaptureUnsafe(CaptureFinding(self.hook, call, caller_location(), why))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = _ALWAYS.get(func) if _hashable(func) else None
        if hit is None:
            hit = _argument_finding(func, args, kwargs)
        if hit is not None:
            self._raise(*hit)
        result = func(*args, **kwargs)
        hit = _result_finding(func, args, result)
        if hit is not None:
            self._raise(*hit)
        return result


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


@contextmanager
def simulated_capture() -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` reports True (and, without CUDA,
    ``torch.cuda.is_initialized()`` too), so a hook takes the path it takes under capture
    (e.g. skips its host-side value checks, as ``sparsehi.input_checks.host_checks_enabled``
    does). A hook that calls other ``torch.cuda`` functions on that path needs a GPU."""
    cuda = torch.cuda
    saved = cuda.is_current_stream_capturing, cuda.is_initialized
    cuda.is_current_stream_capturing = lambda: True  # type: ignore[assignment]
    if not saved[1]():
        cuda.is_initialized = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        cuda.is_current_stream_capturing, cuda.is_initialized = saved  # type: ignore[assignment]


@contextmanager
def sync_debug_errors() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block (restored after)."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


# ----------------------------------------------------------------------------- replay
class StaticCall:
    """``fn()`` over static input tensors (``inputs``, read by ``fn``): ``load`` new
    contents, ``capture`` once, ``replay`` -> ``fn``'s outputs for the loaded contents."""

    kind = "abstract"

    def __init__(self, hook: str, fn: Callable[[], Any], inputs: dict[str, Any]) -> None:
        self.hook = hook
        self.fn = fn
        self.inputs = inputs

    def load(self, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def capture(self) -> None:
        raise NotImplementedError

    def replay(self) -> Any:
        raise NotImplementedError

    def _tensors(self, values: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensor entries of ``values``, checked against the static buffers (a non-tensor
        input is a constant of the capture: it must not change)."""
        out = {}
        for k, v in values.items():
            t = self.inputs[k]
            if not isinstance(t, torch.Tensor):
                if v is not t and v != t:
                    raise ValueError(f"static input {k!r} is the constant {t!r}; a replay cannot change it to {v!r}")
                continue
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
                got = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"static input {k!r} is {tuple(t.shape)} {t.dtype}, got {got}")
            out[k] = v
        return out


class EmulatedReplay(StaticCall):
    """Capture and replay without a GPU. ``capture`` calls ``fn`` twice: a warm-up (plain
    eager call, as the warm-up before a real capture) and the capture call; ``capture``
    and ``replay`` calls run under :func:`simulated_capture` and :class:`HostSyncDetector`.
    ``load`` writes new contents through ``tensor.data``, which leaves the tensors'
    identity, ``data_ptr`` and version counter as they were: host code sees exactly what it
    sees when a graph replays after its static inputs were refilled, so a host-side cache
    keyed on them serves stale tensors here as it would in the graph."""

    kind = "emulated"

    def load(self, values: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, v in self._tensors(values).items():
                self.inputs[k].data.copy_(v)

    def _run(self) -> Any:
        with simulated_capture(), HostSyncDetector(self.hook):
            return self.fn()

    def capture(self) -> None:
        self.fn()
        self._run()

    def replay(self) -> Any:
        return self._run()


class CudaGraphReplay(StaticCall):
    """A real ``torch.cuda.CUDAGraph``: warm-up on a side stream, capture with
    ``torch.cuda.set_sync_debug_mode("error")``, replay under the same mode. A capture
    that raises becomes :class:`CaptureUnsafe` naming the author's line."""

    kind = "cuda graph"

    def __init__(self, hook: str, fn: Callable[[], Any], inputs: dict[str, torch.Tensor], warmup: int = 2) -> None:
        super().__init__(hook, fn, inputs)
        self.warmup = warmup
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.outputs: Any = None

    def load(self, values: dict[str, Any]) -> None:
        for k, v in self._tensors(values).items():
            self.inputs[k].copy_(v)

    def capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph):
                with sync_debug_errors():
                    self.outputs = self.fn()
        except Exception as e:  # noqa: BLE001 - any failure to capture is the finding
            # a capture that fails to end leaves its side stream current: restore ours
            torch.cuda.set_stream(stream)
            raise CaptureUnsafe(_capture_error(self.hook, e)) from e
        self.graph = graph

    def replay(self) -> Any:
        if self.graph is None:
            raise RuntimeError("replay before capture")
        try:
            with sync_debug_errors():
                self.graph.replay()
        except Exception as e:  # noqa: BLE001
            raise CaptureUnsafe(CaptureFinding(self.hook, "CUDAGraph.replay", "<graph>", _first_line(e))) from e
        torch.cuda.synchronize()
        return self.outputs


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _capture_error(hook: str, err: BaseException) -> CaptureFinding:
    """The first error of a failed capture (the graph's exit may raise a second one on top)
    and the author's line it came from."""
    chain = [err]
    while chain[-1].__context__ is not None and len(chain) < 8:
        chain.append(chain[-1].__context__)
    root = chain[-1]
    frames = traceback.extract_tb(root.__traceback__) if root.__traceback__ is not None else []
    msg = _first_line(root) + ("" if root is err else f" (then {_first_line(err)})")
    return CaptureFinding(hook, "CUDA-graph capture", caller_location(frames) if frames else "<unknown>", msg)


def raised_finding(hook: str, err: BaseException) -> CaptureFinding:
    """A hook that raised while captured or replayed (other than by the detector)."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
    return CaptureFinding(hook, "raised under capture", caller_location(frames) if frames else "<unknown>",
                          _first_line(err))
