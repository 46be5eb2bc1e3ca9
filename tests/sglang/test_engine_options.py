"""The ``--sparsehi-*`` options through SGLang's Python API, ``sgl.Engine(...)``
(``sparsehi/sglang_plugin/engine_options.py``), with SGLang 0.5.23's real classes.

In this process: the record ``Engine`` builds (``Engine.server_args_class(**kwargs)``, which
the plugin wraps in ``EngineServerArgs``) against the one the command line builds, the
checks, and the record's trip to a spawned process, as ``Engine`` hands it to its
schedulers. SGLang's engine module cannot be imported here (the test environment lacks
its HTTP stack: uvloop, uvicorn, fastapi, setproctitle), so the tests of SGLang's real
``Engine.__init__`` run in fresh interpreters with stand-ins for just those modules, with
``Engine._launch_subprocesses`` replaced by a function that takes the record and stops:
no process is launched. Runs in the SGLang test environment (.venv-sglang).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import msgspec  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.sglang_plugin import ATTR, OPTIONS  # noqa: E402
from sparsehi.sglang_plugin import engine_options as eo  # noqa: E402

QUEST_SGLANG = "sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm:QuestAlgorithm"
FLAG = {o.field: o.flag for o in OPTIONS}
KEYWORD = {o.field: o.dest for o in OPTIONS}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def loaded():
    load_plugins()  # idempotent in SGLang; applies HookRegistry's hooks (our add_cli_args / from_cli_args)
    return True


def _cli(sparse: dict, sglang_argv: list[str] = ()):
    """The record ``sglang serve`` builds from the equivalent flags."""
    argv = ["--model-path", "dummy", *sglang_argv]
    for field, value in sparse.items():
        if value is None:
            continue
        argv += [FLAG[field], ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def _engine(**kwargs):
    """The record ``Engine(**kwargs)`` builds: ``self.server_args_class(**kwargs)`` (with the
    ``log_level`` Engine adds) once the plugin has wrapped ``server_args_class``."""
    return eo.EngineServerArgs(ServerArgs)(model_path="dummy", log_level="error", **kwargs)


# (SparseConfig fields given, SGLang keywords, the same SGLang settings as flags)
CASES = [
    ({"algorithm": "quest"}, {}, []),
    ({"algorithm": "quest", "top_k": 256, "device_buffer_size": 512, "min_sparse_prompt_len": 100,
      "backend": "triton"}, {"page_size": 16}, ["--page-size", "16"]),
    ({"algorithm": "oracle", "backend": "flashattention", "top_k": 128, "device_buffer_size": 1024, "page_size": 32,
      "sink_tokens": 0, "recent_tokens": 96, "min_sparse_prompt_len": 0, "host_to_device_ratio": 3.5},
     {"page_size": 16}, ["--page-size", "16"]),
    ({"algorithm": QUEST_SGLANG, "page_size": 16, "top_k": 256}, {}, []),
]


@pytest.mark.parametrize("sparse, sglang_kw, sglang_argv", CASES)
def test_keywords_give_the_command_line_config(sparse, sglang_kw, sglang_argv):
    cli = _cli(sparse, sglang_argv)
    want = getattr(cli, ATTR)
    assert isinstance(want, SparseConfig)
    by_keyword = _engine(**sglang_kw, **{KEYWORD[f]: v for f, v in sparse.items()})
    by_dict = _engine(**sglang_kw, sparsehi_config=dict(sparse))
    for sa in (by_keyword, by_dict):
        assert type(sa) is ServerArgs
        assert getattr(sa, ATTR) == want
        # the SGLang settings the check may change (an algorithm that must run eagerly turns decode graphs off)
        assert (sa.page_size, sa.cuda_graph_backend_decode) == (cli.page_size, cli.cuda_graph_backend_decode)
    if sparse["algorithm"] == QUEST_SGLANG:
        assert by_keyword.cuda_graph_backend_decode == "disabled"
    if "page_size" not in sparse:
        assert want.page_size == SparseConfig.page_size  # the plugin's own, whatever SGLang's page size


def test_a_sparse_config_object_is_taken_whole():
    cfg = SparseConfig(algorithm="quest", top_k=256, device_buffer_size=512, page_size=32, sink_tokens=32,
                       recent_tokens=32, dense_layers=(0, 1), sparse_extra_config={"sparsity_ratio": 0.5})
    sa = _engine(page_size=16, sparsehi_config=cfg)
    assert getattr(sa, ATTR) == cfg  # its page size too: a SparseConfig sets every field
    flags = {f: getattr(cfg, f) for f in FLAG}
    assert getattr(_cli(flags, ["--page-size", "16"]), ATTR) == SparseConfig(**{**flags, "sparse_extra_config": {}})


def test_config_dict_takes_fields_without_a_flag():
    sa = _engine(sparsehi_config={"algorithm": "quest", "dense_layers": [0, 1], "io_backend": "direct",
                                  "sparse_extra_config": {"sparsity_ratio": 0.25}})
    cfg = getattr(sa, ATTR)
    assert (cfg.dense_layers, cfg.io_backend, cfg.sparse_extra_config) == ((0, 1), "direct", {"sparsity_ratio": 0.25})
    assert cfg.page_size == 64 and cfg.top_k == 2048  # the rest as on the command line


@pytest.mark.parametrize("kwargs, message", [
    ({"sparsehi_algorithm": "quest", "sparsehi_top_k": 0}, r"^sparsehi_top_k=0 is invalid"),
    ({"sparsehi_algorithm": "quest", "sparsehi_top_k": 4096, "sparsehi_device_buffer_size": 2048},
     r"^sparsehi_device_buffer_size=2048 is invalid: an integer >= top_k"),
    ({"sparsehi_algorithm": "quest", "sparsehi_backend": "flashinfer"}, r"^sparsehi_backend='flashinfer'"),
    ({"sparsehi_algorithm": "quest", "sparsehi_page_size": 48}, r"^sparsehi_page_size=48"),
    ({"sparsehi_algorithm": "quest", "sparsehi_top_k": "256"}, r"^sparsehi_top_k='256' is invalid"),
    ({"sparsehi_algorithm": "quest", "sparsehi_top_k": True}, r"^sparsehi_top_k=True is invalid"),
    ({"sparsehi_algorithm": "quest", "sparsehi_host_to_device_ratio": 1}, r"^sparsehi_host_to_device_ratio=1"),
    ({"sparsehi_algorithm": "nope"}, r"^sparsehi_algorithm='nope' is unknown"),
    ({"sparsehi_top_k": 256}, r"^sparsehi_top_k given without sparsehi_algorithm"),
    ({"sparsehi_config": {"algorithm": "quest", "top_k": 0}}, r"^sparsehi_config\['top_k'\]=0 is invalid"),
    ({"sparsehi_config": {"top_k": 256}}, r"^sparsehi_config\['top_k'\] given without sparsehi_config\['algorithm'\]"),
    ({"sparsehi_config": {"dense_layers": [0]}}, r"^sparsehi_config\['dense_layers'\] given without"),
    ({"sparsehi_config": {"algorithm": "quest", "dense_layers": [-1]}}, r"^sparsehi_config\['dense_layers'\]=\[-1\]"),
    ({"sparsehi_config": {"algorithm": "quest", "topk": 256}}, r"sparsehi_config has unknown field\(s\) 'topk'.*top_k"),
    ({"sparsehi_config": "quest"}, r"^sparsehi_config='quest' is invalid: a dict of SparseConfig fields"),
    ({"sparsehi_config": {"algorithm": "quest"}, "sparsehi_top_k": 256}, r"sparsehi_top_k given together"),
    # SGLang settings the plugin cannot follow, named as Engine's keywords
    ({"sparsehi_algorithm": "quest", "enable_mixed_chunk": True},
     r"^enable_mixed_chunk cannot be used with sparsehi_algorithm"),
    ({"sparsehi_algorithm": "quest", "speculative_algorithm": "EAGLE"}, r"^speculative_algorithm='EAGLE'"),
    ({"sparsehi_algorithm": "quest", "enable_two_batch_overlap": True}, r"^enable_two_batch_overlap cannot"),
    ({"sparsehi_algorithm": "quest", "attn_dp_size": 2}, r"^attn_dp_size=2 \(DP attention\).*allowed: attn_dp_size 1"),
    ({"sparsehi_config": {"algorithm": "quest"}, "enable_mixed_chunk": True},
     r"^enable_mixed_chunk cannot be used with sparsehi_config\['algorithm'\]"),
    ({"sparsehi_algorithm": QUEST_SGLANG, "cuda_graph_backend_decode": "full"},
     r"^cuda_graph_backend_decode='full' cannot be used with this algorithm: sparsehi_algorithm"),
])
def test_bad_values_raise_naming_the_keyword(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        _engine(**kwargs)
    assert "--" not in str(e.value), "a flag left in the message"


@pytest.mark.parametrize("kwargs", [{"sparsehi_topk": 256}, {"sparsehi_algorithm": "quest", "sparsehi_foo": None}])
def test_unknown_sparsehi_keyword_names_the_allowed_ones(kwargs):
    with pytest.raises(ValueError) as e:
        _engine(**kwargs)
    msg = str(e.value)
    assert msg.startswith("unknown sparsehi keyword(s) " + next(k for k in kwargs if k not in eo.ALLOWED))
    for name in [*KEYWORD.values(), "sparsehi_config"]:
        assert name in msg


@pytest.mark.parametrize("extra", [{}, {"sparsehi_top_k": None, "sparsehi_config": None}])
def test_without_sparsehi_keywords_the_record_is_sglangs(extra):
    kw = dict(model_path="dummy", page_size=16, enable_hierarchical_cache=True, hicache_ratio=3.0)
    plain = ServerArgs(**kw)
    ours = eo.EngineServerArgs(ServerArgs)(**kw, **extra)
    assert type(ours) is ServerArgs and ours == plain
    assert msgspec.structs.asdict(ours) == msgspec.structs.asdict(plain)
    assert vars(ours) == vars(plain) == {}  # no sparsehi_config attribute either
    assert getattr(ours, ATTR, "absent") == "absent"


def test_sglang_keywords_are_still_checked_by_sglang():
    with pytest.raises(TypeError, match="Unexpected keyword argument 'not_a_field'"):
        _engine(not_a_field=1, sparsehi_algorithm="quest")


def test_the_wrapped_class_reads_as_sglangs():
    shim = eo.EngineServerArgs(ServerArgs)
    assert shim.__wrapped__ is ServerArgs and shim.add_cli_args is ServerArgs.add_cli_args
    assert shim.from_cli_args.__func__ is ServerArgs.from_cli_args.__func__
    assert isinstance(ServerArgs(model_path="dummy"), shim) and issubclass(ServerArgs, shim)
    assert not isinstance(object(), shim)


def test_install_wraps_where_the_class_attribute_lives():
    class Engine:  # SGLang's shape: a class attribute naming the record class
        server_args_class = ServerArgs

    class RayLike(Engine):
        pass

    class Fork(Engine):
        server_args_class = ServerArgs  # a subclass naming its own class keeps it

    assert eo.install(RayLike) and isinstance(vars(Engine)["server_args_class"], eo.EngineServerArgs)
    assert not eo.install(Engine)  # once
    assert isinstance(RayLike.server_args_class, eo.EngineServerArgs)
    assert Fork.server_args_class is ServerArgs
    assert not eo.install(object)
    sa = RayLike.server_args_class(model_path="dummy", sparsehi_algorithm="quest")
    assert getattr(sa, ATTR).algorithm == "quest"


def test_register_hooks_the_loader_and_never_imports_the_engine():
    seen = []
    registry = type("Registry", (), {"register": staticmethod(lambda t, h, k: seen.append((t, h, k)))})
    hook_type = type("HookType", (), {"AFTER": "after", "AROUND": "around", "BEFORE": "before"})
    from sparsehi.sglang_plugin import hooks

    engine_was_imported = eo.ENGINE_MODULE in sys.modules  # it cannot be in this environment
    targets = hooks.register_hooks(registry, hook_type)
    assert eo.LOAD_PLUGINS in targets and (eo.LOAD_PLUGINS, eo.after_load_plugins, "after") in seen
    assert (eo.ENGINE_MODULE in sys.modules) == engine_was_imported
    import sglang.srt.plugins as plugins

    assert getattr(plugins.load_plugins, "__wrapped__", None) is not None  # applied by load_plugins()


def _sparse_record():
    sa = _engine(page_size=16, sparsehi_algorithm="quest", sparsehi_top_k=256, sparsehi_device_buffer_size=512)
    assert getattr(sa, ATTR).top_k == 256
    return sa


def test_the_config_survives_pickling_before_and_after_resolution():
    sa = _sparse_record()
    cfg = getattr(sa, ATTR)
    for dumps, loads in ((pickle.dumps, pickle.loads), (ForkingPickler.dumps, pickle.loads)):
        back = loads(dumps(sa))
        assert type(back) is ServerArgs and getattr(back, ATTR) == cfg and back == sa
    sa.resolve_once()  # what Engine._launch_subprocesses does before it starts the schedulers
    back = pickle.loads(ForkingPickler.dumps(sa))
    assert getattr(back, ATTR) == cfg and back._resolution_finished
    with pytest.raises(AttributeError, match="after resolution"):  # why it is set when the record is built
        setattr(sa, ATTR, None)


def test_the_config_reaches_a_spawned_process():
    """Engine starts its schedulers with ``mp.Process(target, args=(server_args, ...))`` in
    the spawn start method: the record is pickled into a fresh interpreter. Here the child
    gets the record as a ``Process`` argument and sends it back."""
    sa = _sparse_record()
    sa.resolve_once()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=queue.put, args=(sa,))
    proc.start()
    try:
        back = queue.get(timeout=300)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert type(back) is ServerArgs and getattr(back, ATTR) == getattr(sa, ATTR)


# -- SGLang's real Engine.__init__, in fresh interpreters --------------------------------

CHILD = textwrap.dedent('''
    import asyncio, importlib.util, json, sys, types, warnings
    warnings.filterwarnings("ignore")
    mode, calls = sys.argv[1], json.loads(sys.argv[2])

    class _Stand:  # any name of a module the test environment lacks
        def __init__(self, *a, **k): pass
        def __getattr__(self, name):
            if name.startswith("__"): raise AttributeError(name)
            return _Stand()
        def __call__(self, *a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else _Stand()

    class _StandModule(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"): raise AttributeError(name)
            return type(name, (_Stand,), {})

    stood_in = []
    for name in ("uvloop", "uvicorn", "fastapi", "fastapi.responses", "setproctitle"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            m = _StandModule(name); m.__path__ = []
            if name == "uvloop":
                m.EventLoopPolicy = asyncio.DefaultEventLoopPolicy
            sys.modules[name] = m; stood_in.append(name)

    from sglang.srt import plugins
    if mode == "loader-first":
        plugins.load_plugins()
        assert "sglang.srt.entrypoints.engine" not in sys.modules
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs
    import msgspec, pickle, sparsehi
    from multiprocessing.reduction import ForkingPickler
    loaded_before = plugins._plugins_loaded

    class Stop(Exception): pass
    seen = {}
    def launch(cls, server_args, **kw):  # Engine's next step: resolve, publish, spawn the schedulers
        seen["server_args"] = server_args
        raise Stop
    Engine._launch_subprocesses = classmethod(launch)
    Engine.shutdown = lambda self: None  # atexit: nothing was launched

    results = []
    for kwargs in calls:
        out = {}
        try:
            if "server_args" in kwargs:  # a record built by the plugin's helper, Engine(server_args=...)
                from sparsehi.sglang_plugin.engine_options import build_server_args
                kwargs = kwargs["server_args"]
                Engine(server_args=build_server_args(ServerArgs, **kwargs))
            else:
                kwargs = {"log_level": "error", **kwargs}  # as Engine adds it
                Engine(**kwargs)
        except Stop:
            sa = seen.pop("server_args")
            plain = ServerArgs(**{k: v for k, v in kwargs.items() if not k.startswith("sparsehi_")})
            out.update(type=type(sa).__name__, config=repr(getattr(sa, "sparsehi_config", "absent")),
                       same_fields=msgspec.structs.asdict(sa) == msgspec.structs.asdict(plain),
                       extra_attrs=sorted(set(vars(sa)) - {"_launch_command"}),
                       launch_command=sa.launch_command)
            sa.resolve_once()
            back = pickle.loads(ForkingPickler.dumps(sa))
            out["pickled_config"] = repr(getattr(back, "sparsehi_config", "absent"))
        except Exception as e:
            out.update(error=type(e).__name__, message=str(e))
        results.append(out)
    print("RESULT " + json.dumps({"stood_in": stood_in, "sparsehi": sparsehi.__file__,
                                  "loaded_before": loaded_before,
                                  "server_args_class": repr(vars(Engine)["server_args_class"]),
                                  "results": results}))
''')

KW = {"model_path": "dummy", "page_size": 16, "sparsehi_algorithm": "quest", "sparsehi_top_k": 256,
      "sparsehi_device_buffer_size": 512}
RUNS = {
    # the common script: `sgl.Engine(...)` is the first to run SGLang's plugin loader
    "engine-first": ("engine-first", "sparsehi", [
        KW,
        {"model_path": "dummy", "page_size": 16,
         "sparsehi_config": {"algorithm": "quest", "top_k": 256, "device_buffer_size": 512}},
        {"model_path": "dummy", "page_size": 16},
        {"model_path": "dummy", "sparsehi_algorithm": "quest", "sparsehi_top_k": 0},
        {"server_args": KW},
    ]),
    # load_plugins() ran before the engine module was imported
    "loader-first": ("loader-first", "sparsehi", [KW]),
    # SGLang without the plugin: the keyword is refused by the msgspec record
    "no-plugin": ("engine-first", "none-such-plugin", [KW]),
}


@pytest.fixture(scope="module")
def engine_runs():
    """The three interpreters, one after the other (15 to 20 s each on 2 cores)."""
    out = {}
    for name, (mode, plugins, calls) in RUNS.items():
        env = {**os.environ, "SGLANG_PLUGINS": plugins,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(calls)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, \
            f"{name}: rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        out[name] = json.loads(lines[-1][len("RESULT "):])
    return out


def _want():
    return repr(getattr(_cli({"algorithm": "quest", "top_k": 256, "device_buffer_size": 512}, ["--page-size", "16"]),
                        ATTR))


@pytest.mark.parametrize("run", ["engine-first", "loader-first"])
def test_real_engine_init_takes_the_keywords(engine_runs, run):
    res = engine_runs[run]
    assert res["sparsehi"] == str(REPO / "sparsehi" / "__init__.py")
    assert res["loaded_before"] == (run == "loader-first")
    assert res["server_args_class"].startswith("<sparsehi EngineServerArgs over <class 'sglang.srt.server_args.Serv")
    first = res["results"][0]
    assert first["type"] == "ServerArgs" and first["same_fields"], first
    assert first["config"] == first["pickled_config"] == _want()
    assert first["extra_attrs"] == [ATTR]
    assert "sparsehi_algorithm='quest'" in first["launch_command"]  # Engine records the call as given


def test_real_engine_init_other_calls(engine_runs):
    by_dict, plain, bad, given_record = engine_runs["engine-first"]["results"][1:]
    for res in (by_dict, given_record):
        assert res["type"] == "ServerArgs" and res["same_fields"] and res["extra_attrs"] == [ATTR]
        assert res["config"] == res["pickled_config"] == _want()
    assert plain["type"] == "ServerArgs" and plain["same_fields"] and plain["extra_attrs"] == []
    assert plain["config"] == plain["pickled_config"] == "'absent'"
    assert bad["error"] == "ValueError" and bad["message"].startswith("sparsehi_top_k=0 is invalid")


def test_real_engine_init_refuses_the_keyword_without_the_plugin(engine_runs):
    (res,) = engine_runs["no-plugin"]["results"]
    assert (res["error"], res["message"]) == ("TypeError", "Unexpected keyword argument 'sparsehi_algorithm'")
    assert engine_runs["no-plugin"]["server_args_class"] == "<class 'sglang.srt.server_args.ServerArgs'>"
