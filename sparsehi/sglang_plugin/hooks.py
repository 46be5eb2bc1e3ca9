"""Hooks the plugin installs in SGLang through its ``HookRegistry`` (imports SGLang lazily).

Targets are dotted paths that ``HookRegistry.apply_hooks`` resolves, so registering
imports nothing of SGLang beyond the registry itself.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

from sparsehi.sglang_plugin import options

logger = logging.getLogger(__name__)

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


def after_add_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ServerArgs.add_cli_args(parser)``: add the ``--sparsehi-*`` options."""
    options.add_arguments(parser)
    return None


def around_from_cli_args(original: Callable[..., Any], cls: type, ns: argparse.Namespace, *args: Any,
                         **kwargs: Any) -> Any:
    """AROUND ``ServerArgs.from_cli_args``: build SGLang's record, then check our options
    and keep the resulting ``SparseConfig`` (or None) on it as ``sparsehi_config``.

    The selection page size defaults to SGLang's ``--page-size``.
    """
    server_args = original(cls, ns, *args, **kwargs)
    cfg = options.config_from_namespace(ns, sglang_page_size=getattr(ns, "page_size", None))
    setattr(server_args, options.ATTR, cfg)
    if cfg is not None:
        logger.info("sparsehi on: %s", cfg)
    return server_args


def register_hooks(registry: Any, hook_type: Any) -> list[str]:
    """Register every hook on ``registry`` (SGLang's ``HookRegistry``); returns the targets."""
    targets = []
    for target, hook, kind in (
        (f"{SERVER_ARGS}.add_cli_args", after_add_cli_args, hook_type.AFTER),
        (f"{SERVER_ARGS}.from_cli_args", around_from_cli_args, hook_type.AROUND),
    ):
        registry.register(target, hook, kind)
        targets.append(target)
    return targets
