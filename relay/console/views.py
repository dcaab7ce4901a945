"""How a dead row reads, as text (`relay dead show`) and on the console's pages."""

from __future__ import annotations

import json
from typing import Any

from relay.audit import Entry
from relay.dead import DeadRow


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)


def age(seconds: float | None) -> str:
    """12s, 4m 10s, 3h 5m, 2d 4h; a dash for none."""
    if seconds is None:
        return "–"  # noqa: RUF001 - a dash, as people write it
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def describe_row(row: DeadRow) -> str:
    """Every field of a dead row, for a terminal."""
    s = row.summary
    lines = [f"table:        {s.table}"]
    if s.table == "outbox":
        lines.append(f"id:           {s.id}")
        lines.append(f"created_at:   {s.written_at.isoformat()}")
    else:
        lines.append(f"consumer:     {s.consumer}")
        lines.append(f"message_id:   {s.id}")
        lines.append(f"received_at:  {s.written_at.isoformat()}")
    lines += [
        f"topic:        {s.topic}",
        f"type:         {s.type}",
        f"key:          {s.key}",
        f"attempts:     {s.attempts}",
        f"error group:  {s.error}",
        "headers:",
        _indent(pretty_json(row.headers)),
    ]
    if row.payload_text is not None:
        lines += ["payload:", _indent(pretty_json(row.payload))]
    else:
        lines.append("payload:      (none: the body was not JSON)")
    if row.body is not None:
        lines += [f"raw body ({len(row.body)} bytes):", _indent(row.body_text or "")]
    if row.raw_properties is not None:
        lines += ["raw properties:", _indent(row.raw_properties)]
    lines += ["last_error:", _indent(row.last_error)]
    return "\n".join(lines)


def entry_what(entry: Entry) -> str:
    """What an audit entry did, in one line: the action, table, count, the
    filter and ids (the console's page shows the same)."""
    parts = [entry.action]
    if entry.table:
        parts.append(entry.table)
    if entry.count is not None:
        parts.append(f"{entry.count} row{'s' if entry.count != 1 else ''}")
    if entry.filter:
        parts.append("filter " + " ".join(f"{k}={v}" for k, v in entry.filter.items()))
    if entry.ids:
        shown = ", ".join(entry.ids[:10])
        more = f" and {len(entry.ids) - 10} more" if len(entry.ids) > 10 else ""
        parts.append(f"ids {shown}{more}")
    if entry.detail:
        parts.append(f"({entry.detail})")
    return "  ".join(parts)


def describe_entry(entry: Entry) -> str:
    """An audit entry for a terminal: one line, then an edit's before and after."""
    line = f"{entry.at:%Y-%m-%d %H:%M:%S%z}  #{entry.id}  {entry.actor} ({entry.via})  "
    lines = [line + entry_what(entry)]
    for name in ("before", "after"):
        value = getattr(entry, name)
        if value is not None:
            lines += [f"  {name}:", _indent(_indent(pretty_json(value)))]
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines() or [""])
