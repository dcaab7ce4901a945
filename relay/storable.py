"""Received messages as rows PostgreSQL will take, whatever a client sent.

One rule: what the columns cannot hold as given (a NUL character, invalid
UTF-8, JSON nested too deep, a value past an index's size) makes the row
`dead` with a `last_error` that says what was wrong. The columns then hold
escaped text (a NUL as the four characters `\\x00`, an invalid byte as
`\\xNN`), and `raw_properties` the properties exactly as received, from the
broker adapter (Incoming.original). Nothing here raises for a message's
content: a message always becomes one row.

Also the JSON decoding the dispatcher uses for payloads and headers, so
that what the receiver stores as pending is what a handler can be given.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

import orjson

from relay.brokers import Incoming
from relay.errors import ContentError, NotCarried
from relay.limits import (
    MAX_ID_BYTES,
    MAX_JSON_DEPTH,
    MAX_KEY_BYTES,
    clean_error,
    escape,
    json_depth,
    original_bytes,
    problem,
)
from relay.rows import NewInboxRow

# orjson writes nothing nested deeper than this; deeper header tables are
# kept in raw_properties only.
MAX_HEADER_DEPTH = 254

_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
_NUL_ESCAPE_TEXT = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# orjson reads integers over 64 bits as floats; such payloads go through the
# json module, which keeps them exact.
_LONG_DIGITS = re.compile(r"[0-9]{19,}")
# Texts shorter than this are searched for such integers before orjson reads them.
_SEARCH_FIRST = 48


# --------------------------------------------------------------------------
# JSON, as relay decodes it everywhere
# --------------------------------------------------------------------------


def loads(text: str | bytes) -> Any:
    """A payload or headers JSON text as Python values, numbers exact.

    NotCarried (a ValueError) for anything else: not JSON, nested deeper
    than MAX_JSON_DEPTH, a NUL character PostgreSQL's jsonb cannot hold."""
    if isinstance(text, str):
        # A short text is searched for long numbers first; in a longer one
        # (a message's headers, say) that search costs three times orjson's
        # reading, so it is searched only when orjson read a float (which
        # it does for an integer past 64 bits) or failed.
        short = len(text) < _SEARCH_FIRST
        if not (short and _LONG_DIGITS.search(text)):
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                if short or not _LONG_DIGITS.search(text):
                    raise NotCarried(_json_problem(text, exc)) from None
            else:
                _check_depth(text)  # first: _has_float recurses as deep as the JSON
                if short or not (_has_float(value) and _LONG_DIGITS.search(text)):
                    return value
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    return _loads_exact(raw)


def _has_float(value: Any) -> bool:
    """Whether a value orjson read holds a float anywhere."""
    kind = type(value)
    if kind is dict:
        items = value.values()
    elif kind is list:
        items = value
    else:
        return kind is float
    for item in items:
        kind = type(item)
        if kind is float or ((kind is dict or kind is list) and _has_float(item)):
            return True
    return False


def _loads_exact(raw: bytes) -> Any:
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise NotCarried(_too_deep(depth))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotCarried(f"not valid UTF-8 ({exc})") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise NotCarried(f"not valid JSON ({exc})") from None


def _check_depth(text: str | bytes) -> None:
    """NotCarried for JSON nested past MAX_JSON_DEPTH (counted only when
    there are that many brackets at all: one pass of C code otherwise)."""
    opening = ("[", "{") if isinstance(text, str) else (b"[", b"{")
    if text.count(opening[0]) + text.count(opening[1]) > MAX_JSON_DEPTH:  # type: ignore[arg-type]
        depth = json_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise NotCarried(_too_deep(depth))


def _too_deep(depth: int) -> str:
    return f"JSON nested {depth} levels deep, over relay's limit of {MAX_JSON_DEPTH} levels"


def _json_problem(text: str | bytes, exc: Exception) -> str:
    if "depth" in str(exc) or "recursion" in str(exc).lower():
        return _too_deep(json_depth(text))
    return f"not valid JSON ({exc})"


def json_body(body: bytes) -> tuple[str | None, str | None]:
    """(JSON text, None) for a body jsonb will take, (None, why not) otherwise."""
    try:
        orjson.loads(body)
        _check_depth(body)
    except NotCarried as why:
        return None, f"body is {why}"
    except orjson.JSONDecodeError as exc:
        problem = _json_problem(body, exc)
        if problem.startswith("JSON nested"):
            return None, f"body is {problem}"
        try:  # orjson refuses some valid JSON (numbers past a double's range)
            _loads_exact(body)
        except NotCarried as why:
            return None, f"body is {why if str(why).startswith('JSON nested') else problem}"
    try:
        # A copy that stays while the batch is stored: psycopg sends text,
        # and the row's payload is the body's text as it came.
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:  # orjson takes lone surrogates' bytes
        return None, f"body is not valid UTF-8 ({exc})"
    if b"\\u0000" in body and _NUL_ESCAPE.search(body):
        return None, "body is JSON holding a NUL character (\\u0000), which jsonb cannot store"
    return text, None


# --------------------------------------------------------------------------
# Headers
# --------------------------------------------------------------------------


class _Unstorable(ContentError):
    """A header value no JSON text can hold (caught here, never raised out)."""


def _header_default(value: Any) -> Any:
    """Values orjson does not write itself: AMQP byte arrays (text when they
    are UTF-8, else {"base64": ...}), decimals, anything else as text."""
    if isinstance(value, (bytearray, memoryview)):
        raw = bytes(value)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and "\x00" not in text:
            return text
        return {"base64": base64.b64encode(raw).decode()}
    if isinstance(value, bytes):  # a long string that was not UTF-8
        raise _Unstorable
    if isinstance(value, Decimal):
        return str(value)
    return str(value)


def headers_json(headers: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The headers as a JSON object jsonb will take, and what could not be
    stored as given (empty for a clean message)."""
    if not headers:
        return "{}", []
    try:
        text = orjson.dumps(headers, default=_header_default).decode()
    except (orjson.JSONEncodeError, _Unstorable, TypeError):
        text = None
    if text is not None and not ("\\u0000" in text and _NUL_ESCAPE_TEXT.search(text)):
        return text, []
    problems: list[str] = []
    try:
        clean = _clean_value(dict(headers), "", problems, 0)
        return orjson.dumps(clean, default=_header_default).decode(), problems
    except (_Unstorable, RecursionError, orjson.JSONEncodeError, TypeError):
        return "{}", [f"headers are nested deeper than {MAX_HEADER_DEPTH} levels"]


def _clean_value(value: Any, where: str, problems: list[str], depth: int) -> Any:
    if isinstance(value, str):
        why = problem(value)
        if why:
            problems.append(f"header {where} {why}")
            return escape(value)
        return value
    if isinstance(value, bytes):
        problems.append(f"header {where} is not valid UTF-8")
        return value.decode("utf-8", "backslashreplace").replace("\x00", "\\x00")
    if isinstance(value, dict):
        if depth >= MAX_HEADER_DEPTH:
            raise _Unstorable
        out = {}
        for key, item in value.items():
            name = str(key)
            why = problem(name)
            shown = escape(name)
            if why:
                problems.append(f"header name {shown!r} {why}")
            out[shown] = _clean_value(
                item, f"{where}.{shown}" if where else repr(shown), problems, depth + 1
            )
        return out
    if isinstance(value, (list, tuple)):
        if depth >= MAX_HEADER_DEPTH:
            raise _Unstorable
        return [
            _clean_value(item, f"{where}[{i}]", problems, depth + 1) for i, item in enumerate(value)
        ]
    return value


# --------------------------------------------------------------------------
# Messages to rows
# --------------------------------------------------------------------------


def dedup_key(message: Incoming) -> str:
    """The producer's id, else sha256: + the hex digest of the body."""
    if message.message_id:
        return message.message_id
    return "sha256:" + hashlib.sha256(message.body).hexdigest()


def _lossless_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _lossless(value: Any) -> Any:
    """Strings that stood for invalid UTF-8 back to their bytes, for JSON."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value  # a NUL is fine in JSON text: \u0000
        except UnicodeEncodeError:
            return original_bytes(value)
    if isinstance(value, dict):
        return {escape(str(k)): _lossless(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lossless(v) for v in value]
    return value


def raw_properties(message: Incoming) -> str | None:
    """The adapter's lossless account of the properties as JSON text (for
    the json column, which keeps \\u0000 escapes), or None."""
    if message.original is None:
        return None
    try:
        return orjson.dumps(_lossless(message.original()), default=_lossless_default).decode()
    except (orjson.JSONEncodeError, RecursionError, TypeError, ValueError):
        return None


def to_row(message: Incoming) -> NewInboxRow:
    """The inbox row for a received message: pending when everything can be
    stored as given, else dead with every reason in last_error."""
    problems: list[str] = []
    if message.undecodable:
        problems.append(
            f"the broker's message properties could not be decoded ({message.undecodable})"
        )
    if message.unfetched:
        problems.append(message.unfetched)
    if message.rejected:
        problems.append(message.rejected)

    message_id = dedup_key(message)
    if message.message_id:
        why = problem(message_id)
        if why is None and len(message_id.encode()) > MAX_ID_BYTES:
            why = f"is longer than relay's limit of {MAX_ID_BYTES} bytes"
        if why:
            problems.append(f"message_id {why}")
            digest = hashlib.sha256(original_bytes(message.message_id)).hexdigest()
            message_id = "id-sha256:" + digest

    def column(name: str, value: str | None) -> str | None:
        if value is None:
            return None
        why = problem(value)
        if why is None:
            return value
        problems.append(f"{name} {why}")
        return escape(value)

    topic = column("topic", message.topic)
    type_ = column("type", message.type)
    key = column("key (x-relay-key)", message.key)
    if key is not None and len(key.encode()) > MAX_KEY_BYTES:
        problems.append(
            f"key (x-relay-key) is longer than relay's limit of "
            f"{MAX_KEY_BYTES} bytes; the row's key column is left empty"
        )
        key = None

    headers, header_problems = headers_json(message.headers)
    problems += header_problems

    payload, body_problem = json_body(message.body)
    if body_problem:
        problems.append(f"{body_problem}; the raw bytes are kept in inbox.body")

    raw = None
    if problems and (message.undecodable or not body_problem or len(problems) > 1):
        raw = raw_properties(message)
        if raw is not None:
            problems.append("the properties as received are kept in inbox.raw_properties")
    return NewInboxRow(
        message_id=message_id,
        topic=topic,
        key=key,
        type=type_,
        payload=payload,
        body=message.body if payload is None else None,
        headers=headers,
        status="dead" if problems else "pending",
        last_error=clean_error("; ".join(problems)) if problems else None,
        raw_properties=raw,
    )


def without_payload(row: NewInboxRow, message: Incoming, refused: str) -> NewInboxRow:
    """A row whose values PostgreSQL refused (a JSON number past numeric's
    range, say), dead, with the body kept as raw bytes instead of jsonb."""
    return dataclasses.replace(
        row,
        payload=None,
        body=message.body,
        status="dead",
        last_error=clean_error(
            f"PostgreSQL refused the message: {refused}; the raw bytes are kept in inbox.body"
            + (f"; {row.last_error}" if row.last_error else "")
        ),
    )


def last_resort(row: NewInboxRow, message: Incoming, refused: str) -> NewInboxRow:
    """A row that PostgreSQL refused, as one it cannot refuse: the body's raw
    bytes, the properties as received, and why; nothing else."""
    digest = hashlib.sha256(row.message_id.encode("utf-8", "surrogatepass")).hexdigest()
    return NewInboxRow(
        message_id=row.message_id if len(row.message_id) <= 200 else "id-sha256:" + digest,
        topic=None,
        key=None,
        type=None,
        payload=None,
        body=message.body,
        headers="{}",
        status="dead",
        last_error=clean_error(
            f"PostgreSQL refused the message: {refused}; the raw body is kept in "
            "inbox.body and the properties as received in inbox.raw_properties"
            + (f"; before that: {row.last_error}" if row.last_error else "")
        ),
        raw_properties=raw_properties(message),
    )
