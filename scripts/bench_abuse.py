"""A hostile tenant against ``agentkv serve`` while another tenant's conversation streams beside it (issue #52,
points 6-11; docs/serve.md, "Serving many users").

    flock /tmp/agentkv-engines.lock .venv/bin/python scripts/bench_abuse.py [--samples 3] [--bad 1000]

Starts ``agentkv serve`` on the embedded pair (the bundled model) with two tenants, then:

1. **idle**: after 20 unmeasured conversations (until the pool is full, a turn 1's TTFT settles: the first ones
   took half as long), the victim (tenant ``bob``) runs two-turn conversations, streamed; each turn's TTFT is the
   time from sending the request to its first chunk (the door sends it at the model's first token);
2. **memory**: the door process's resident memory before and after ``--bad`` bad requests (every kind in turn);
3. **each abuse input** of points 6-11, sent by the attacker (tenant ``alice``, in a process of its own) for as long
   as the victim runs its conversations: first paced (one request per ``--interval-s``, 100 ms: a hostile client),
   then back to back (a flood of as many as one connection gets answered). Per input: the attacker's answers (every
   one must be its 4xx, in OpenAI's error shape) with their median and p99 times, and the victim's median TTFT
   beside it against an idle round measured just before (the shared machine's load drifts).

Exits 1 when an answer was not its 4xx, the victim's median TTFT beside a paced attacker passed 1.5x its idle
round, or the memory grew by more than 10% (the flood's ratios are printed, not judged: on 2 cores the flooding
client and the door's answers to it take CPU from the engines themselves). Timings are this machine's (a shared
2-core CPU box: noisy), never asserted by a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ALICE_KEY, BOB_KEY = "sk-bench-alice-0f1e2d3c4b5a", "sk-bench-bob-a5b4c3d2e1f0"
ALICE, BOB = {"authorization": f"Bearer {ALICE_KEY}"}, {"authorization": f"Bearer {BOB_KEY}"}
TTFT_RATIO = 1.5
MEMORY_GROWTH = 0.10


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "smol", **fields}).encode()


def _chat(content: str = "Hi", **fields: Any) -> bytes:
    return _body(messages=[{"role": "user", "content": content}], max_tokens=4, **fields)


_BIG_ENUM = {"type": "string", "enum": [f"value-{i:07d}" for i in range(100_000)]}


@dataclass
class Abuse:
    """One abuse input: what the attacker sends and the status it must get."""

    point: int
    name: str
    status: int
    path: str = "/v1/chat/completions"
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    raw: bytes | None = None
    """A request sent as these bytes on a socket of its own (headers httpx will not send)."""


ABUSES = [
    Abuse(6, "metadata of 3.9 MB", 400, "/v1/responses", _body(input="Hi", metadata={"k": "v" * 3_900_000})),
    Abuse(
        6, "metadata of 17 pairs", 400, "/v1/responses", _body(input="Hi", metadata={f"k{i}": "v" for i in range(17)})
    ),
    Abuse(6, "user of 3.9 MB", 400, "/v1/responses", _body(input="Hi", user="u" * 3_900_000)),
    Abuse(7, "prompt of 3.9 MB", 400, body=_chat("word " * 780_000)),
    Abuse(
        8,
        "tool parameters: 2 MB enum",
        400,
        body=_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _BIG_ENUM}}]),
    ),
    Abuse(
        8,
        "response_format: 2 MB enum",
        400,
        body=_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _BIG_ENUM}}),
    ),
    Abuse(8, "structured_outputs: 2 MB enum", 400, body=_chat(structured_outputs={"json": _BIG_ENUM})),
    Abuse(10, "request_id of 100 KB", 400, body=_chat(request_id="r" * 100_000)),
    Abuse(10, "session_id of 3.9 MB", 400, body=_chat(session_id="s" * 3_900_000)),
    Abuse(11, "JSON nested 100,000 deep", 400, body=b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    Abuse(11, "NUL in session_id", 400, body=_chat(session_id="a\x00b")),
    Abuse(11, "CR LF in session_id", 400, body=_chat(session_id="a\r\nb")),
    Abuse(11, "non-Latin-1 x-session-id", 400, raw=b"x-session-id: caf\xc3\xa9\r\n"),
    Abuse(11, "unknown path", 404, "/v1/nowhere"),
    Abuse(11, "wrong method", 405, "/v1/chat/completions", method="GET"),
]


class Door:
    """``agentkv serve`` in a process of its own, on the embedded pair, with the two tenants' keys."""

    def __init__(self, folder: Path, port: int, max_model_len: int) -> None:
        keys = folder / "keys"
        keys.write_text(f"alice {ALICE_KEY}\nbob {BOB_KEY}\n")
        self.url = f"http://127.0.0.1:{port}"
        command = [
            sys.executable, "-m", "agentkv", "serve", "--port", str(port), "--api-keys-file", str(keys),
            "--store", str(folder / "serve.sqlite3"), "--max-model-len", str(max_model_len), "--max-tokens", "8",
            "--tenant-max-in-flight", "2", "--max-sessions", "16", "--write-timeout-s", "5",
        ]  # fmt: skip
        self.log = (folder / "serve.log").open("wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 900
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"agentkv serve exited: {(folder / 'serve.log').read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("agentkv serve did not get ready in 900 s")
            time.sleep(0.5)

    def rss_mb(self) -> float:
        return float(psutil.Process(self.process.pid).memory_info().rss) / 2**20

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def victim_ttfts(url: str, samples: int, tag: str) -> tuple[list[float], list[float]]:
    """``samples`` two-turn conversations of the victim, streamed: the TTFTs (seconds to the first chunk) of their
    first turns (the prompt computed) and of their second (its KV pulled back from D), apart: two modes whose
    medians mixed would swing between them."""
    found: tuple[list[float], list[float]] = ([], [])
    with httpx.Client(timeout=600) as client:
        for n in range(samples):
            name = f"{tag}-{n}-{time.monotonic_ns()}"
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": f"Conversation {name}: name three fruits, briefly."}
            ]
            for turn in (0, 1):
                body = {"model": "smol", "messages": messages, "stream": True, "max_tokens": 8}
                started = time.perf_counter()
                first: float | None = None
                text = ""
                with client.stream(
                    "POST", url + "/v1/chat/completions", json=body, headers=BOB | {"x-session-id": name}
                ) as answer:
                    if answer.status_code != 200:
                        raise SystemExit(f"the victim got {answer.status_code}: {answer.read()[:300]!r}")
                    for line in answer.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if first is None:
                            first = time.perf_counter() - started
                        for choice in json.loads(line[6:]).get("choices", []):
                            text += choice["delta"].get("content") or ""
                assert first is not None
                found[turn].append(first)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "One more?"}]
    return found


def send(url: str, abuse: Abuse, client: httpx.Client) -> tuple[int, float, bool]:
    """One abuse request: its status, its time, whether its body is OpenAI's error object."""
    started = time.perf_counter()
    if abuse.raw is not None:
        host, port = url.removeprefix("http://").split(":")
        body = _chat()
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: " + ALICE["authorization"].encode()
            + b"\r\n" + abuse.raw + b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body
        )  # fmt: skip
        with socket.create_connection((host, int(port)), timeout=60) as raw:
            raw.sendall(head)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                part = raw.recv(65536)
                if not part:
                    break
                answer += part
        took = time.perf_counter() - started
        status = int(answer.split(b" ", 2)[1])
        return status, took, b'"error"' in answer and b'"code"' in answer
    response = client.request(
        abuse.method, url + abuse.path, content=abuse.body or None, headers=ALICE | {"content-type": "application/json"}
    )
    took = time.perf_counter() - started
    try:
        shaped = set(response.json()["error"]) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        shaped = False
    return response.status_code, took, shaped


def attack(url: str, index: int, interval_s: float, stop: Any, answers: Any) -> None:
    """The attacker, in a process of its own (its work shares no interpreter lock with the victim's timing): sends
    ``ABUSES[index]``, one request after the other, at most one per ``interval_s`` (0: back to back), until
    ``stop`` is set; puts its answers on ``answers``, then None."""
    found: list[tuple[int, float, bool]] = []
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            started = time.perf_counter()
            found.append(send(url, ABUSES[index], client))
            time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))
    answers.put(found)


def beside(
    url: str, index: int, interval_s: float, run: Callable[[], tuple[list[float], list[float]]]
) -> tuple[tuple[list[float], list[float]], list[tuple[int, float, bool]]]:
    """``run()`` (the victim) while the attacker sends ``ABUSES[index]`` (`attack`); the victim's result, the
    attacker's answers."""
    spawn = multiprocessing.get_context("spawn")
    stop, answers = spawn.Event(), spawn.Queue()
    attacker = spawn.Process(target=attack, args=(url, index, interval_s, stop, answers))
    attacker.start()
    try:
        time.sleep(1.0)  # the attacker under way (its interpreter started) before the victim begins
        result = run()
    finally:
        stop.set()
        answered: list[tuple[int, float, bool]] = answers.get(timeout=600)
        attacker.join(600)
    return result, answered


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3, help="victim conversations per measurement (2 turns each)")
    parser.add_argument("--bad", type=int, default=1000, help="bad requests of the memory measurement")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--only", default="", help="the abuse inputs whose name holds this (default: every one)")
    parser.add_argument(
        "--interval-s", type=float, default=0.1, help="the paced attacker's time between requests (then: a flood)"
    )
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-abuse-") as folder:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        door = Door(Path(folder), port, args.max_model_len)
        try:
            victim_ttfts(door.url, 20, "warm")  # imports, the engines' first steps, a pool full of sessions: not timed
            idle = victim_ttfts(door.url, args.samples, "idle")
            rss_before = door.rss_mb()
            say(
                f"idle: victim TTFT median {median_ms(idle[0]):.0f} ms (turn 1), {median_ms(idle[1]):.0f} ms (turn 2, "
                f"pulled back), n={args.samples} each; door RSS {rss_before:.0f} MiB"
            )
            with httpx.Client(timeout=600) as client:
                for sent in range(args.bad):
                    abuse = ABUSES[sent % len(ABUSES)]
                    status, _, _ = send(door.url, abuse, client)
                    failed |= status != abuse.status
            rss_after = door.rss_mb()
            growth = (rss_after - rss_before) / rss_before
            failed |= growth > MEMORY_GROWTH
            say(
                f"memory: door RSS {rss_before:.0f} MiB before, {rss_after:.0f} MiB after {args.bad} bad requests "
                f"(every kind in turn): {growth * 100:+.1f}% ({'ok' if growth <= MEMORY_GROWTH else 'FAIL'}, bound "
                f"{MEMORY_GROWTH * 100:.0f}%)"
            )
            for interval_s, pace in ((args.interval_s, f"one per {args.interval_s * 1000:.0f} ms"), (0.0, "flood")):
                for index, abuse in enumerate(ABUSES):
                    if args.only not in abuse.name:
                        continue
                    baseline = victim_ttfts(door.url, args.samples, "idle")  # idle again: the machine drifts
                    ttfts, answers = beside(
                        door.url, index, interval_s, lambda: victim_ttfts(door.url, args.samples, "abused")
                    )
                    statuses = sorted({status for status, _, _ in answers})
                    right = all(status == abuse.status and shaped for status, _, shaped in answers)
                    ratios = [statistics.median(t) / statistics.median(b) for t, b in zip(ttfts, baseline, strict=True)]
                    ratio = max(ratios)
                    times = [took for _, took, _ in answers]
                    ok = right and ratio <= TTFT_RATIO
                    failed |= not ok and interval_s > 0
                    say(
                        f"{pace:16s} point {abuse.point:2d} {abuse.name:30s} {len(answers):5d} answers {statuses} "
                        f"(OpenAI's shape: {right}), median {median_ms(times):4.0f} ms, p99 "
                        f"{statistics.quantiles(times, n=100)[98] * 1000 if len(times) > 1 else times[0] * 1000:5.0f} "
                        f"ms; victim TTFT medians {median_ms(ttfts[0]):3.0f}/{median_ms(ttfts[1]):3.0f} ms (turns 1/2), "
                        f"idle {median_ms(baseline[0]):3.0f}/{median_ms(baseline[1]):3.0f} ms: {ratios[0]:.2f}x/"
                        f"{ratios[1]:.2f}x {'ok' if ok else 'over'}"
                    )
            say(f"memory: door RSS {door.rss_mb():.0f} MiB after the rounds beside the victim")
        finally:
            door.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
