"""What one request's fields may hold, checked before they cost anything (docs/serve.md, "Serving many users",
the table of bounds). The door's own limits on the request as a whole (bytes, headers, messages, steps at once)
are src/agentkv/_surfaces/_limits.py's.

* **nesting**: a body is parsed by pydantic's JSON parser (jiter, `parse_json`), which stops at about
  `MAX_JSON_DEPTH` levels of objects and arrays: deeper is a 400 (Python's own parser raised RecursionError, a
  500, past about a thousand levels, after holding every level);
* **ids** (conversation keys, ``request_id``, ``previous_response_id``, a path's response id) are 1 to
  `MAX_ID_CHARS` visible ASCII characters (`check_id`): they are echoed in headers (``x-session-id``,
  ``x-request-id``) and name stored rows, so a byte outside that (a NUL, CR, LF, a non-Latin-1 letter) is a 400
  before anything runs or is kept;
* **metadata** as OpenAI bounds it: 16 pairs at most, keys of 64 characters, string values of 512 (`check_metadata`);
  ``user`` (metadata, echoed) `MAX_USER_CHARS`;
* **chat_template_kwargs**: an object of at most `MAX_TEMPLATE_KWARGS_BYTES` of JSON, `MAX_TEMPLATE_KWARGS_DEPTH`
  levels deep (`check_template_kwargs`);
* **cache_salt** as vLLM checks it: a non-empty string of at most 128 characters without ``@``, ``/``, ``\\`` or NUL;
* **schemas that become a grammar** (tools' ``parameters``, ``response_format``, ``text.format``,
  ``structured_outputs``): at most `MAX_SCHEMA_BYTES` of JSON in one request (`check_schema_bytes`), compiled by
  the engines' grammar backend in well under a second at that size (xgrammar, measured on the bundled model's
  vocabulary: 0.2 s for 37 KB of properties, 0.17 s for a 90 KB enum), where a 2 MB enum took over 100 s.

Each refusal is a `UserError` (a 400 in OpenAI's shape, naming the field: ``param``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pydantic_core
from pydantic import BaseModel

from .._errors import UserError

__all__ = [
    "MAX_ID_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_SCHEMA_BYTES",
    "MAX_USER_CHARS",
    "BoundError",
    "check_cache_salt",
    "check_id",
    "check_metadata",
    "check_request",
    "check_schema_bytes",
    "check_template_kwargs",
    "body_field",
    "check_user",
    "is_id",
    "parse_json",
]

MAX_JSON_DEPTH = 200
"""The deepest nesting of objects and arrays a request body may have (the JSON parser's recursion limit)."""
MAX_ID_CHARS = 256
"""The longest id (a conversation key, ``request_id``, a response id)."""
MAX_USER_CHARS = 256
"""The longest ``user``."""
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
"""OpenAI's bounds on ``metadata``: pairs, a key's characters, a value's characters."""
MAX_SCHEMA_BYTES = 64 * 1024
"""The most JSON, in all, of the schemas and grammars one request asks to constrain its output with."""
MAX_CACHE_SALT_CHARS = 128
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
"""The most JSON of a request's ``chat_template_kwargs`` (each step's rendering reads them all)."""
MAX_TEMPLATE_KWARGS_DEPTH = 8
"""The deepest nesting of objects and arrays in ``chat_template_kwargs``."""

_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_ID_CHARS}}}")


class BoundError(UserError):
    """A field past its bound (a 400 naming it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.openai_param = param


def parse_json(body: bytes) -> Any:
    """The JSON of ``body``: a `UserError` when it is not JSON, a `BoundError` when it nests past the parser's limit
    (`MAX_JSON_DEPTH`), before that level is held."""
    try:
        return pydantic_core.from_json(body, cache_strings="keys")  # values seldom repeat: 2x faster
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise BoundError("body", f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep") from None
        raise UserError(f"body: the request is not JSON ({exc})") from None


def is_id(value: object) -> bool:
    """Whether ``value`` is an id the door takes (1 to `MAX_ID_CHARS` visible ASCII characters)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def check_id(param: str, value: object) -> str:
    """``value``, checked to be an id (`is_id`)."""
    if not is_id(value):
        raise BoundError(
            param, f"an id is 1 to {MAX_ID_CHARS} visible ASCII characters (letters, digits, punctuation; no spaces)"
        )
    assert isinstance(value, str)
    return value


def check_user(value: object) -> None:
    """``user``: OpenAI's end-user id, metadata only: a string of at most `MAX_USER_CHARS` characters."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_CHARS):
        raise BoundError("user", f"a string of at most {MAX_USER_CHARS} characters")


def check_metadata(metadata: object) -> None:
    """``metadata`` within OpenAI's bounds: at most 16 pairs, string keys of 64 characters, string values of 512."""
    if metadata is None:
        return
    if not isinstance(metadata, Mapping) or len(metadata) > MAX_METADATA_PAIRS:
        raise BoundError("metadata", f"an object of at most {MAX_METADATA_PAIRS} key-value pairs")
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY:
            raise BoundError("metadata", f"a key is a string of at most {MAX_METADATA_KEY} characters")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise BoundError("metadata", f"a value is a string of at most {MAX_METADATA_VALUE} characters")


def check_cache_salt(salt: object) -> str | None:
    """``cache_salt`` as vLLM takes it: None, or a non-empty string of at most 128 characters without ``@``, ``/``,
    ``\\`` or NUL."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS or any(c in salt for c in "@/\\\0"):
        raise BoundError(
            "cache_salt",
            f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters without '@', '/', '\\' or NUL",
        )
    return salt


def _depth_past(value: object, limit: int) -> int:
    """How deep ``value`` nests objects and arrays, counted only until it passes ``limit``."""
    deepest, stack = 0, [(value, 0)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        if isinstance(item, Mapping | list | tuple):
            deepest = max(deepest, depth + 1)
            stack.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, Mapping) else item))
    return deepest


def check_template_kwargs(kwargs: object) -> None:
    """``chat_template_kwargs``: None, or an object of at most `MAX_TEMPLATE_KWARGS_BYTES` of JSON nested at most
    `MAX_TEMPLATE_KWARGS_DEPTH` levels (the template reads them at every step's rendering)."""
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping):
        raise BoundError("chat_template_kwargs", "an object of the chat template's extra arguments")
    if _size_past(kwargs, MAX_TEMPLATE_KWARGS_BYTES) > MAX_TEMPLATE_KWARGS_BYTES:
        raise BoundError("chat_template_kwargs", f"at most {MAX_TEMPLATE_KWARGS_BYTES // 1024} KiB of JSON")
    if _depth_past(kwargs, MAX_TEMPLATE_KWARGS_DEPTH) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise BoundError("chat_template_kwargs", f"nested at most {MAX_TEMPLATE_KWARGS_DEPTH} levels deep")


def _size_past(value: object, budget: int) -> int:
    """About how many bytes of JSON ``value`` is (its strings' characters and the punctuation around them), counted
    only until it passes ``budget``: a value far past it costs no more to refuse than one at it."""
    size, stack = 0, [value]
    while stack and size <= budget:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item) + 3
        elif isinstance(item, Mapping):
            size += 2
            for key, inner in item.items():
                size += len(str(key)) + 4
                stack.append(inner)
        elif isinstance(item, list | tuple):
            size += 2 + len(item)
            stack.extend(item)
        else:
            size += 8
    return size


def check_schema_bytes(**schemas: Any) -> None:
    """Refuse schemas and grammars (by the request field that carries each; None: not given) of more than
    `MAX_SCHEMA_BYTES` of JSON in all: each becomes a grammar the engines compile before the step's first token.
    Measured as it is walked, and no further than the bound: a 2 MB enum is refused after its first 64 KiB."""
    total = 0
    for param, schema in schemas.items():
        if schema is None:
            continue
        total += _size_past(schema, MAX_SCHEMA_BYTES - total)
        if total > MAX_SCHEMA_BYTES:
            raise BoundError(
                param,
                f"the request's schemas and grammars (tools' parameters, response_format, text.format, "
                f"structured_outputs) hold more than {MAX_SCHEMA_BYTES // 1024} KiB of JSON",
            )


def body_field(body: BaseModel | Mapping[str, Any], name: str) -> Any:
    """A request's field: of its JSON object, or of a request model, declared or extra (a pydantic model with
    ``extra="allow"`` keeps the fields it does not declare)."""
    if isinstance(body, Mapping):
        return body.get(name)
    if name in type(body).model_fields:
        return getattr(body, name)
    return (body.model_extra or {}).get(name)


def check_request(body: BaseModel | Mapping[str, Any]) -> None:
    """A request's fields within their bounds (whichever of them its API has): ``user``, ``request_id``,
    ``metadata``, ``cache_salt``, and the schemas that become a grammar. Checked on its JSON object, before a model
    reads it (a field of the wrong type is refused here as past its bound)."""
    check_user(body_field(body, "user"))
    request_id = body_field(body, "request_id")
    if request_id is not None:
        check_id("request_id", request_id)
    check_metadata(body_field(body, "metadata"))
    check_cache_salt(body_field(body, "cache_salt"))
    check_template_kwargs(body_field(body, "chat_template_kwargs"))
    tools = body_field(body, "tools") or []
    parameters = []
    for tool in tools:
        if isinstance(tool, Mapping):
            function = tool.get("function")
            parameters.append((function if isinstance(function, Mapping) else tool).get("parameters"))
    text = body_field(body, "text")
    check_schema_bytes(
        tools=[p for p in parameters if p is not None] or None,
        response_format=body_field(body, "response_format"),
        text=text.get("format") if isinstance(text, Mapping) else None,
        structured_outputs=body_field(body, "structured_outputs"),
    )
