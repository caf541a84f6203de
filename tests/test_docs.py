"""Every Python snippet in the README and the docs runs, as written, on the real engines.

Snippets run file by file, in order, in one namespace per file (a later snippet may use
what an earlier one defined). Each starts the engines it names, as a reader's would.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from scripted import close_leftover_event_loop

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET = re.compile(r"^( *)```python\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


def _snippets(page: Path) -> list[str]:
    return [textwrap.dedent(code) for _, code in SNIPPET.findall(page.read_text())]


def test_the_docs_have_snippets() -> None:
    assert sum(len(_snippets(page)) for page in PAGES) >= 5


@pytest.mark.parametrize("page", [p for p in PAGES if _snippets(p)], ids=lambda p: p.name)
def test_every_snippet_compiles(page: Path) -> None:
    for index, code in enumerate(_snippets(page)):
        compile(code, f"{page.name}[{index}]", "exec")


@pytest.mark.pair
@pytest.mark.parametrize("page", [p for p in PAGES if _snippets(p)], ids=lambda p: p.name)
def test_every_snippet_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for index, code in enumerate(_snippets(page)):
        exec(compile(code, f"{page.name}[{index}]", "exec"), namespace)  # noqa: S102
        close_leftover_event_loop()  # a framework's run_sync leaves its loop for the next one (docs/integrations.md)
