"""Algorithm registry: ``@register_algorithm("name")`` and ``create_algorithm(config,
device)`` resolving ``config.algorithm`` as a registered name or as an import path
``"package.module:ClassName"`` (a third-party algorithm needs no registration at all).

An import path resolves against ``sys.path`` and then the working directory: the
``sparsehi`` console script starts with its own ``bin`` directory on ``sys.path``, not the
directory the user runs in (``python -m`` and ``python -c`` do put that one first), and a
``module:Class`` names a module as the user sees it from there.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from types import ModuleType
from typing import Any, Callable, TypeVar

import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

_REGISTRY: dict[str, type[BaseSparseAlgorithm]] = {}
_BUILTIN_MODULES = ("sparsehi.algorithms.oracle", "sparsehi.algorithms.quest", "sparsehi.algorithms.dsa")

T = TypeVar("T", bound=type)


def register_algorithm(name: str) -> Callable[[T], T]:
    """Class decorator registering a ``BaseSparseAlgorithm`` subclass under ``name``.

    Registering a different class under a taken name is a ValueError (re-registering the
    same class, e.g. on module reload, is allowed).
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"algorithm name={name!r} is invalid: a non-empty string without ':'")

    def deco(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, BaseSparseAlgorithm)):
            raise ValueError(f"@register_algorithm({name!r}) needs a BaseSparseAlgorithm subclass, got {cls!r}")
        old = _REGISTRY.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"algorithm name {name!r} is already registered to {old.__module__}.{old.__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtins() -> None:
    for mod in _BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:  # a built-in still being written must not hide the others
            if e.name != mod:
                raise


def registered_algorithms() -> list[str]:
    """Names of all registered algorithms, built-ins included, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def _on_sys_path(directory: str) -> bool:
    real = os.path.realpath(directory)
    return any(os.path.realpath(entry or os.curdir) == real for entry in sys.path if isinstance(entry, str))


def _import_user_module(mod_name: str) -> ModuleType:
    """Import ``mod_name`` from ``sys.path``, else from the working directory.

    The working directory is appended (searched last), so it never shadows an installed
    package, and only when the top-level package itself was not found; it stays on
    ``sys.path`` once it served the import (the module may import its siblings later).
    """
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != mod_name.partition(".")[0] or _on_sys_path(cwd):
            raise
    sys.path.append(cwd)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(mod_name)
    except ImportError as e:
        sys.path.remove(cwd)  # it did not serve the import: leave sys.path as it was
        raise ImportError(f"{e}; searched sys.path and the working directory {cwd}", name=e.name) from e


def resolve_algorithm(name: str) -> type[BaseSparseAlgorithm]:
    """The class for a registered name or a ``"package.module:ClassName"`` path."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"algorithm={name!r} is invalid: a registered name or 'package.module:ClassName'")
    if ":" in name:
        mod_name, _, cls_name = name.partition(":")
        if _DOTTED.fullmatch(mod_name) is None or not cls_name.isidentifier():
            raise ValueError(f"algorithm={name!r} is invalid: an import path is 'package.module:ClassName' (dotted "
                             "Python identifiers, one ':')")
        try:
            mod = _import_user_module(mod_name)
        except ImportError as e:
            raise ValueError(f"algorithm={name!r}: cannot import module {mod_name!r} ({e})") from e
        except Exception as e:  # the module's own code failed (SyntaxError, a raise at import time)
            raise ValueError(f"algorithm={name!r}: importing module {mod_name!r} raised {e!r}") from e
        cls = getattr(mod, cls_name, None)
        if cls is None:
            raise ValueError(f"algorithm={name!r}: module {mod_name!r} has no attribute {cls_name!r}")
        if not (isinstance(cls, type) and issubclass(cls, BaseSparseAlgorithm)):
            raise ValueError(f"algorithm={name!r} must name a BaseSparseAlgorithm subclass, got {cls!r}")
        return cls
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"algorithm={name!r} is unknown: registered algorithms are {sorted(_REGISTRY)} "
                         f"(or give an import path 'package.module:ClassName')")
    return _REGISTRY[name]


def create_algorithm(config: Any, device: torch.device | str, **kw: Any) -> BaseSparseAlgorithm:
    """Instantiate ``config.algorithm`` for ``config`` on ``device`` (``kw`` passed to the
    constructor)."""
    cls = resolve_algorithm(config.algorithm)
    return cls(config, torch.device(device), **kw)
