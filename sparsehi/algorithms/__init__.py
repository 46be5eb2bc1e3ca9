"""Top-k sparse attention algorithms: the author API, the registry and the built-ins.

Write your own: subclass :class:`BaseSparseAlgorithm` (see ``docs/algorithms.md``), then
either ``@register_algorithm("name")`` it or point ``SparseConfig.algorithm`` at
``"your.module:YourClass"``. Check it with :func:`sparsehi.algorithms.testing.check_algorithm`.
Built-ins (``oracle``, ``quest``, ``dsa``) load lazily on first lookup.
"""
from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode, check_pool_args, check_selection
from sparsehi.algorithms.registry import (
    create_algorithm,
    register_algorithm,
    registered_algorithms,
    resolve_algorithm,
)

__all__ = [
    "BaseSparseAlgorithm",
    "SparseMode",
    "check_pool_args",
    "check_selection",
    "create_algorithm",
    "register_algorithm",
    "registered_algorithms",
    "resolve_algorithm",
]
