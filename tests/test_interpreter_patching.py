"""tests/interpreter_patching.py: with it installed (conftest, under TRITON_INTERPRET=1) an
interpreted kernel that calls jit helpers of its own module and of triton.language.standard
computes what torch computes, the language is left unpatched after the launch, also after
a launch that raised, the dtype table answers as the interpreter's own function does, the
overflow checks are off only without debug (int32 arithmetic wraps as before), and the
shapes kept give the fields the original constructors give."""
import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's patching")


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _row_stats_kernel(x_ptr, out_ptr, scale, N: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    y = _scaled(x, scale)
    # tl.sum / tl.max / tl.cumsum are jit functions of triton.language.standard
    tl.store(out_ptr + row * 3, tl.sum(y, 0))
    tl.store(out_ptr + row * 3 + 1, tl.max(y, 0))
    tl.store(out_ptr + row * 3 + 2, tl.sum(tl.cumsum(y, 0), 0))


@triton.jit
def _raising_kernel(x_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.static_assert(N < 0, "refused on purpose")
    tl.store(x_ptr + tl.arange(0, N), x)


def test_is_installed_and_once():
    from triton.runtime import interpreter

    from interpreter_patching import install
    assert getattr(interpreter._patch_lang, "_once_per_launch", False)
    assert install() is False  # already in place: not wrapped twice


def test_kernel_with_helpers_computes_what_torch_does_and_leaves_the_language_unpatched():
    builtin_sum = tl.core.tensor.__add__
    x = torch.randn(3, 64)
    out = torch.empty(3, 3)
    _row_stats_kernel[(3,)](x, out, 0.5, N=64)
    y = x * 0.5
    want = torch.stack([y.sum(1), y.max(1).values, y.cumsum(1).sum(1)], 1)
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-3)
    assert tl.core.tensor.__add__ is builtin_sum  # the launch restored the language


def test_a_launch_that_raises_restores_the_language_and_the_next_one_runs():
    builtin_sum = tl.core.tensor.__add__
    with pytest.raises(Exception, match="refused on purpose"):
        _raising_kernel[(1,)](torch.zeros(8), N=8)
    assert tl.core.tensor.__add__ is builtin_sum
    x = torch.randn(2, 16)
    out = torch.empty(2, 3)
    _row_stats_kernel[(2,)](x, out, 2.0, N=16)
    assert torch.allclose(out[:, 0], (2 * x).sum(1), rtol=1e-5, atol=1e-5)


def test_dtype_table_answers_as_the_interpreter():
    from triton.runtime import interpreter
    table, real = interpreter._get_np_dtype, interpreter._get_np_dtype.__wrapped__
    types = [tl.int1, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
             tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float8e5, tl.float8e4nv, tl.pointer_type(tl.float32)]
    for ty in types + [tl.block_type(t, [4]) for t in types]:
        assert table(ty) == real(ty), ty


@triton.jit
def _int32_ops_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs * 3, a + b)
    tl.store(out_ptr + offs * 3 + 1, a - b)
    tl.store(out_ptr + offs * 3 + 2, a * b)


def test_overflow_checks_off_only_without_debug_and_int32_still_wraps():
    from triton.runtime import interpreter
    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow  # nothing would have asserted them
    big = 2**31 - 1
    a = torch.tensor([big, -big, 7, 46341], dtype=torch.int32)
    b = torch.tensor([1, 2, -9, 46341], dtype=torch.int32)
    out = torch.empty(4, 3, dtype=torch.int32)
    _int32_ops_kernel[(1,)](a, b, out, N=4)

    def wrap(x):
        return ((x + 2**31) % 2**32) - 2**31

    a64, b64 = a.long(), b.long()
    assert out.tolist() == torch.stack([wrap(a64 + b64), wrap(a64 - b64), wrap(a64 * b64)], 1).tolist()


@pytest.mark.parametrize("dims", [[16], [1, 64], [4, 8, 2], [2048]])
def test_shapes_worked_out_once_give_what_the_constructors_give(dims):
    block_init, tensor_init = tl.core.block_type.__init__, tl.core.tensor.__init__
    assert block_init.__wrapped__ and tensor_init.__wrapped__  # installed

    def built(init, cls, *args):
        obj = cls.__new__(cls)
        init(obj, *args)
        return obj

    def block_fields(b):
        return (b.element_ty, list(b.shape.values), str(b.shape.type), b.numel, b.name,
                b == tl.block_type(b.element_ty, dims))

    for shape in (list(dims), tl.core.tuple(list(dims))):
        for _ in range(2):  # the first builds with the original, the second from what it kept
            for ty in (tl.float32, tl.pointer_type(tl.int8)):
                fast = built(block_init, tl.block_type, ty, shape)
                real = built(block_init.__wrapped__, tl.block_type, ty, shape)
                assert block_fields(fast) == block_fields(real)
                for t_ty in (real, ty):
                    ft = built(tensor_init, tl.tensor, None, t_ty)
                    rt = built(tensor_init.__wrapped__, tl.tensor, None, t_ty)
                    assert [(x.value, str(x.type)) for x in ft.shape] == [(x.value, str(x.type)) for x in rt.shape]
                    assert str(ft.shape.type) == str(rt.shape.type) and ft.numel.value == rt.numel.value
                    assert (ft.type, ft.dtype) == (rt.type, rt.dtype)
                assert type(fast.shape) is type(real.shape) and vars(fast.shape).keys() == vars(real.shape).keys()
                assert fast.shape is not real.shape and built(tensor_init, tl.tensor, None, fast).shape is not \
                    built(tensor_init, tl.tensor, None, fast).shape  # fresh tuples: one object's never another's
    for bad in ([3], [2, 6]):
        for _ in range(2):
            with pytest.raises(ValueError, match="power of 2"):
                tl.block_type(tl.float32, bad)


def test_builtins_listed_once_are_the_ones_a_launch_finds_and_unwrap_answers_as_before():
    import inspect

    from triton.runtime import interpreter

    class Scope:  # records what a launch's patching would set
        def __init__(self):
            self.names = []

        def set_attr(self, obj, name, value):
            self.names.append(name)

    for pkg in (tl, tl.core, tl.tensor, tl.math):
        fast, real = Scope(), Scope()
        interpreter._patch_builtin(pkg, None, fast)
        for name, member in inspect.getmembers(pkg):
            if tl.core.is_builtin(member):
                real.set_attr(pkg, name, member)
        assert fast.names == real.names and fast.names
    unwrap = tl.core._unwrap_if_constexpr
    t = tl.tensor(None, tl.float32)
    values = (tl.constexpr(3), tl.constexpr(tl.constexpr(2.5)), t, [tl.constexpr(1), 2], (tl.constexpr(4),), 7, None,
              2.5, True, "x", tl.float32, tl.pointer_type(tl.int8), tl.block_type(tl.int32, [4]))
    for value in values:
        got, want = unwrap(value), unwrap.__wrapped__(value)
        assert repr(got) == repr(want) and type(got) is type(want)
        if not isinstance(value, (list, tuple)):
            assert got is want


# the operands of the semantic-layer tests: scalars and blocks of the dtypes kernels use
_DTYPES = [tl.int1, tl.int8, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16, tl.float32, tl.float64,
           tl.float8e4nv, tl.pointer_type(tl.float32)]
_SHAPES = [None, [16], [1, 16], [4, 16], [4, 1]]


def _operand(dtype, shape, seed=0):
    import numpy as np
    from triton.runtime import interpreter

    np_dtype = interpreter._get_np_dtype(dtype)
    data = (np.arange(int(np.prod(shape or [1]))) + seed + 1).astype(np_dtype).reshape(shape or [])
    return tl.tensor(interpreter.TensorHandle(data, dtype), tl.block_type(dtype, shape) if shape else dtype)


def _outcome(fn, *args, **kwargs):
    """What a semantic method gives: per result, whether it is the argument object itself,
    its type and its values; or the exception it raises."""
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared with the original's
        return ("raises", type(e).__name__, str(e))
    return [(any(o is a for a in args), str(o.type), o.handle.data.tolist()) for o in out]


def test_same_type_operands_come_out_of_the_binary_op_checks_and_broadcasts_as_the_original_gives_them():
    from triton.language.semantic import TritonSemantic
    from triton.runtime.interpreter import interpreter_semantic as sem

    check, broadcast = TritonSemantic.binary_op_type_checking_impl, TritonSemantic.broadcast_impl_value
    real_check, real_broadcast = check.__wrapped__, broadcast.__wrapped__
    flags = [dict(), dict(div_or_mod=True), dict(allow_lhs_ptr=True, allow_rhs_ptr=True),
             dict(arithmetic_check=False)]
    kept = 0
    for ld in _DTYPES:
        for rd in (ld, tl.int32, tl.float32):
            for ls in _SHAPES:
                for rs in (ls, None, [4, 16]):
                    lhs, rhs = _operand(ld, ls), _operand(rd, rs, seed=3)
                    for kw in flags:
                        got = _outcome(check, sem, lhs, rhs, **kw)
                        assert got == _outcome(real_check, sem, lhs, rhs, **kw), (ld, rd, ls, rs, kw)
                        kept += got[0] != "raises" and got[0][0] and got[1][0]
                    got = _outcome(broadcast, sem, lhs, rhs)
                    assert got == _outcome(real_broadcast, sem, lhs, rhs), (ld, rd, ls, rs)
    assert kept > 100  # the fast paths were taken
    # a Python number still goes through the original (and the result is the same)
    x = _operand(tl.int32, [16])
    assert _outcome(check, sem, x, 3) == _outcome(real_check, sem, x, 3)


def test_computation_types_kept_are_what_the_original_returns():
    from triton.language.semantic import TritonSemantic
    from triton.runtime.interpreter import interpreter_semantic as sem

    fast, real = TritonSemantic.computation_type_impl, TritonSemantic.computation_type_impl.__wrapped__
    numeric = _DTYPES[:-1] + [tl.uint8, tl.int16, tl.uint64, tl.float8e5]
    for _ in range(2):  # the first call asks the original, the second answers from what it kept
        for a in numeric:
            for b in numeric + [tl.core.dtype(a.name)]:  # an equal dtype that is another object
                for flags in [(False, False, False), (True, False, False), (False, True, True), (False, False, True)]:
                    got, want = (_type_outcome(f, sem, a, b, flags) for f in (fast, real))
                    assert got == want, (a, b, flags)


def _type_outcome(fn, sem, a, b, flags):
    try:
        ret = fn(sem, a, flags[0], b, flags[1], flags[2])
    except Exception as e:  # noqa: BLE001 - compared with the original's
        return ("raises", type(e).__name__, str(e))
    return ret.name, ret is a, ret is b


def test_patched_builtins_call_the_function_with_the_interpreters_semantic():
    import numpy as np
    from triton.runtime import interpreter

    class Scope:
        def __init__(self):
            self.set = {}

        def set_attr(self, obj, name, value):
            self.set[name] = value

    fast, real = Scope(), Scope()
    for name in ("__add__", "__mul__", "to", "__getitem__"):
        member = getattr(tl.core.tensor, name)
        interpreter._patch_attr(tl.core.tensor, name, member, None, fast)
        interpreter._patch_attr.__wrapped__(tl.core.tensor, name, member, None, real)
    x, y = _operand(tl.int32, [16]), _operand(tl.int32, [16], seed=5)
    for name, args, kwargs in [("__add__", (x, y), {}), ("__mul__", (x, 3), {}), ("to", (x, tl.float32), {}),
                               ("to", (x, tl.float16), {"_semantic": None}), ("__getitem__", (x, None), {})]:
        a, b = fast.set[name](*args, **dict(kwargs)), real.set[name](*args, **dict(kwargs))
        assert str(a.type) == str(b.type) and np.array_equal(a.handle.data, b.handle.data), name
    with pytest.raises(TypeError):
        fast.set["__add__"](x)
    with pytest.raises(TypeError):
        real.set["__add__"](x)
