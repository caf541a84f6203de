"""What the router and the shared store cost per step: docs/scale-out.md's figures come from this script.

One launched pair (agentkv's two servers) serves two doors, both ``agentkv serve --remote P D``: one on a SQLite
file (the single-door default), one on PostgreSQL (tests/postgres_server.py) with ``vllm-router`` in front of it
(tests/scale_out.py). The same conversations (same prompts, greedy) run three ways, turn by turn interleaved so that
the machine's drift hits every way alike: straight to the SQLite door, straight to the PostgreSQL door, and through
the router to the PostgreSQL door. Per way: the client's TTFT (request sent to first content chunk) and the
engine's (the step's ``ttft_s``), mean and median over turns 2+ (turn 1 has no pin anywhere). Not a test (it
asserts nothing); run it alone, under the engines lock:

    flock /tmp/agentkv-engines.lock .venv/bin/python tests/measure_scale_out.py [--conversations 6] [--turns 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import openai

from agentkv import LaunchedPair
from agentkv._model import model_name
from postgres_server import postgres_server
from scale_out import ScaleOut, streamed_turn

WAYS = ("sqlite door", "postgresql door", "router + postgresql door")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    agentkv = str(Path(sys.executable).with_name("agentkv"))
    with (
        tempfile.TemporaryDirectory() as tmp,
        postgres_server() as server,
        LaunchedPair(max_model_len=2048, dtype="float32") as pair,
        ScaleOut(Path(tmp)) as fleet,
    ):
        p_url, d_url = pair.urls
        model = model_name(pair.info.model_path)

        def door(port: int, store: str) -> list[str]:
            return [agentkv, "serve", "--port", str(port), "--store", store, "--remote", p_url, d_url]

        sqlite_door = fleet.start_doors(1, str(Path(tmp) / "door.db"), door)[0]
        pg_door = fleet.start_doors(1, server.url, door)[0]
        router = fleet.start_router([pg_door.url])
        urls = dict(zip(WAYS, (sqlite_door.url, pg_door.url, router.url), strict=True))
        clients = {way: openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) for way, url in urls.items()}
        history = {
            (way, n): [{"role": "system", "content": "Be brief."}] for way in WAYS for n in range(args.conversations)
        }
        client_ttft: dict[str, list[float]] = {way: [] for way in WAYS}
        engine_ttft: dict[str, list[float]] = {way: [] for way in WAYS}
        turn_s: dict[str, list[float]] = {way: [] for way in WAYS}
        for turn in range(1, args.turns + 1):
            for n in range(args.conversations):
                question = {"role": "user", "content": f"Turn {turn}: name a colour and a number above {7 * turn}."}
                order = WAYS if (turn + n) % 2 else tuple(reversed(WAYS))
                answers = set()
                for way in order:
                    messages = [*history[way, n], question]
                    asked = streamed_turn(clients[way], model, messages, f"{way[:6]}-{n}", temperature=0, max_tokens=16)
                    text, client_s, engine_s, whole_s = (
                        asked.text,
                        asked.ttft_s,
                        float(asked.stats["ttft_s"]),
                        asked.turn_s,
                    )
                    history[way, n] = [*messages, {"role": "assistant", "content": text}]
                    answers.add(text)
                    if turn > 1:
                        client_ttft[way].append(client_s)
                        engine_ttft[way].append(engine_s)
                        turn_s[way].append(whole_s)
                assert len(answers) == 1, answers  # greedy, same prompts: the same answer every way
    base, base_turn = statistics.mean(client_ttft[WAYS[0]]), statistics.mean(turn_s[WAYS[0]])
    print(f"{args.conversations} conversations x {args.turns} turns, turns 2+ ({len(client_ttft[WAYS[0]])} per way)")
    for way in WAYS:
        mean, median = statistics.mean(client_ttft[way]), statistics.median(client_ttft[way])
        engine = statistics.mean(engine_ttft[way])
        extra, whole = mean - base, statistics.mean(turn_s[way])
        print(
            f"{way:26s} client TTFT mean {mean * 1000:7.1f} ms, median {median * 1000:7.1f} ms;"
            f" engine TTFT mean {engine * 1000:7.1f} ms; vs sqlite door {extra * 1000:+6.1f} ms ({extra / base:+.1%});"
            f" whole turn {whole * 1000:7.1f} ms ({(whole - base_turn) * 1000:+6.1f} ms)"
        )


if __name__ == "__main__":
    main()
