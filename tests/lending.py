"""Code written for users (the docs' snippets, the notebook) runs verbatim on the suite's shared engines.

A snippet says ``EmbeddedPair()``, ``Colocated()``, ``LaunchedPair(max_model_len=2048)`` or a
plain ``Session()``, and a reader's run starts those engines. The suite has one of each running
already (``tests/conftest.py``); starting another per page cost a minute each. Inside `lending`:

* ``agentkv.EmbeddedPair(...)``, ``agentkv.Colocated(...)`` and ``agentkv.LaunchedPair(...)``
  return the shared engine of that class when the arguments ask for nothing it lacks (see
  `_compatible`); otherwise the real class, which starts a real engine of its own when opened;
* ``agentkv.Session(...)`` and ``agentkv.SessionPool(...)`` without ``engine=`` run on the shared
  pair (the shared colocated engine for ``mode="colocated"``), under the same rule;
* a lent engine's lifecycle calls (``with``, ``async with``, ``start()``, ``close()``) do nothing:
  the suite opened it and closes it at its end. Everything else reaches the real engine.

The names are replaced on the ``agentkv`` module, so ``from agentkv import ...`` inside the
block gets the lending ones; outside it nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import agentkv
from agentkv import Colocated, EmbeddedPair, LaunchedPair, Session, SessionPool
from agentkv.engines import Engine

__all__ = ["Lender", "lending"]

_SIZES = ("max_model_len",)
"""Arguments a shared engine satisfies when it is at least as large."""
_NEUTRAL = ("warmup",)
"""Arguments that change nothing a snippet can observe."""


class _Lent:
    """Mixed into a shared engine's class while it is lent: lifecycle calls are its owner's, not the borrower's."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def start(self) -> Self:
        return self

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


@dataclass
class Lender:
    """The shared engines by class, and a record of what was lent and what had to start for real."""

    engines: dict[type[Engine], Engine]
    lent: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def shared(self, cls: type[Engine], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Engine | None:
        engine = self.engines.get(cls)
        if engine is None or args or not _compatible(engine, kwargs):
            self.refused.append(f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
            return None
        self.lent.append(cls.__name__)
        return engine


def _compatible(engine: Engine, kwargs: dict[str, Any]) -> bool:
    """Whether ``engine`` serves what an engine built with ``kwargs`` would: no argument it does not honour."""
    for name, value in kwargs.items():
        if name in _NEUTRAL or (name == "model" and value is None):
            continue
        if name in _SIZES and value <= engine.info.max_model_len:
            continue
        return False
    return True


@contextlib.contextmanager
def lending(**engines: Engine) -> Iterator[Lender]:
    """Lend ``engines`` (``pair=``, ``colocated=``, ``launched=``; any may be absent) to code run inside."""
    by_class: dict[type[Engine], Engine] = {}
    for engine in engines.values():
        for cls in (EmbeddedPair, Colocated, LaunchedPair):
            if isinstance(engine, cls):
                by_class[cls] = engine
    lender = Lender(by_class)

    def lending_class(cls: type[Engine]) -> type:
        def __new__(subclass: type, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            shared = lender.shared(cls, args, kwargs)
            return shared if shared is not None else cls(*args, **kwargs)

        return type(cls.__name__, (cls,), {"__new__": __new__, "__module__": "agentkv"})

    def engine_user(cls: type) -> type:
        def __init__(self: Any, *args: Any, engine: Engine | None = None, **kwargs: Any) -> None:  # noqa: N807
            if engine is None:
                options = dict(kwargs.pop("engine_options", None) or {})
                model = kwargs.get("model")
                wanted = Colocated if kwargs.get("mode") == "colocated" else EmbeddedPair
                engine = lender.shared(wanted, (), {**options, "model": model})
                if engine is not None:
                    kwargs.pop("model", None)
                elif options:
                    kwargs["engine_options"] = options
            cls.__init__(self, *args, engine=engine, **kwargs)

        return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": "agentkv"})

    swapped = [(engine, type(engine)) for engine in by_class.values()]
    replaced = {
        "EmbeddedPair": lending_class(EmbeddedPair),
        "Colocated": lending_class(Colocated),
        "LaunchedPair": lending_class(LaunchedPair),
        "Session": engine_user(Session),
        "SessionPool": engine_user(SessionPool),
    }
    originals = {name: getattr(agentkv, name) for name in replaced}
    try:
        for engine, cls in swapped:
            engine.__class__ = type(f"Lent{cls.__name__}", (_Lent, cls), {})
        for name, value in replaced.items():
            setattr(agentkv, name, value)
        yield lender
    finally:
        for name, value in originals.items():
            setattr(agentkv, name, value)
        for engine, cls in swapped:
            engine.__class__ = cls
