"""Two costs of Triton's interpreter that the tests do not need to pay, taken out without
changing what an interpreted kernel computes.

One patching of ``triton.language`` per interpreted launch:

Under ``TRITON_INTERPRET=1`` Triton's interpreter swaps the language's builtins for numpy
implementations (``_patch_lang``) at every launch, and again at every call of a
``@triton.jit`` helper inside the kernel, without undoing the inner ones: the launch's own
restore puts the originals back. The inner patchings redo what the launch did (the same
module objects, ``triton.language`` and ``triton.language.core``), and they are most of
the calls: in ``test_lru_diff``'s trace test 5853 of 5973, a quarter of its time.
A patching covers the language modules the function's globals name, so a kernel that
names only ``triton.language`` leaves ``triton.language.core`` to the first helper that
names it (``triton.language.standard``'s reductions do). ``install`` makes each launch
patch both modules, and a helper call inside a running launch of the same thread skip
its patching. Launches restore as before, so kernels compute the same; another thread's
launch patches for itself, as without this.

One dtype table: ``_get_np_dtype`` (a Triton dtype's numpy dtype, asked for by most
interpreted operations) builds its 17-entry table at every call; ``install`` keeps one.
Together the two took 31 % off ``test_lru_diff.py`` and ``test_load_ahead.py`` (142 ->
98 s on one core).

No overflow check that is thrown away: the interpreter's options ask for integer-overflow
checks (``sanitize_overflow``) with ``debug`` off, so every 32-bit integer add, sub and mul
also casts both operands to int64, redoes the operation, compares the result with the type's
bounds and hands that condition to ``device_assert``, which without ``debug`` returns at once
and asserts nothing. ``install`` turns the check off where ``debug`` is off: the kernels
compute and assert the same, without a fifth of the interpreted operations.

Shapes worked out once: every interpreted operation makes a ``tensor`` and most a
``block_type``, whose constructors rebuild the shape each time (a ``triton.language.tuple``
whose type lists a ``constexpr_type`` per dimension, the power-of-two checks, the name
string), a fifth of what remained. ``install`` keeps what they derive from a shape of plain
ints, the first time the original constructor has built (and checked) it, and gives later
objects of that shape the same values (fresh tuples with the same contents); other shapes,
and a shape the checks refuse, still go through the original constructors.

Two lookups made once: a launch's patching lists the builtins of each language module and
class with ``inspect.getmembers`` (about 1,000 attributes, at every launch), though they
are the same at every launch (each launch restores them); ``install`` lists them once,
before any launch, and replays that list. ``_unwrap_if_constexpr``, which the language
calls on most arguments, answers a ``constexpr`` or a ``tensor`` (most of what it gets)
without its chain of ``isinstance`` checks, as the chain answers them.
"""
from __future__ import annotations

import dataclasses
import threading
import types

_state = threading.local()


class _LaunchScope:
    """The launch's patch scope; its restore ends the launch for this thread."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def restore(self) -> None:
        _state.active = False
        self._inner.restore()


def install() -> bool:
    """Wrap ``triton.runtime.interpreter._patch_lang``; False (and nothing changed) where the
    interpreter does not look as expected (its launch restores the scope ``_patch_lang``
    returns, its helper calls drop it)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    real = getattr(interpreter, "_patch_lang", None)
    if real is None or getattr(real, "_once_per_launch", False) or not hasattr(interpreter, "GridExecutor"):
        return False
    import triton.language as tl

    # a function whose globals name both language modules: patching "for" it patches both
    both = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})

    def patch_lang(fn):
        if getattr(_state, "active", False):
            return None  # a helper inside this thread's launch: already patched
        _state.active = True
        try:
            return _LaunchScope(real(both))
        except BaseException:
            _state.active = False
            raise

    patch_lang._once_per_launch = True
    interpreter._patch_lang = patch_lang
    _keep_one_dtype_table(interpreter)
    _no_dropped_overflow_checks(interpreter)
    _shapes_worked_out_once(tl.core)
    _builtins_listed_once(interpreter, tl)
    _quick_unwrap(tl.core)
    return True


def _builtins_listed_once(interpreter, tl) -> None:
    real, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    if real is None or patch_attr is None:
        return
    import inspect

    # what _patch_lang patches; listed now, while no launch has them patched
    listed = {}
    for pkg in (tl, tl.core, tl.tensor, tl.core.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)):
        if pkg is not None:
            listed[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]

    def patch_builtin(pkg, builder, scope):
        members = listed.get(pkg)
        if members is None:
            return real(pkg, builder, scope)
        for name, member in members:
            patch_attr(pkg, name, member, builder, scope)

    patch_builtin.__wrapped__ = real
    interpreter._patch_builtin = patch_builtin


def _quick_unwrap(core) -> None:
    real = getattr(core, "_unwrap_if_constexpr", None)
    if real is None or hasattr(real, "__wrapped__"):
        return
    constexpr, tensor = core.constexpr, core.tensor

    def unwrap(o):
        t = type(o)
        if t is constexpr:
            return o.value
        if t is tensor:
            return o
        return real(o)

    unwrap.__wrapped__ = real
    core._unwrap_if_constexpr = unwrap


def _int_key(shape):
    """The dimensions of a list or ``triton.language.tuple`` of plain ints, else None."""
    values = shape.values if type(shape) is _tl_tuple else shape if type(shape) is list else None
    if values is None:
        return None
    for d in values:
        if type(d) is not int:
            return None
    return tuple(values)


_tl_tuple = None


def _shapes_worked_out_once(core) -> None:
    global _tl_tuple
    block_type, tensor, tl_tuple = core.block_type, core.tensor, core.tuple
    real_block, real_tensor = block_type.__init__, tensor.__init__
    if getattr(real_block, "_worked_out_once", False):
        return
    _tl_tuple = tl_tuple
    blocks = {}  # dims -> (the block_type's shape tuple, numel, str of the shape)
    tensors = {}  # dims -> (numel, the tensor's shape tuple's type, its constexprs)

    def block_init(self, element_ty, shape):
        key = _int_key(shape)
        got = blocks.get(key) if key is not None else None
        if got is None:
            real_block(self, element_ty, shape)
            if key is not None:
                blocks[key] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape = tl_tuple(list(got[0].values), got[0].type)
        self.numel = got[1]
        self.name = f"<{got[2]}, {element_ty}>"

    def tensor_init(self, handle, type):
        key = _int_key(type.shape) if type.is_block() else ()
        got = tensors.get(key) if key is not None else None
        if got is None:
            real_tensor(self, handle, type)
            if key is not None:
                tensors[key] = (self.numel, self.shape.type, list(self.shape.values))
            return
        self.handle = handle
        self.numel = got[0]
        self.type = type
        self.dtype = type.scalar
        self.shape = tl_tuple(list(got[2]), got[1])

    block_init._worked_out_once = True
    block_init.__wrapped__ = real_block
    tensor_init.__wrapped__ = real_tensor
    block_type.__init__ = block_init
    tensor.__init__ = tensor_init


def _no_dropped_overflow_checks(interpreter) -> None:
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True) \
            or not getattr(options, "sanitize_overflow", False):
        return  # with debug on the checks assert: kept
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _keep_one_dtype_table(interpreter) -> None:
    real = getattr(interpreter, "_get_np_dtype", None)
    if real is None:
        return
    import triton.language as tl

    # the interpreter's own answers, asked once per dtype it knows
    table = {}
    for name in ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                 "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8", "float8e4b15"):
        ty = getattr(tl, name, None)
        if ty is not None:
            table[ty] = real(ty)
    pointer = real(tl.pointer_type(tl.int8))

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            element = tt_dtype.element_ty
            return pointer if isinstance(element, tl.pointer_type) else table[element]
        got = table.get(tt_dtype)
        return got if got is not None else real(tt_dtype)

    get_np_dtype.__wrapped__ = real
    interpreter._get_np_dtype = get_np_dtype
