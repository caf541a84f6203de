"""Every Python snippet in the README and the docs runs, as written, on the real engines.

Snippets run file by file, in order, in one namespace per file (a later snippet may use
what an earlier one defined). They run verbatim on the suite's shared engines (tests/lending.py):
``EmbeddedPair()``, ``Colocated()``, ``LaunchedPair(...)`` and a plain ``Session()`` borrow the
running pair, colocated engine or launched pair, where the arguments ask for nothing those lack;
an engine that asks for more starts for real, as a reader's would.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agentkv import EmbeddedPair
from agentkv.engines import Engine
from lending import lending
from scripted import close_leftover_event_loop

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPET = re.compile(r"^( *)```python\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


def _snippets(page: Path) -> list[str]:
    return [textwrap.dedent(code) for _, code in SNIPPET.findall(page.read_text())]


def test_the_docs_have_snippets() -> None:
    assert sum(len(_snippets(page)) for page in PAGES) >= 5


@pytest.mark.parametrize("page", [p for p in PAGES if _snippets(p)], ids=lambda p: p.name)
def test_every_snippet_compiles(page: Path) -> None:
    for index, code in enumerate(_snippets(page)):
        compile(code, f"{page.name}[{index}]", "exec")


_SHARED_BY_MARK = {"launched": "LaunchedPair(", "colocated": "olocated"}
"""The shared engines beside the pair, by what a page's code says when it uses them (each starts once, when first asked for)."""


def _with_its_engines(page: Path) -> Any:
    code = "".join(_snippets(page))
    return pytest.param(page, marks=pytest.mark.uses_shared(*(n for n, m in _SHARED_BY_MARK.items() if m in code)))


@pytest.mark.pair
@pytest.mark.parametrize("page", [_with_its_engines(p) for p in PAGES if _snippets(p)], ids=lambda p: p.name)
def test_every_snippet_runs(
    page: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pair: EmbeddedPair,
    request: pytest.FixtureRequest,
) -> None:
    monkeypatch.chdir(tmp_path)
    code = "".join(_snippets(page))
    engines: dict[str, Engine] = {"pair": pair}
    engines |= {name: request.getfixturevalue(name) for name, mark in _SHARED_BY_MARK.items() if mark in code}
    namespace: dict[str, object] = {"__name__": "__main__"}
    with lending(**engines):
        for index, code in enumerate(_snippets(page)):
            exec(compile(code, f"{page.name}[{index}]", "exec"), namespace)  # noqa: S102
            close_leftover_event_loop()  # a framework's run_sync leaves its loop for the next one (docs/integrations.md)
    assert all(engine.is_open and not engine.is_dead for engine in engines.values())  # no snippet closed them
