"""tests/conftest.py's ``pytest_sessionstart``: under pytest-xdist the controller writes the
test modules' rewritten asserts into pytest's pyc cache; what it writes for a module is what
the import hook of a worker would have written (and reads back as such)."""

import pytest

import conftest


def test_cached_rewrite_is_the_hooks_own(tmp_path, pytestconfig):
    from _pytest.assertion import rewrite as rw

    if pytestconfig.getoption("assertmode") != "rewrite":
        pytest.skip("asserts are not rewritten in this run")
    src = tmp_path / "tests"
    src.mkdir()
    fn = src / "test_sample.py"
    fn.write_text("def test_it():\n    x = [1, 2]\n    assert x == [1, 3], 'differs'\n")
    (src / "helper.py").write_text("assert True\n")  # not a test module: left to the plain import
    conftest._rewrite_test_modules(pytestconfig, src)
    assert not list(src.glob("__pycache__/helper.*"))
    pyc = rw.get_cache_dir(fn) / (fn.name[:-3] + rw.PYC_TAIL)
    state = pytestconfig.stash[rw.assertstate_key]
    cached = rw._read_pyc(fn, pyc, state.trace)
    assert cached is not None
    _, own = rw._rewrite_test(fn, pytestconfig)
    assert cached == own  # code objects compare by their bytecode, constants and names
    namespace: dict = {}
    exec(cached, namespace)
    with pytest.raises(AssertionError, match=r"differs\nassert \[1, 2\] == \[1, 3\]"):
        namespace["test_it"]()
