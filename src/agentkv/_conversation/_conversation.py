"""The conversation as token ids, exactly as the model saw and produced them (docs/concepts.md, "The token-exact rule").

The next prompt is always: the previous prompt + the generated tokens exactly as generated
+ the tokens of what was appended. Nothing is re-tokenized on the step path: appended
messages are rendered with the chat template against a small fixed context and only the
rendered delta is tokenized. A template that renders an earlier part differently once more
messages follow (so that no token-exact delta exists) raises `TemplateError`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from .._errors import InvalidMessageError, TemplateError, UserError
from ._template_kwargs import template_arguments
from ._tools import ToolCall

__all__ = ["ChatRenderer", "Conversation", "Message", "SavedSegment", "check_unicode"]

Role = Literal["system", "user", "assistant", "tool"]

# Placeholder contents for the fixed rendering context; never sent to a model.
_USER_PLACEHOLDER = "\x00agentkv-user\x00"
_ASSISTANT_PLACEHOLDER = "\x00agentkv-assistant\x00"
_NEXT_PLACEHOLDER = "\x00agentkv-next-assistant\x00"
_CONTENT_MARKER = re.compile("\x00agentkv-content-(\\d+)\x00")

_TOKENIZER_LOCK = threading.Lock()
"""Guards the tokenizer's shared ``split_special_tokens`` switch (sessions on several loop threads share one)."""


def check_unicode(text: str, what: str) -> None:
    """`InvalidMessageError` naming ``what`` if ``text`` is not valid Unicode (a lone surrogate: no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(f"{what} is not valid Unicode text ({exc.reason} at {exc.start})") from None


def _content_marker(index: int) -> str:
    return f"\x00agentkv-content-{index}\x00"


class Message(BaseModel):
    """One chat message.

    In `Session.step` an assistant message may carry the tool calls the model made (its
    content is then usually empty) and a tool message names the call it answers.
    """

    model_config = ConfigDict(frozen=True)

    role: Role
    content: str
    name: str | None = None
    """The tool's name, on tool messages."""
    tool_calls: tuple[ToolCall, ...] = ()
    """On assistant messages: the tools the model called."""
    tool_call_id: str | None = None
    """On tool messages: the id of the call this message answers."""

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages answer a tool call")
        return self

    def chat_dict(self) -> dict[str, Any]:
        """The message as an OpenAI chat message (what the front door and the adapters store; sessions take it back)."""
        written: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            written["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            written["tool_call_id"] = self.tool_call_id
        return written

    def template_dict(self) -> dict[str, Any]:
        """The dict a chat template renders."""
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            data["name"] = self.name
        return data


class ChatRenderer:
    """Token deltas from a Hugging Face tokenizer's chat template."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        system: Message | None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._tools = tools
        """Tool schemas the template renders itself (models with native tool support), or None."""
        self._template_kwargs = template_arguments(tokenizer, template_kwargs)
        """The extra arguments of the template (a request's ``chat_template_kwargs``) the template reads."""
        head = [system] if system is not None else []
        self._after_assistant = [
            *head,
            Message(role="user", content=_USER_PLACEHOLDER),
            Message(role="assistant", content=_ASSISTANT_PLACEHOLDER),
        ]
        prompt = self._render(self._after_assistant[:-1], generation_prompt=True)
        self._base = self._render(self._after_assistant, generation_prompt=False)
        if not self._base.startswith(prompt + _ASSISTANT_PLACEHOLDER):
            raise TemplateError(
                "the chat template does not render an assistant message as the generation "
                "prompt followed by its content; token-exact deltas are impossible with it"
            )
        self.assistant_suffix = self._base[len(prompt) + len(_ASSISTANT_PLACEHOLDER) :]
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()))
        self._special_texts = [str(t) for t in getattr(tokenizer, "all_special_tokens", ()) if t]

    def with_system(self, system: Message | None) -> ChatRenderer:
        """A renderer for the same tokenizer with another system message."""
        return ChatRenderer(self._tokenizer, system=system, tools=self._tools, template_kwargs=self._template_kwargs)

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        """The template's text of ``messages``; what the template itself refuses (its ``raise_exception``: a system
        message where it takes none, roles out of the order it allows) is an `InvalidMessageError` naming it."""
        from jinja2.exceptions import TemplateError as JinjaTemplateError

        extra = {**self._template_kwargs, **({"tools": self._tools} if self._tools is not None else {})}
        try:
            text = self._tokenizer.apply_chat_template(
                [m.template_dict() for m in messages], tokenize=False, add_generation_prompt=generation_prompt, **extra
            )
        except JinjaTemplateError as exc:
            roles = ", ".join(m.role for m in messages if m.content not in (_USER_PLACEHOLDER, _ASSISTANT_PLACEHOLDER))
            raise InvalidMessageError(f"the model's chat template refuses these messages ({roles}): {exc}") from exc
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in it are recognised; no BOS added)."""
        with _TOKENIZER_LOCK:
            return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=False))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: ``<|im_end|>`` written in it is not a control token."""
        with _TOKENIZER_LOCK:
            ids = list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
            self._tokenizer.encode("", add_special_tokens=False, split_special_tokens=False)  # reset the shared flag
            return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` without special tokens."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def initial(self, messages: Sequence[Message]) -> list[int]:
        """Tokens of a whole conversation start, ending with the generation prompt."""
        return self._encode_messages(lambda shown: self._render(shown, generation_prompt=True), messages)

    def after_assistant(self, generated: Sequence[int], messages: Sequence[Message]) -> list[int]:
        """Tokens to append after an assistant output ``generated``: its closing tail, the
        messages, and the next generation prompt."""
        tail = self._closing_tail(generated)

        def render(shown: Sequence[Message]) -> str:
            full = self._render([*self._after_assistant, *shown], generation_prompt=True)
            if not full.startswith(self._base):
                raise TemplateError(
                    "the chat template renders an assistant message differently once more messages "
                    "follow; token-exact deltas are impossible with it"
                )
            return tail + full[len(self._base) :]

        return self._encode_messages(render, messages)

    def opening(self, head: Sequence[Message]) -> list[int]:
        """Tokens before an assistant message that opens a conversation (after the system message ``head``, if any):
        what the template writes up to that message's content."""

        def render(shown: Sequence[Message]) -> str:
            full = self._render([*shown, Message(role="assistant", content=_NEXT_PLACEHOLDER)], generation_prompt=False)
            return self._before_next(full, 0)

        return self._encode_messages(render, head)

    def between_outputs(self, generated: Sequence[int]) -> list[int]:
        """Tokens between an assistant output ``generated`` and another assistant message right after it: the first
        one's closing tail and the second one's opening, as the template writes two assistant messages in a row."""
        full = self._render(
            [*self._after_assistant, Message(role="assistant", content=_NEXT_PLACEHOLDER)], generation_prompt=False
        )
        if not full.startswith(self._base):
            raise TemplateError(
                "the chat template renders an assistant message differently once another one follows; "
                "token-exact deltas are impossible with it"
            )
        return self.encode(self._closing_tail(generated) + self._before_next(full, len(self._base)))

    def _before_next(self, full: str, start: int) -> str:
        """The text of ``full`` from ``start`` to the placeholder content of its last (assistant) message, checked
        to end that message as every assistant message ends (`assistant_suffix`)."""
        at = full.find(_NEXT_PLACEHOLDER, start)
        if at < 0 or full[at + len(_NEXT_PLACEHOLDER) :] != self.assistant_suffix:
            raise TemplateError(
                "the chat template does not render this assistant message as its opening, its content and the "
                "usual ending; token-exact deltas are impossible with it"
            )
        return full[start:at]

    def _encode_messages(self, render: Callable[[Sequence[Message]], str], messages: Sequence[Message]) -> list[int]:
        """Tokens of ``render(messages)``, with message contents as plain text (never control tokens).

        The template's own markup keeps its special tokens. Contents without special-token text
        are tokenized with the markup, as a full render would be; otherwise the render is split
        at the contents (rendered with markers) and each content is tokenized as plain text.
        """
        for message in messages:  # what no tokenizer takes is refused here, whatever path it came by
            check_unicode(message.content + (message.name or ""), f"a {message.role} message")
        text = render(messages)
        if not any(self._has_special_text(m.content) for m in messages):
            return self.encode(text)
        marked = render([m.model_copy(update={"content": _content_marker(i)}) for i, m in enumerate(messages)])
        parts = _CONTENT_MARKER.split(marked)  # markup, index, markup, index, ..., markup
        contents = [messages[int(index)].content for index in parts[1::2]]
        if "".join(p if i % 2 == 0 else contents[i // 2] for i, p in enumerate(parts)) != text:
            raise InvalidMessageError(
                "a message contains the model's special-token text, and this chat template does not "
                "render message contents verbatim, so it cannot be kept as plain text"
            )
        ids: list[int] = []
        for i, part in enumerate(parts):
            ids += self.encode(part) if i % 2 == 0 else self.encode_text(contents[i // 2])
        return ids

    def _has_special_text(self, text: str) -> bool:
        return any(special in text for special in self._special_texts)

    def _closing_tail(self, generated: Sequence[int]) -> str:
        """The part of the template's assistant suffix the model did not generate itself."""
        if generated and generated[-1] in self._special_ids:
            stop_text = str(self._tokenizer.decode([generated[-1]], skip_special_tokens=False))
            if self.assistant_suffix.startswith(stop_text):
                return self.assistant_suffix[len(stop_text) :]
        return self.assistant_suffix


class SavedSegment(BaseModel):
    """Part of a saved conversation: messages rendered from ``start``, or an output exactly as generated."""

    model_config = ConfigDict(frozen=True)

    start: int
    messages: list[Message]
    generated: list[int] | None = None


@dataclass(frozen=True)
class _Segment:
    start: int
    """Token offset where the segment starts."""
    messages: tuple[Message, ...]
    generated: tuple[int, ...] | None = None
    """For an assistant output: its token ids, exactly as generated."""


@dataclass(frozen=True)
class Checkpoint:
    """A point a conversation can be restored to (see `Conversation.checkpoint`)."""

    tokens: int
    segments: int


class Conversation:
    """A chat as token ids, with the messages they render and the points where turns begin."""

    def __init__(self, renderer: ChatRenderer, *, system: Message | None) -> None:
        self._renderer = renderer
        self.system = system
        self.tokens: list[int] = []
        self._segments: list[_Segment] = []

    # ----------------------------------------------------------------- reading

    @property
    def renderer(self) -> ChatRenderer:
        """How its messages become tokens."""
        return self._renderer

    @property
    def messages(self) -> list[Message]:
        """Every message, the system message first when there is one."""
        head = [self.system] if self.system is not None else []
        return head + [m for segment in self._segments for m in segment.messages]

    # ----------------------------------------------------------------- appending

    def add_messages(self, messages: Sequence[Message]) -> None:
        """Append messages and the generation prompt, as tokens."""
        if not messages:
            raise UserError("nothing to append")
        for message in messages:
            if message.role == "assistant":
                raise InvalidMessageError("assistant messages come from the model; use add_output")
        start = len(self.tokens)
        if not self._segments:
            head = [self.system] if self.system is not None else []
            self.tokens = self._renderer.initial([*head, *messages])
        else:
            previous = self._segments[-1].generated
            if previous is None:
                raise UserError("messages can only follow an assistant output; send them together")
            self.tokens.extend(self._renderer.after_assistant(previous, messages))
        self._segments.append(_Segment(start, tuple(messages)))

    def add_output(self, token_ids: Sequence[int], text: str) -> None:
        """Append an assistant output exactly as generated.

        After appended messages it follows their generation prompt. First in the conversation, or right after
        another output (a caller's history may hold two assistant messages in a row), it is opened as the chat
        template opens an assistant message there: those tokens are a segment of no message of their own."""
        if not self._segments:
            head = [self.system] if self.system is not None else []
            self.tokens = self._renderer.opening(head)
            self._segments.append(_Segment(0, ()))
        elif self._segments[-1].generated is not None:
            start = len(self.tokens)
            self.tokens.extend(self._renderer.between_outputs(self._segments[-1].generated or ()))
            self._segments.append(_Segment(start, ()))
        self._segments.append(_Segment(len(self.tokens), (Message(role="assistant", content=text),), tuple(token_ids)))
        self.tokens.extend(token_ids)

    # ----------------------------------------------------------------- going back

    def checkpoint(self) -> Checkpoint:
        """The current end, to restore to if a turn fails."""
        return Checkpoint(len(self.tokens), len(self._segments))

    def restore(self, checkpoint: Checkpoint) -> None:
        """Drop everything appended since ``checkpoint``."""
        del self.tokens[checkpoint.tokens :]
        del self._segments[checkpoint.segments :]

    def turn_starts(self) -> list[int]:
        """Indexes of the segments where a turn (a user message) begins."""
        return [
            i for i, s in enumerate(self._segments) if s.generated is None and any(m.role == "user" for m in s.messages)
        ]

    def rewind(self, turns: int = 1) -> None:
        """Drop the last ``turns`` turns (their user messages and everything after)."""
        starts = self.turn_starts()
        if not 1 <= turns <= len(starts):
            raise UserError(f"cannot rewind {turns} turn(s): the conversation has {len(starts)}")
        segment = self._segments[starts[-turns]]
        self.restore(Checkpoint(segment.start, starts[-turns]))

    def replace(self, index: int, content: str) -> None:
        """Replace the content of message ``index`` (as in `messages`) and re-render what follows."""
        messages = self.messages
        if not 0 <= index < len(messages):
            raise UserError(f"no message {index}: the conversation has {len(messages)}")
        offset = 1 if self.system is not None else 0
        if index < offset:
            self.system = Message(role="system", content=content)
            self._renderer = self._renderer.with_system(self.system)
            self._replay(0, None)
            return
        position = index - offset
        for number, segment in enumerate(self._segments):
            if position < len(segment.messages):
                self._replay(number, (position, content))
                return
            position -= len(segment.messages)

    def _replay(self, first: int, change: tuple[int, str] | None) -> None:
        segments = self._segments[first:]
        self.restore(Checkpoint(self._segments[first].start if segments else len(self.tokens), first))
        for number, segment in enumerate(segments):
            messages = list(segment.messages)
            generated = segment.generated
            if change is not None and number == 0:
                messages[change[0]] = messages[change[0]].model_copy(update={"content": change[1]})
                if generated is not None:  # an edited answer is no longer what the model generated
                    generated = tuple(self._renderer.encode_text(change[1]))
            if generated is not None:
                self.add_output(generated, messages[0].content)
            elif messages:  # an output's opening (no message of its own) is added again by the output
                self.add_messages(messages)

    def saved(self) -> list[SavedSegment]:
        """The conversation's segments, to save it (`loaded` makes it again, token for token)."""
        return [
            SavedSegment(
                start=s.start, messages=list(s.messages), generated=None if s.generated is None else list(s.generated)
            )
            for s in self._segments
        ]

    @classmethod
    def loaded(
        cls, renderer: ChatRenderer, *, system: Message | None, tokens: Sequence[int], segments: Sequence[SavedSegment]
    ) -> Conversation:
        """A saved conversation, its token ids as saved (never re-rendered); raises `UserError` if they do not fit."""
        conversation = cls(renderer, system=system)
        if not segments and tokens:  # an empty conversation (no turn yet) has no tokens either
            raise UserError("the saved conversation's segments do not fit its tokens")
        ends = [s.start for s in segments[1:]] + [len(tokens)] if segments else []
        for segment, end in zip(segments, ends, strict=True):
            if not 0 <= segment.start <= end or (
                segment.generated is not None and segment.generated != list(tokens[segment.start : end])
            ):
                raise UserError("the saved conversation's segments do not fit its tokens")
            if segment.generated is not None and [m.role for m in segment.messages] != ["assistant"]:
                raise UserError("a saved output segment holds one assistant message")
        if segments and segments[0].start != 0:
            raise UserError("the saved conversation's segments do not fit its tokens")
        conversation.tokens = list(tokens)
        conversation._segments = [
            _Segment(s.start, tuple(s.messages), None if s.generated is None else tuple(s.generated)) for s in segments
        ]
        return conversation

    def rerendered(self, renderer: ChatRenderer, system: Message | None) -> Conversation:
        """This conversation under another renderer and system message (another tool list): its messages rendered
        again, each output kept exactly as generated."""
        twin = Conversation(renderer, system=system)
        twin.tokens = list(self.tokens)
        twin._segments = list(self._segments)
        if twin._segments:
            twin._replay(0, None)
        return twin

    def copy(self) -> Conversation:
        """An independent copy (for forks)."""
        twin = Conversation(self._renderer, system=self.system)
        twin.tokens = list(self.tokens)
        twin._segments = list(self._segments)
        return twin
