"""What relay can carry: the limits every path checks against, in one place.

A value past one of these is refused by `relay.enqueue` (ValueError, before
anything is written) and, when it reaches a table some other way, fails
only its own row: `dead`, with a `last_error` that names the limit.
"""

from __future__ import annotations

import re

# PostgreSQL's B-tree indexes take at most about 2,700 bytes per entry; the
# inbox's (consumer, message_id) and (consumer, key, seq) and the outbox's
# (key, seq) hold these. Kept well under, so a long consumer name fits too.
MAX_KEY_BYTES = 1024
MAX_ID_BYTES = 1024
# AMQP short strings (topic as routing key, type, header names): 255 bytes.
MAX_SHORTSTR_BYTES = 255
# JSON nesting. Python's json module (SQLAlchemy's default serializer, and
# relay's parser for integers past 64 bits) recurses once per level under
# a recursion limit of 1,000 frames; orjson reads 1,024 levels and writes
# 254 (deeper payloads go out through relay's own compaction). 512 levels
# leave room for the callers' own frames on every path.
MAX_JSON_DEPTH = 512

# A JSON string, in the "unrolled" form: a run of plain characters is one
# step of the regex engine, where `(?:[^"\\]|\\.)*` took one per character,
# with a frame each: 2.3 s and 712 MiB of memory for a string of 6 MiB.
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def json_depth(text: str | bytes) -> int:
    """How deeply a JSON text nests arrays and objects (0 for a scalar).

    No recursion and no parse: strings are skipped, brackets counted. For
    texts that are valid JSON; on others the answer is only an estimate."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRINGS.sub(b"", raw)):
        if match[0] in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def value_depth(value: object) -> int:
    """How deeply a Python value nests dicts, lists and tuples (iteratively)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: object = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # past the limit, the answer is already "too deep"
            stack.extend((child, depth) for child in children)  # type: ignore[attr-defined]
    return deepest


def utf8_length(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


# Text PostgreSQL's text columns take: no NUL character, valid UTF-8.


def original_bytes(text: str) -> bytes:
    """The bytes a str stood for: invalid UTF-8 that a lenient decoder kept
    as surrogate escapes goes back to its bytes."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def escape(text: str) -> str:
    """Text without NUL characters or surrogates: a NUL becomes `\\x00`, a
    byte that was not UTF-8 `\\xNN`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = original_bytes(text).decode("utf-8", "backslashreplace")
    return text.replace("\x00", "\\x00")


def problem(text: str) -> str | None:
    """What keeps a str out of a text column as given, or None."""
    if "\x00" in text:
        return "contains a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None


def clean_error(text: str) -> str:
    """An error text (last_error) PostgreSQL will take."""
    return escape(text) if problem(text) else text
