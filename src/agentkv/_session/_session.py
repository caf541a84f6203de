"""`Session`: a conversation pinned to its KV on an engine, with its two APIs.

`SessionCore` (``_session_core``) owns the conversation, the pin and the engine, and `SessionEdits`
(``_session_edits``) edits the conversation between turns; the turn API (``_turn_api``: ``run``/``stream``, the
SDK's tool loop) and the step API (``_step_api``: ``step``/``extends``, caller-made messages) run model calls over
it. This module only takes the constructor's arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._conversation._mcp import MCPServer
from .._conversation._tools import Tool, ToolChoice, ToolFormat
from .._engines import Engine
from .._engines._sampling import SamplingOptions
from .._errors import UserError
from ._completion_api import CompletionAPI
from ._modes import Mode
from ._session_config import SessionConfig
from ._session_core import load_tokenizer, make_engine
from ._session_edits import SessionEdits
from ._step_api import StepAPI
from ._turn_api import TurnAPI

__all__ = ["Mode", "Session", "load_tokenizer", "make_engine"]


class Session(TurnAPI, StepAPI, CompletionAPI, SessionEdits):
    """A multi-turn conversation on an engine, with its KV pinned between steps.

    Use it as a context manager: ``async with Session() as s`` on your event loop, or
    ``with Session() as s`` from synchronous code and notebooks (the engine then runs on an
    event loop of its own, and both ``s.run_sync(...)`` and ``await s.run(...)`` work).

    Args:
        engine: the engine to run on. Whether the session owns it is decided when the session
            opens: an engine that is open then is shared (other sessions may use it; whoever
            opened it closes it); an unopened one (``Session(engine=LaunchedPair())``) is opened
            by the session and becomes its own: it closes with the session.
            Default: the session starts its own engine for ``mode`` and closes it on exit.
        model: the model of the session's own engine: a bundled name, a local HF folder or a Hugging Face
            id ``org/name[@revision]`` from the HF cache (see `prepare_model`).
        mode: ``"bidirectional"`` (default: D's KV pushed back every step), ``"disaggregated"``
            (standard P/D, no push-back) or ``"colocated"`` (one engine, prefix caching).
            With ``engine=`` the default is what that engine supports.
        system: the system message.
        tools: functions the model may call (`@tool`-decorated or plain typed functions), and MCP servers whose
            tools it may call (`agentkv.mcp.MCPServer`: stdio or streamable HTTP). A server's tools are listed when
            the session opens and stay the session's (the rendered prompt, and with it the pin, stays stable); a
            list the server announces changed is taken at the start of the next turn or step, which then
            recomputes the whole prompt (docs/mcp.md). A server given unopened opens and closes with the session;
            one given open is shared.
        tool_choice: ``"auto"``, ``"required"`` (the first step of each turn must call a tool),
            ``"none"`` or a tool's name (the first step must call it).
        tool_format: ``"schema"`` (default; calls forced to JSON, works with any model) or
            ``"native"`` (the model's chat template renders the tools; its calls are read by ``tool_call_parser``).
        tool_call_parser: with ``tool_format="native"``, the vLLM tool parser that reads the model's calls, by
            its ``vllm serve --tool-call-parser`` name (``"hermes"``, ``"llama3_json"``, ``"mistral"``...; default
            ``"hermes"``: ``<tool_call>`` blocks). An unknown name raises `UserError` listing vLLM's.
        reasoning_parser: the vLLM reasoning parser (``vllm serve --reasoning-parser`` name: ``"deepseek_r1"``,
            ``"qwen3"``...) that splits a reasoning model's thinking from its answer (`StepReply.reasoning`;
            the answer is the rest). The conversation keeps the output's tokens as generated, reasoning
            included, so the next step extends them and pushes D's KV back (docs/tools.md).
        max_steps: the most model calls per turn; the last one is made to answer.
        max_tokens: the most tokens one model call may generate.
        temperature: sampling temperature (0: greedy; not negative).
        seed: sampling seed.
        sampling: every other sampling setting of vLLM's OpenAI server (`SamplingOptions`, or a mapping of
            its fields: ``top_p``, ``top_k``, ``presence_penalty``, ``logit_bias``, ``logprobs``,
            ``structured_outputs``...), under vLLM's names and ranges; each engine honours every field or
            refuses the step by name. A mistake raises `UserError` naming ``sampling.<field>``.
            ``structured_outputs`` and tools in ``tool_format="schema"`` (whose calls a JSON schema forces)
            cannot apply together: refused (`UserError`); native-format tools take it.
        expiry_margin_s: a pin that expires within this many seconds is not pushed back (not negative).
        renew_pins: while the session is open and idle (the agent runs a tool, the user types), renew its pin on D
            before it would expire or come within ``expiry_margin_s`` of it: one step of one token over the
            conversation's tokens, on D alone where the engine can (else P pulls and D pins again); its output
            is thrown away and the conversation does not change. So a pause longer than the pair's ``pin_ttl_s``
            costs no recompute: the next step pulls. A step that starts during a renewal waits for it; an edit or
            ``close`` cancels it; a renewal that fails drops the pin quietly (the next step recomputes).
            `TurnStats.pin_renewals` counts them. It costs one token on D per pin TTL per idle session. It also
            repins: a step that a stop string ended leaves no pin (vLLM aborts it), so right after such a turn a
            one-token step with no pin, on D alone where the engine can, pins the conversation from D's prefix
            cache (`TurnStats.repins`). Default: on; only engines that pin (push-back modes) renew. In a
            `SessionPool` whose store offers pins to other doors, sessions do not renew (a renewal would leave the
            store's saved pin stale).
        renew_pins_for_s: stop renewing once the session has been idle this long after its last turn (positive;
            default an hour): the pin then expires, so an abandoned session does not hold D's blocks forever.
        early_transfer: right after each turn, while the session waits for its caller, move the pin's KV into P's
            prefix cache: a one-token step over the conversation's tokens, given the pin and placed on P (P pulls
            D's new blocks now, D pins again). The next step then finds them in P's cache and pulls at most the
            partial last block, off the critical path. A step that starts meanwhile waits for it (one token) and
            takes its pin; an edit or ``close`` cancels it; one that fails drops the pin quietly.
            `TurnStats.early_transfers` counts them. It costs one token on the pair per turn (two forward passes, P's and
            D's). Default: off: on the 2-core test bed it moved 2.5x fewer tokens at the step but left its TTFT as
            it was (docs/benchmarks.md, "Steps after a pause"); on a host where P's pull of D's new blocks is a
            larger share of TTFT (long answers, slow links) turn it on. Only on engines that pin (push-back modes);
            off, like ``renew_pins``, in a `SessionPool` whose store offers pins.
        cache_salt: keep this session's cached KV apart: blocks cached under one salt never
            serve a request with another (vLLM ``cache_salt``), on P, D or a colocated engine.
            For tenants that must not share KV, and for measurements that must not help
            each other. Default: none (sessions with equal prefixes share blocks).
        engine_options: keyword arguments for the session's own engine (e.g. ``max_model_len``).

    Mistakes in these arguments raise `UserError` (`InvalidMessageError` for the system text).
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        model: str | None = None,
        mode: Mode | None = None,
        system: str | None = None,
        tools: Sequence[Tool | MCPServer | Callable[..., Any]] = (),
        tool_choice: ToolChoice = "auto",
        tool_format: ToolFormat = "schema",
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        max_steps: int = 8,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        sampling: SamplingOptions | Mapping[str, Any] | None = None,
        expiry_margin_s: float = 10.0,
        renew_pins: bool = True,
        renew_pins_for_s: float = 3600.0,
        early_transfer: bool = False,
        cache_salt: str | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        if engine is not None and (model is not None or engine_options):
            raise UserError("model= and engine_options= configure the session's own engine; not with engine=")
        config = SessionConfig.build(
            model=model,
            mode=mode,
            system=system,
            tools=tools,
            tool_choice=tool_choice,
            tool_format=tool_format,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            max_steps=max_steps,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            sampling=sampling,
            expiry_margin_s=expiry_margin_s,
            renew_pins=renew_pins,
            renew_pins_for_s=renew_pins_for_s,
            early_transfer=early_transfer,
            cache_salt=cache_salt,
            engine_options=engine_options,
        )
        self._setup(config, engine)
