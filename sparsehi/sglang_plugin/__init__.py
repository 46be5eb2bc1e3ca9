"""sparsehi as an SGLang general plugin (entry point group ``sglang.srt.plugins``).

``register()`` is what SGLang's ``load_plugins()`` calls. Importing ``sparsehi`` (or this
package) never imports SGLang; only ``register()`` does.
"""
from __future__ import annotations

import logging

from sparsehi.sglang_plugin.options import ATTR, OPTIONS, add_arguments, config_from_namespace
from sparsehi.sglang_plugin.sglang_api import TESTED_SGLANG, check_sglang_version, installed_sglang_version

logger = logging.getLogger(__name__)


def register() -> list[str]:
    """Register the plugin's hooks with SGLang's ``HookRegistry``; returns the hooked
    targets. An SGLang other than the tested release gets none: one log line names both
    versions."""
    refusal = check_sglang_version(installed_sglang_version())
    if refusal is not None:
        logger.warning(refusal)
        return []
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sparsehi.sglang_plugin.hooks import register_hooks

    return register_hooks(HookRegistry, HookType)


__all__ = ["ATTR", "OPTIONS", "TESTED_SGLANG", "add_arguments", "config_from_namespace", "register"]
