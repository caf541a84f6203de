"""A small real task with tools on the bundled model: look something up in a workspace.

The model calls `read_file` (the first step is made to call it; `path` can only name a real
file, since the argument schema is an enum), reads the result, and answers. Each step
prints its TTFT and where its prompt's KV came from: from step 2 on, the KV of the step
before is pulled back from D.

Run: .venv/bin/python examples/tools_agent.py
"""

from typing import Literal

from agentkv import Session, TurnResult, tool
from agentkv.engines import Engine

WORKSPACE = {
    "notes.txt": "Release 2.4 ships on Friday. The release owner is Dana. Freeze starts Wednesday.",
    "todo.txt": "1. Fix test_login (401). 2. Update the changelog. 3. Tag the release.",
}


@tool
def list_files() -> list[str]:
    """List the files in the workspace."""
    return sorted(WORKSPACE)


@tool
def read_file(path: Literal["notes.txt", "todo.txt"]) -> str:
    """Return the text of a file in the workspace.

    Args:
        path: the file's name.
    """
    return WORKSPACE[path]


def main(engine: Engine | None = None) -> TurnResult:
    """Run the task; with ``engine=`` on an open engine (the tests pass theirs), else on a new pair."""
    with Session(
        engine=engine,
        system="You are a release assistant. Answer from the files, in one short sentence.",
        tools=[list_files, read_file],
        tool_choice="read_file",
        max_steps=4,
        max_tokens=128,
    ) as session:
        result = session.run_sync("Who is the release owner, according to notes.txt?")
    for step in result.steps:
        stats = step.stats
        called = ", ".join(f"{c.name}({c.arguments})" for c in step.tool_calls) or "-"
        print(
            f"step {stats.step}: calls {called}; ttft {stats.ttft_s:.3f} s; prompt {stats.prompt_tokens} = "
            f"local {stats.local_hit_tokens} + pulled {stats.pulled_tokens} + computed {stats.computed_tokens}; "
            f"tools {stats.tool_s * 1000:.1f} ms"
        )
        for tool_result in step.tool_results:
            print(f"        -> {tool_result.content}")
    print(f"answer: {result.text} ({result.stop_reason})")
    return result


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()
