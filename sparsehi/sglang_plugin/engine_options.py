"""The ``--sparsehi-*`` options through SGLang's Python API, ``sgl.Engine(...)``.

``Engine(**kwargs)`` (``sglang/srt/entrypoints/engine.py``, SGLang 0.5.23) first calls
``load_plugins()``, then builds its record as ``self.server_args_class(**kwargs)``
(``ServerArgs`` unless a subclass of ``Engine`` names another class); ``ServerArgs`` is a
msgspec record, which refuses any keyword outside its fields (``TypeError: Unexpected
keyword argument 'sparsehi_algorithm'``), and msgspec reads ``__post_init__`` once, when the
class is made, so a hook on it neither sees nor takes extra keywords.

So the plugin wraps ``Engine.server_args_class``, SGLang's own override point for how
``Engine`` builds its record, in ``EngineServerArgs``: the ``sparsehi_*`` keywords are taken
out, SGLang's class is called with the others, and the ``SparseConfig`` they ask for is kept
on the record as ``sparsehi_config``, exactly as ``ServerArgs.from_cli_args`` does for the
command line (same checks, same page size default, errors naming the keyword). Without a
``sparsehi_*`` keyword the call is SGLang's, unchanged. ``Engine`` hands the record to its
scheduler processes by pickling it (``multiprocessing`` spawn); ``ServerArgs.__reduce__``
carries the record's ``__dict__``, where the attribute lives.

When the wrap is installed (never importing the engine module, which sets the process's
asyncio event-loop policy when imported, in processes that do not already hold it):

- ``register()`` (run by ``load_plugins()``) installs it at once when
  ``sglang.srt.entrypoints.engine`` is already imported. That is the case when
  ``load_plugins()`` first runs inside ``Engine.__init__`` (before that call builds its
  record), and when the engine module was imported before the loader ran;
- an AFTER hook on ``sglang.srt.plugins.load_plugins`` installs it at every later call of the
  loader, the first line of every ``Engine.__init__``: that covers a loader that ran before
  the engine module was imported.

Importing this module never imports SGLang.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import sys
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Optional

from sparsehi.config import SparseConfig
from sparsehi.sglang_plugin import options

logger = logging.getLogger(__name__)

ENGINE_MODULE = "sglang.srt.entrypoints.engine"
LOAD_PLUGINS = "sglang.srt.plugins.load_plugins"
CLASS_ATTR = "server_args_class"
"""``Engine``'s class attribute naming the record class its constructor calls."""

PREFIX = "sparsehi_"
CONFIG_KEYWORD = "sparsehi_config"
"""One keyword for the whole configuration: a dict of ``SparseConfig`` fields, or a ``SparseConfig``."""
KEYWORDS: dict[str, options.OptionSpec] = {o.dest: o for o in options.OPTIONS}
"""``sparsehi_<option>`` keywords: the argparse dests of the ``--sparsehi-*`` flags."""
ALLOWED = (*KEYWORDS, CONFIG_KEYWORD)

_SPARSE_FIELDS = tuple(f.name for f in dataclasses.fields(SparseConfig))
_FLAG = re.compile(r"(?<![\w-])--([A-Za-z0-9][\w-]*)")


def split_kwargs(kwargs: Mapping[str, Any], record_fields: Any = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(sglang_kwargs, sparsehi_kwargs)``: the keywords starting with ``sparsehi_`` that are
    not fields of the record class are ours. ValueError for one we do not know, naming the
    allowed ones."""
    fields = set(record_fields)
    ours = {k: v for k, v in kwargs.items() if k.startswith(PREFIX) and k not in fields}
    unknown = sorted(k for k in ours if k not in ALLOWED)
    if unknown:
        raise ValueError(f"unknown sparsehi keyword(s) {', '.join(unknown)}: allowed are {', '.join(ALLOWED)} "
                         f"(one per --sparsehi-* flag, or sparsehi_config= with a dict of SparseConfig fields "
                         f"or a SparseConfig)")
    return {k: v for k, v in kwargs.items() if k not in ours}, ours


def _rename(msg: str, names: Mapping[str, str]) -> str:
    """A CLI error message with flags turned into the Python API's names: ours as given in
    ``names`` (``--sparsehi-top-k`` -> ``sparsehi_top_k``), SGLang's as their ``ServerArgs``
    field (``--enable-mixed-chunk`` -> ``enable_mixed_chunk``)."""
    for field in _SPARSE_FIELDS:  # a SparseConfig field checked outside config_from_namespace
        msg = msg.replace(f"SparseConfig.{field}=", f"{names.get(field, field)}=")
    return _FLAG.sub(lambda m: names.get(m.group(0), m.group(1).replace("-", "_")), msg)


def _config_argument(value: Any) -> dict[str, Any]:
    """The fields ``sparsehi_config=`` sets. A ``SparseConfig`` sets all of them (its page
    size included); a dict only the ones it names."""
    if isinstance(value, SparseConfig):
        return {f: getattr(value, f) for f in _SPARSE_FIELDS}
    if not isinstance(value, Mapping):
        raise ValueError(f"{CONFIG_KEYWORD}={value!r} is invalid: a dict of SparseConfig fields or a SparseConfig")
    unknown = sorted(repr(k) for k in value if k not in _SPARSE_FIELDS)
    if unknown:
        raise ValueError(f"{CONFIG_KEYWORD} has unknown field(s) {', '.join(unknown)}: SparseConfig's fields are "
                         f"{', '.join(_SPARSE_FIELDS)}")
    return dict(value)


def config_from_kwargs(sparsehi_kwargs: Mapping[str, Any], server_args: Any) -> Optional[SparseConfig]:
    """The ``SparseConfig`` the ``sparsehi_*`` keywords ask for (None: sparsehi off), checked
    as the command line is (``options.config_from_namespace``, then
    ``options.check_sglang_features`` against ``server_args``, SGLang's record built from the
    other keywords, which may set its ``cuda_graph_backend_decode`` as the command line does).
    ValueError naming the keyword. A value of None is unset, as a flag not given."""
    given = {k: v for k, v in sparsehi_kwargs.items() if v is not None}
    config = given.pop(CONFIG_KEYWORD, None)
    if config is not None and given:
        raise ValueError(f"{CONFIG_KEYWORD}= and {', '.join(sorted(given))} given together: pass either "
                         f"{CONFIG_KEYWORD} or the sparsehi_<option> keywords")
    if config is None:
        names = {o.flag: o.dest for o in options.OPTIONS}
        values = {o.field: given.get(o.dest) for o in options.OPTIONS}
        extra: dict[str, Any] = {}
    else:
        fields = {k: v for k, v in _config_argument(config).items() if v is not None}
        names = {o.flag: f"{CONFIG_KEYWORD}[{o.field!r}]" for o in options.OPTIONS}
        names.update({f: f"{CONFIG_KEYWORD}[{f!r}]" for f in _SPARSE_FIELDS})
        values = {o.field: fields.pop(o.field, None) for o in options.OPTIONS}
        extra = fields  # SparseConfig fields without a flag (dense_layers, io_backend, sparse_extra_config)
    ns = SimpleNamespace(**{o.dest: values[o.field] for o in options.OPTIONS})
    try:
        cfg = options.config_from_namespace(ns, sglang_page_size=getattr(server_args, "page_size", None))
        if cfg is None:
            if extra:
                raise ValueError(f"{', '.join(names[f] for f in extra)} given without "
                                 f"{names['--sparsehi-algorithm']}, which turns sparsehi on")
            return None
        if extra:
            cfg = dataclasses.replace(cfg, **extra)
        options.check_sglang_features(server_args, cfg)
    except ValueError as e:
        raise ValueError(_rename(str(e), names)) from None
    return cfg


def build_server_args(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` (SGLang's ``ServerArgs``) with the ``sparsehi_*`` keywords
    taken out first and their ``SparseConfig`` kept on the record as ``sparsehi_config``.
    Without a ``sparsehi_*`` keyword (or with only None values) it is ``cls(*args, **kwargs)``.

    Also usable directly: ``Engine(server_args=build_server_args(ServerArgs, model_path=...,
    sparsehi_algorithm="quest"))``."""
    kwargs, ours = split_kwargs(kwargs, getattr(cls, "__struct_fields__", ()))
    if all(v is None for v in ours.values()):
        return cls(*args, **kwargs)
    server_args = cls(*args, **kwargs)
    cfg = config_from_kwargs(ours, server_args)
    setattr(server_args, options.ATTR, cfg)
    if cfg is not None:
        logger.info("sparsehi on: %s", cfg)
    return server_args


class EngineServerArgs:
    """``Engine.server_args_class`` once the plugin is installed: calling it is
    ``build_server_args(<the class it wraps>, ...)``; any other use reads the wrapped class
    (``__wrapped__``), and ``isinstance`` / ``issubclass`` test against it."""

    def __init__(self, cls: Any) -> None:
        self.__wrapped__ = cls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return build_server_args(self.__wrapped__, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.__wrapped__)

    def __subclasscheck__(self, cls: Any) -> bool:
        return issubclass(cls, self.__wrapped__)

    def __repr__(self) -> str:
        return f"<sparsehi EngineServerArgs over {self.__wrapped__!r}>"


def install(engine_cls: Any) -> bool:
    """Wrap ``server_args_class`` where ``engine_cls``'s MRO defines it; True when this call
    wrapped it (False: already wrapped, or nothing to wrap)."""
    owner = next((k for k in getattr(engine_cls, "__mro__", ()) if CLASS_ATTR in vars(k)), None)
    if owner is None:
        return False
    current = vars(owner)[CLASS_ATTR]
    if isinstance(current, EngineServerArgs) or not callable(current):
        return False
    setattr(owner, CLASS_ATTR, EngineServerArgs(current))
    logger.debug("sparsehi: %s.%s accepts the sparsehi_* keywords", owner.__qualname__, CLASS_ATTR)
    return True


def install_if_loaded() -> bool:
    """``install`` on SGLang's ``Engine`` if its module is imported (never imports it)."""
    engine = getattr(sys.modules.get(ENGINE_MODULE), "Engine", None)
    return engine is not None and install(engine)


def after_load_plugins(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``sglang.srt.plugins.load_plugins()``, which ``Engine.__init__`` calls before it
    builds its record: install the wrap if the engine module is loaded by now."""
    install_if_loaded()
    return None


def register(registry: Any, hook_type: Any) -> list[str]:
    """Register the loader hook on ``registry`` and install at once where possible (see the
    module's docstring); returns the hooked target."""
    registry.register(LOAD_PLUGINS, after_load_plugins, hook_type.AFTER)
    install_if_loaded()
    return [LOAD_PLUGINS]
