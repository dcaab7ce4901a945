"""The console's and `relay dead`'s reading speed beside a million rows.

    .venv/bin/python -m bench.console               # 1,000,000 rows per table
    .venv/bin/python -m bench.console --rows 20000  # a quick check

Fills a fresh database with ROWS outbox and ROWS inbox rows, as a busy
system has them: 94 % published/processed over the last day (retention
keeps one), 1 % pending, 5 % dead under six errors; then serves
`relay console` (a real subprocess) and times, over HTTP, the overview, the
first and a later page of dead messages, a filtered page, one message, the
error groups (`relay dead groups`' query) and the blocked keys. Each figure
is the median and the worst of REPEAT requests after one warm-up; the
target is 200 ms for the overview and the dead list. Writes
bench/results/console-<time>.json. Removes its database.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request

import psycopg

from bench.common import PG_URL, REPO, Resources, free_port, relay_command

REPEAT = 20
TARGET_MS = 200.0

ERRORS = [
    "NOT_FOUND - no exchange 'billing' in vhost '/'",
    "PayloadRejected: order_id must be a number",
    (
        'Traceback (most recent call last):\n  File "app.py", line 9, in on_order\n'
        "    raise ValueError('order has no lines')\nValueError: order has no lines"
    ),
    (
        'Traceback (most recent call last):\n  File "app.py", line 30, in on_paid\n'
        "    raise KeyError('customer')\nKeyError: 'customer'"
    ),
    "no handler for message type 'OrderArchived'",
    "the body is not JSON: Expecting value: line 1 column 1 (char 0)",
]

# One statement per table: {ids} are the table's own columns, {done} its
# finished status and the column of when it finished.
FILL = """
INSERT INTO {table} ({id_columns}topic, key, type, payload, status, attempts, last_error,
                     {written}, {done_at})
SELECT {ids}'orders.' || mod(i, 7), CASE WHEN mod(i, 100) < 5 THEN 'k' || mod(i, 5000) END,
       'OrderPlaced', jsonb_build_object('i', i, 'pad', repeat('x', 150)),
       CASE WHEN mod(i, 100) < 5 THEN 'dead' WHEN mod(i, 100) = 5 THEN 'pending'
            ELSE '{done}' END,
       CASE WHEN mod(i, 100) < 5 THEN 10 ELSE 0 END,
       CASE WHEN mod(i, 100) < 5 THEN (%(errors)s::text[])[1 + mod(i, 6)] END,
       now() - (i * 86400.0 / %(rows)s) * interval '1 second',
       CASE WHEN mod(i, 100) >= 6 THEN now() - (i * 86400.0 / %(rows)s) * interval '1 second' END
FROM generate_series(1, %(rows)s) i
"""
FILLS = [
    FILL.format(
        table="outbox",
        id_columns="",
        ids="",
        written="created_at",
        done_at="published_at",
        done="published",
    ),
    FILL.format(
        table="inbox",
        id_columns="consumer, message_id, ",
        ids="'consumer-' || mod(i, 3), 'm-' || i, ",
        written="received_at",
        done_at="processed_at",
        done="processed",
    ),
]


def timed(url: str) -> tuple[float, float, int]:
    """(median ms, worst ms, bytes) of REPEAT GETs after one warm-up."""
    with urllib.request.urlopen(url, timeout=30) as r:
        size = len(r.read())
    samples = []
    for _ in range(REPEAT):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()
            assert r.status == 200, url
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), max(samples), size


def main(rows: int) -> dict[str, object]:
    res = Resources("console")
    try:
        url = asyncio.run(res.database("console"))
        started = time.perf_counter()
        with psycopg.connect(url, autocommit=True) as conn:
            for fill in FILLS:
                conn.execute(fill, {"rows": rows, "errors": ERRORS})
            conn.execute("VACUUM ANALYZE outbox")
            conn.execute("VACUUM ANALYZE inbox")
            dead_id = conn.execute(
                "SELECT id::text FROM outbox WHERE status = 'dead' "
                "ORDER BY seq DESC LIMIT 1 OFFSET %s",
                [rows // 200],
            ).fetchone()
        fill_seconds = time.perf_counter() - started
        port = free_port()
        proc = subprocess.Popen(
            [*relay_command(), "console", "--port", str(port), "--database-url", url],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(100):
                try:
                    urllib.request.urlopen(base + "/static/console.css", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            first = urllib.request.urlopen(base + "/dead?table=outbox").read().decode()
            cursor = first.split("after=")[1].split('"')[0].replace("%3A", ":")
            pages = {
                "overview (/)": "/",
                "dead list, first page, both tables": "/dead",
                "dead list, first page, outbox": "/dead?table=outbox",
                "dead list, a later page (keyset)": f"/dead?table=outbox&after={cursor}",
                "dead list, inbox, by consumer and error text": (
                    "/dead?table=inbox&consumer=consumer-1&error=customer"
                ),
                "dead list, by error group": (
                    "/dead?table=inbox&group=ValueError%3A+order+has+no+lines"
                ),
                "one dead message": f"/message?table=outbox&id={dead_id[0] if dead_id else ''}",
                "blocked keys": "/keys",
            }
            figures = {}
            for name, path in pages.items():
                median, worst, size = timed(base + path)
                figures[name] = {
                    "median_ms": round(median, 1),
                    "worst_ms": round(worst, 1),
                    "bytes": size,
                }
                print(f"{name:50} median {median:7.1f} ms  worst {worst:7.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(15)
        return {
            "rows_per_table": rows,
            "fill_seconds": round(fill_seconds, 1),
            "repeat": REPEAT,
            "target_ms": TARGET_MS,
            "figures": figures,
            "pg": PG_URL,
        }
    finally:
        asyncio.run(res.close())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    report = main(args.rows)
    out = REPO / "bench" / "results" / f"console-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"saved {out}", file=sys.stderr)
