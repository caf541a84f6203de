"""Several conversations at once on one pair (a copilot backend), from async code.

Run: .venv/bin/python examples/many_sessions.py
"""

import anyio

from agentkv import EmbeddedPair, Session, TurnResult

QUESTIONS = ("Name a prime number.", "Name a larger one.", "Add the two.")


async def converse(pair: EmbeddedPair, name: str, results: dict[str, list[TurnResult]]) -> None:
    async with Session(engine=pair, system=f"You are assistant {name}. Be brief.", max_tokens=16) as session:
        results[name] = [await session.run(question) for question in QUESTIONS]


async def main() -> None:
    results: dict[str, list[TurnResult]] = {}
    async with EmbeddedPair(max_model_len=2048) as pair:
        async with anyio.create_task_group() as group:
            for name in ("a", "b", "c"):
                group.start_soon(converse, pair, name, results)
    for name, turns in sorted(results.items()):
        ttfts = ", ".join(f"{turn.stats.ttft_s:.2f}" for turn in turns)
        pulled = ", ".join(str(turn.stats.pulled_tokens) for turn in turns)
        print(f"session {name}: TTFT per turn {ttfts} s; pulled back per turn {pulled}")


if __name__ == "__main__":
    anyio.run(main)
