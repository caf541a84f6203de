"""Benchmark workloads: seeded, deterministic multi-turn conversations.

A workload is a system prompt, the user messages of its turns, and the answer length. Every
mode replays the same messages; with greedy decoding the answers (and so the prompts) are
the same in every mode too. Each session runs under its own cache salt, so sessions that
share an engine never serve each other cached blocks.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .._errors import UserError

__all__ = ["WORKLOADS", "Workload", "load_replay", "make_workload"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One conversation to replay in every mode."""

    name: str
    system: str
    turns: tuple[str, ...]
    max_tokens: int
    """Answer length of every turn (greedy; the model may stop earlier)."""
    description: str


_TOOLS = (
    ("read_file", "Read a file of the repository.", {"path": "string"}),
    ("run_tests", "Run the test suite, or one test file.", {"path": "string"}),
    ("search_code", "Search the repository for a regular expression.", {"pattern": "string"}),
    ("edit_file", "Replace a range of lines in a file.", {"path": "string", "start": "integer", "text": "string"}),
)


@dataclass(frozen=True)
class _Recipe:
    """How a named workload is made: its conversation, its answer length at a scale, what it stands for."""

    name: str
    conversation: Callable[[int, float, random.Random], tuple[str, list[str]]]
    """(turns, scale, rng) -> the system prompt and the user messages."""
    max_tokens: Callable[[float], int]
    description: str

    def __call__(self, turns: int, scale: float, rng: random.Random) -> Workload:
        system, messages = self.conversation(turns, scale, rng)
        return Workload(
            name=self.name,
            system=system,
            turns=tuple(messages),
            max_tokens=self.max_tokens(scale),
            description=self.description,
        )


def _agentic(turns: int, scale: float, rng: random.Random) -> tuple[str, list[str]]:
    schemas = json.dumps(
        [
            {"name": name, "description": text, "parameters": {"type": "object", "properties": props}}
            for name, text, props in _TOOLS
        ]
    )
    rules = " ".join(f"Rule {i}: module m{i} stays typed and tested." for i in range(round(40 * scale)))
    system = f"You are a coding agent. Call one tool per step. Tools (JSON schema): {schemas} {rules}"
    messages = ["The test tests/test_auth.py::test_login fails with 401. Find the cause."]
    for turn in range(1, turns):
        lines = "\n".join(
            f"tests/test_m{rng.randrange(100)}.py::test_{rng.randrange(1000)} "
            f"{rng.choice(('PASSED', 'PASSED', 'FAILED'))} ({rng.randrange(5, 900)} ms)"
            for _ in range(round(20 * scale))
        )
        messages.append(f"Tool result of step {turn} (run_tests):\n{lines}\nWhat next?")
    return system, messages


def _coding(turns: int, scale: float, rng: random.Random) -> tuple[str, list[str]]:
    asks = (
        "Write a Python function that parses an ISO date and returns a datetime.",
        "Add error handling and a docstring to it.",
        "Now write three pytest tests for it.",
        "Refactor it to accept a timezone argument.",
        "Write the same function in TypeScript.",
        "Explain the edge cases you handled.",
    )
    messages = [
        asks[i % len(asks)] + ("" if i < len(asks) else f" (variant {rng.randrange(100)})") for i in range(turns)
    ]
    return "You are a senior Python engineer. Answer with complete code.", messages


def _chat(turns: int, scale: float, rng: random.Random) -> tuple[str, list[str]]:
    topics = ("the moon", "bread", "rivers", "chess", "bees", "glass", "trains", "salt", "maps", "tea")
    messages = [f"Tell me one fact about {topics[rng.randrange(len(topics))]}." for _ in range(turns)]
    return "You are a friendly assistant. Answer in one sentence.", messages


WORKLOADS: dict[str, Callable[[int, float, random.Random], Workload]] = {
    recipe.name: recipe
    for recipe in (
        _Recipe(
            "agentic",
            _agentic,
            lambda scale: 24,
            "long system prompt with tool schemas; each turn adds a tool output; short answers",
        ),
        _Recipe(
            "coding",
            _coding,
            lambda scale: round(160 * scale),
            "short requests, long generated answers: most of each prompt is the model's own output",
        ),
        _Recipe("chat", _chat, lambda scale: round(32 * scale), "short system prompt, short turns, short answers"),
    )
}
"""Each named workload's maker: (turns, scale, rng) -> the `Workload`."""


def make_workload(name: str, *, turns: int, scale: float = 1.0, seed: int = 0) -> Workload:
    """A named workload with ``turns`` turns; ``scale`` multiplies its sizes (prompt or answer)."""
    if name not in WORKLOADS:
        raise UserError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if turns < 2:
        raise UserError("a workload needs at least 2 turns (TTFT is compared from turn 2)")
    if not scale > 0:
        raise UserError(f"scale must be a positive number, not {scale!r}")
    return WORKLOADS[name](turns, scale, random.Random(seed))


def load_replay(path: str | Path, *, max_tokens: int = 64, turns: int | None = None) -> Workload:
    """A conversation file (OpenAI ``messages`` JSON): its system prompt and user messages.

    The file's assistant messages are not replayed: the model answers each user message itself.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise UserError(f"{path}: cannot read a conversation from it ({exc})") from exc
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise UserError(f'{path}: expected a list of messages with "role" and "content", or {{"messages": [...]}}')
    system = next((m["content"] for m in messages if m.get("role") == "system"), "You are a helpful assistant.")
    users = tuple(str(m["content"]) for m in messages if m.get("role") == "user")[:turns]
    if len(users) < 2:
        raise UserError(f"{path}: a replay needs at least 2 user messages")
    return Workload(
        name=f"replay:{Path(path).name}",
        system=system,
        turns=users,
        max_tokens=max_tokens,
        description=f"the user messages of {path}",
    )
