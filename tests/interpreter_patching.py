"""Costs of Triton's interpreter that the tests do not need to pay, taken out without
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
without its chain of ``isinstance`` checks, as the chain answers them (also a plain int,
float, bool, str, None or dtype, which it returns as they are).

Less work per operation (together about a quarter of ``test_load_ahead.py`` and
``test_lru_diff.py``, 67 -> 49 CPU-s): a patched builtin calls the language's function
itself, not through the wrapper whose one check the interpreter's ``_semantic`` always
passes, and is made once, not at every launch; two tensors of one type through a binary
operation's implicit casts and broadcasts come out as they went in (``TritonSemantic``
works that out at each operation, a third of the time), and the computation type of two
dtypes, a function of their names and flags, is asked of the original once.
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
    _direct_builtin_calls(interpreter, tl.core)
    _builtins_listed_once(interpreter, tl)
    _quick_unwrap(tl.core)
    _same_type_operands_kept(tl.core)
    return True


def _direct_builtin_calls(interpreter, core) -> None:
    """A patched builtin calls the function ``triton.language.core.builtin`` wrapped, with
    ``_semantic`` set in the keywords it got, where the interpreter's lambda copied the
    keywords without ``_semantic`` and called the wrapper, whose one check (``_semantic``
    given, not None) then always passes: one call and one dict fewer per operation."""
    real = getattr(interpreter, "_patch_attr", None)
    if real is None or hasattr(real, "__wrapped__") or not hasattr(interpreter, "interpreter_semantic"):
        return
    wrapper_code = core.builtin(lambda: None).__code__  # the code of every builtin's wrapper
    made = {}  # (obj, name, member) -> its patched member: the same at every launch

    def patch_attr(obj, name, member, builder, scope):
        key = (obj, name, member)
        new_member = made.get(key)
        if new_member is None:
            fn = member.__wrapped__ if getattr(member, "__code__", None) is wrapper_code else member

            def new_member(*args, **kwargs):
                kwargs["_semantic"] = interpreter.interpreter_semantic
                return fn(*args, **kwargs)

            made[key] = new_member
        scope.set_attr(obj, name, new_member)

    patch_attr.__wrapped__ = real
    interpreter._patch_attr = patch_attr


def _same_type_operands_kept(core) -> None:
    """Two tensors of one type through a binary operation's implicit casting and
    broadcasting come out as they went in, where ``TritonSemantic`` works that out each time
    (a third of an interpreted kernel's time): the computation type of two equal dtypes is
    that dtype except for a division of floats below 32 bits (asked of
    ``computation_type_impl`` once per dtype, and not taken where it differs or raises), a
    cast to the operand's own dtype returns the operand, and operands of one shape are not
    broadcast. Anything else (a Python number, pointers, other dtypes or shapes) goes
    through the original methods."""
    try:
        from triton.language.semantic import TritonSemantic
    except ImportError:
        return
    real_check = getattr(TritonSemantic, "binary_op_type_checking_impl", None)
    real_broadcast = getattr(TritonSemantic, "broadcast_impl_value", None)
    if real_check is None or real_broadcast is None or hasattr(real_check, "__wrapped__"):
        return
    tensor, block_type = core.tensor, core.block_type
    keeps = {}  # (dtype name, div_or_mod) -> the computation type of two of that dtype is that dtype

    def same_type(lt, rt) -> bool:
        if lt is rt:
            return True
        if type(lt) is block_type:
            if type(rt) is not block_type or lt.element_ty != rt.element_ty:
                return False
            key = _int_key(lt.shape)
            return key is not None and key == _int_key(rt.shape)
        return not lt.is_block() and not rt.is_block() and lt == rt

    def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                     arithmetic_check=True, div_or_mod=False):
        if arithmetic_check and type(lhs) is tensor and type(rhs) is tensor and same_type(lhs.type, rhs.type):
            dtype = lhs.dtype
            if not dtype.is_ptr():
                key = (dtype.name, div_or_mod)
                keep = keeps.get(key)
                if keep is None:
                    try:
                        keep = self.computation_type_impl(dtype, False, dtype, False, div_or_mod) == dtype
                    except Exception:
                        keep = False  # the original raises it
                    keeps[key] = bool(keep)
                if keep:
                    return lhs, rhs
        return real_check(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    def broadcast_impl_value(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if type(lt) is block_type:
            if type(rt) is block_type:
                key = _int_key(lt.shape)
                if key is not None and key == _int_key(rt.shape):
                    return lhs, rhs
        elif not lt.is_block() and not rt.is_block():
            return lhs, rhs  # two scalars: the original returns them too
        return real_broadcast(self, lhs, rhs)

    real_computation = TritonSemantic.computation_type_impl
    computed = {}  # the arguments' names and flags -> 0 / 1 (it returned a_ty / b_ty) or the dtype returned

    def computation_type_impl(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
        # which argument (or constant) it returns follows from the dtypes' names (their kinds,
        # widths and signedness) and the flags; whether the two are one object tells a_ty
        # from b_ty where both have one name
        key = (a_ty.name, a_is_scalar, b_ty.name, b_is_scalar, div_or_mod, a_ty is b_ty)
        got = computed.get(key)
        if got is None:
            ret = real_computation(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)  # or raises
            computed[key] = 0 if ret is a_ty else 1 if ret is b_ty else ret
            return ret
        if type(got) is int:
            return b_ty if got else a_ty
        return got

    computation_type_impl.__wrapped__ = real_computation
    TritonSemantic.computation_type_impl = computation_type_impl
    binary_op_type_checking_impl.__wrapped__ = real_check
    broadcast_impl_value.__wrapped__ = real_broadcast
    TritonSemantic.binary_op_type_checking_impl = binary_op_type_checking_impl
    TritonSemantic.broadcast_impl_value = broadcast_impl_value


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
    # neither a list, a tuple nor a constexpr: the chain returns them as they are
    as_is = frozenset((int, float, bool, str, type(None), core.dtype, core.pointer_type, core.block_type))

    def unwrap(o):
        t = type(o)
        if t is constexpr:
            return o.value
        if t is tensor or t in as_is:
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
    new = object.__new__
    # ``tuple(values, type)`` with a tuple_type stores a copy of the values and the type, and
    # nothing else; made directly where that is all its constructor does
    probe = tl_tuple([1], core.tuple_type([core.constexpr_type(1)]))
    direct = tl_tuple.__new__ is new and sorted(vars(probe)) == ["type", "values"]

    def fresh_tuple(values, ty):
        if not direct:
            return tl_tuple(list(values), ty)
        t = new(tl_tuple)
        t.values = list(values)
        t.type = ty
        return t

    def block_init(self, element_ty, shape):
        key = _int_key(shape)
        got = blocks.get(key) if key is not None else None
        if got is None:
            real_block(self, element_ty, shape)
            if key is not None:
                blocks[key] = (self.shape, self.numel, str(self.shape))
            return
        self.element_ty = element_ty
        self.shape = fresh_tuple(got[0].values, got[0].type)
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
        self.shape = fresh_tuple(got[2], got[1])

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
