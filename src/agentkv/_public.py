"""How a public module presents the names it re-exports: under its own name, not the private module's.

`help()`, tracebacks, reprs and the API reference then say ``agentkv.Session`` or
``agentkv.engines.StepRequest``, the names users import, instead of ``agentkv._session._session``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["present_as"]


def present_as(module_name: str, namespace: dict[str, Any], names: list[str]) -> None:
    """Set ``__module__`` to ``module_name`` on each class and function in ``names`` defined in a private module."""
    for name in names:
        obj = namespace[name]
        if getattr(obj, "__module__", "").startswith("agentkv._"):
            try:
                obj.__module__ = module_name
            except (AttributeError, TypeError):  # constants and aliases: nothing to present
                pass
