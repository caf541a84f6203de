"""A three-turn conversation on the embedded pair, with the stats of every turn.

Run: .venv/bin/python examples/quickstart.py
"""

from agentkv import Session


def main() -> None:
    with Session(system="You are a terse geography tutor.", max_tokens=24) as session:
        for question in ("What is the capital of France?", "And of Italy?", "And of Spain?"):
            result = session.run_sync(question)
            print(f"> {question}\n{result.text.strip()}")
            print(f"  {result.steps[-1].stats.summary()}")  # TTFT and where each prompt token's KV came from
        print(session.stats.table())


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()
