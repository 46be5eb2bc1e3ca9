"""The servers a run of bench_sglang_server starts: their common flags, the plugin's flags,
environment and command line, in order."""
from __future__ import annotations

import argparse
import os
import shlex
from typing import Any, Iterable, Optional

PLUGIN_NAME = "sparsehi"
NO_PLUGIN = "__none__"  # an SGLANG_PLUGINS whitelist no plugin is named by: SGLang loads none
DEFAULT_PLUGIN_ARGS = "--sparsehi-algorithm quest --sparsehi-top-k 2048 --sparsehi-device-buffer-size 4096"
DEFAULT_CHECK_PLUGIN_ARGS = "--sparsehi-algorithm quest --sparsehi-top-k 4096 --sparsehi-device-buffer-size 4096"
DEFAULT_CONTEXTS = "32768,65536"
EAGER_FLAGS = ("--disable-decode-cuda-graph",)
DEFAULTS_FLAGS = ("--page-size", "--mem-fraction-static")  # defaults_start: a plugin server without these
CONTEXT_MARGIN = 4096  # --context-length = largest context + this
FLAG_STRING_OPTIONS = ("--plugin-args", "--check-plugin-args", "--server-args")


def common_flags(model_dir: str, context_length: int, page_size: Optional[int] = None,
                 mem_fraction: Optional[float] = None, extra: Iterable[str] = ()) -> list[str]:
    """The flags every server of a run gets (plugin on or off): the one place they are set.
    --page-size / --mem-fraction-static only when given (else SGLang's defaults)."""
    flags = ["--model-path", model_dir, "--load-format", "dummy", "--skip-tokenizer-init",
             "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
             "--context-length", str(context_length), "--disable-prefill-cuda-graph",
             "--random-seed", "0", "--log-level", "info"]
    if page_size is not None:
        flags += ["--page-size", str(page_size)]
    if mem_fraction is not None:
        flags += ["--mem-fraction-static", str(mem_fraction)]
    return flags + list(extra)


def has_defaults_flags(flags: Iterable[str]) -> bool:
    """Whether ``flags`` set --page-size or --mem-fraction-static (either spelling)."""
    return any(f == d or f.startswith(d + "=") for f in flags for d in DEFAULTS_FLAGS)


def strip_defaults_flags(flags: list[str]) -> list[str]:
    """``flags`` without --page-size / --mem-fraction-static and their values."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f in DEFAULTS_FLAGS:
            skip = True
            continue
        if any(f.startswith(d + "=") for d in DEFAULTS_FLAGS):
            continue
        out.append(f)
    return out


def server_cmd(python: str, flags: list[str], port: Any, host: str = "127.0.0.1") -> list[str]:
    return [python, "-m", "sglang.launch_server", *flags, "--host", host, "--port", str(port)]


def server_env(plugin: bool, baseline_plugin_loaded: bool = False, base: Optional[dict] = None) -> dict[str, str]:
    """The server's environment: SGLANG_PLUGINS names our plugin (plugin on) or nothing
    (SGLang without any plugin); PYTHONUNBUFFERED for a live log."""
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    if plugin or baseline_plugin_loaded:
        env["SGLANG_PLUGINS"] = PLUGIN_NAME
    else:
        env["SGLANG_PLUGINS"] = NO_PLUGIN
    return env


def plan_servers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The servers this run starts, in order, each ``{tag, plugin, flags, env_plugins, tasks}``;
    tasks: ``warmup``, ``reference`` (check prompts on SGLang), ``measure`` (all contexts),
    ``check`` (check prompts on the plugin), ``defaults`` (one request). ``plugin_defaults``
    (the plugin's flags without --page-size / --mem-fraction-static) only when those are given:
    otherwise the measured plugin server tells defaults_start."""
    common = common_flags(args.model_dir, args.context_length, args.page_size, args.mem_fraction_static,
                          shlex.split(args.server_args))
    plugin_flags = shlex.split(args.plugin_args)
    check_flags = shlex.split(args.check_plugin_args)
    want = {"sglang", "plugin"} if args.only is None else {args.only}
    check = not args.skip_check
    servers: list[dict[str, Any]] = []

    def add(tag, plugin, flags, tasks):
        servers.append({"tag": tag, "plugin": plugin, "flags": flags, "tasks": tasks,
                        "env_plugins": PLUGIN_NAME if (plugin or args.baseline_plugin_loaded) else NO_PLUGIN,
                        # defaults_start: the measured plugin flags, SGLang's page size / memory fraction
                        "defaults_probe": tag in ("plugin", "plugin_defaults") and not has_defaults_flags(flags)})

    if "sglang" in want:
        tasks = ["warmup"] + (["reference"] if check else []) + ([] if args.skip_measure else ["measure"])
        add("sglang", False, common, tasks)
    if "plugin" in want:
        if not args.skip_measure:
            add("plugin", True, common + plugin_flags, ["warmup", "measure"])
        if check:
            add("check_graphed", True, common + check_flags, ["warmup", "check"])
            if not args.skip_eager_check:
                add("check_eager", True, common + check_flags + list(EAGER_FLAGS), ["warmup", "check"])
        if not args.skip_defaults and has_defaults_flags(common):
            add("plugin_defaults", True, strip_defaults_flags(common + plugin_flags), ["warmup", "defaults"])
    return servers
