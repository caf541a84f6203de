"""TTFT per turn of one agent conversation under three modes, measured in one run.

The workload follows DESIGN.md's raw-vLLM measurement: a coding-agent system prompt, then six
turns that each add a tool output of ~620 tokens and get a 48-token answer. Turn by turn,
the same conversation runs

* bidirectional: push-back on (D's KV pulled back by P);
* disaggregated: the same pair, no push-back (P's own prefix cache only);
* disaggregated, P cache off: a second pair whose P has no prefix cache (the source's baseline).

The first two share a pair and alternate turn by turn, so machine noise hits both alike; the
third needs its own pair and runs after. This is not the benchmark (`agentkv bench`, to come):
it is the one-run comparison the foundation promised.

Run: .venv/bin/python examples/compare_modes.py [--turns 6]
"""

import argparse
import json
import statistics
from typing import Any

from agentkv import EmbeddedPair, Session

SYSTEM = "You are a coding agent. Tools: read_file(path), run_tests(). " + " ".join(
    f"Rule {i}: keep function f{i} pure and documented." for i in range(60)
)


def tool_output(turn: int) -> str:
    lines = "\n".join(f"line {turn}-{i}: assert f{i}(x) == {i * turn}  # output of run_tests" for i in range(25))
    return "Tool result:\n" + lines


def converse(sessions: dict[str, Session], turns: int) -> dict[str, list[dict[str, float]]]:
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in sessions}
    for turn in range(turns):
        message = "Fix the failing test in module m." if turn == 0 else tool_output(turn)
        for name, session in sessions.items():  # alternate modes within each turn
            stats = session.run_sync(message).steps[0].stats
            rows[name].append(
                {
                    "turn": turn + 1,
                    "ttft_s": stats.ttft_s,
                    "prompt": stats.prompt_tokens,
                    "local": stats.local_hit_tokens,
                    "pulled": stats.pulled_tokens,
                    "computed": stats.computed_tokens,
                }
            )
            print(
                f"turn {turn + 1} {name:>28}: ttft {stats.ttft_s:6.3f} s  prompt {stats.prompt_tokens:5d} = "
                f"local {stats.local_hit_tokens} + pulled {stats.pulled_tokens} + computed {stats.computed_tokens}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()

    # Each mode's conversation differs from its first token: sessions on one pair must not hit
    # P's prefix cache for tokens another session computed (identical conversations would).
    def options(tag: str) -> dict[str, Any]:
        return {"max_tokens": 48, "system": f"[{tag}] {SYSTEM}"}

    rows: dict[str, list[dict[str, float]]] = {}
    with EmbeddedPair(max_model_len=8192) as pair:
        with (
            Session(engine=pair, **options("a")) as pushed,
            Session(engine=pair, mode="disaggregated", **options("b")) as plain,
        ):
            rows.update(converse({"bidirectional": pushed, "disaggregated (P cache on)": plain}, args.turns))
    with EmbeddedPair(max_model_len=8192, bidirectional=False, prefill_prefix_cache=False) as baseline:
        with Session(engine=baseline, **options("c")) as session:
            rows.update(converse({"disaggregated (P cache off)": session}, args.turns))
    reference = statistics.fmean(r["ttft_s"] for r in rows["bidirectional"][1:])
    print("\nmean TTFT of turns 2+:")
    for name, series in rows.items():
        mean = statistics.fmean(r["ttft_s"] for r in series[1:])
        print(f"  {name:>28}: {mean:6.3f} s  ({mean / reference:.2f}x bidirectional)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main()
