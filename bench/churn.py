"""Where a backlog's time goes: the daemons' own claim and mark, no broker.

    .venv/bin/python -m bench.churn [--table outbox|inbox] [--messages N]
                                    [--keys K] [--explain-every N] [--keep]

Makes a database (`relay schema apply`), preloads N pending rows (K keys),
then runs the claim and mark of relay.db in a loop, as one worker with
every key, until nothing is left, and prints, per tenth of the rows, the
rate, the shared buffers the claim touched (EXPLAIN (ANALYZE, BUFFERS) of
one claim at that point) and the table's dead row versions
(pg_stat_user_tables, pgstattuple). The figures in docs/backlog.md come
from this.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
import uuid
from typing import Any

import psycopg

from bench.common import PAYLOAD_SQL, admin, connect, db_url, relay_command, relay_env
from relay.db import session as relay_session
from relay.db import sql as relay_sql

INSERT_INBOX = (
    "INSERT INTO inbox (consumer, message_id, topic, key, type, payload) "
    "SELECT 'bench', gen_random_uuid()::text, 'bench.churn', 'k' || (i %% %(keys)s), "
    f"'Bench', {PAYLOAD_SQL} FROM generate_series(1, %(n)s) AS i"
)
INSERT_OUTBOX = (
    "INSERT INTO outbox (topic, key, type, payload) "
    "SELECT 'bench.churn', 'k' || (i %% %(keys)s), "
    f"'Bench', {PAYLOAD_SQL} FROM generate_series(1, %(n)s) AS i"
)
STATS = (
    "SELECT n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, "
    "coalesce(greatest(last_vacuum, last_autovacuum)::text, '-') "
    "FROM pg_stat_user_tables WHERE relname = %s"
)


def claim_sql(table: str) -> tuple[str, str]:
    """The claim and the mark, as the daemons run them, with %-style parameters."""
    claim = relay_sql.pyformat(relay_sql.claim(table, "skip"))
    if table == "outbox":
        mark = relay_session.MARK_PUBLISHED.replace("$1", "%(ids)s::uuid[]")
    else:
        mark = relay_sql.pyformat(relay_sql.query("inbox_mark_processed"))
    return claim, mark


async def setup(url: str, table: str, n: int, keys: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        *relay_command(), "schema", "apply", "--database-url", url, env=relay_env()
    )
    if await proc.wait():
        raise SystemExit("schema apply failed")
    async with await connect(url, autocommit=True) as conn:
        await conn.execute(
            INSERT_OUTBOX if table == "outbox" else INSERT_INBOX, {"n": n, "keys": keys}
        )
        await conn.execute(f"ANALYZE {table}")


def buffers(plan: list[str]) -> int:
    """Shared buffers hit + read in the plan's top node."""
    for line in plan:
        m = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", line)
        if m:
            return int(m.group(1)) + int(m.group(2) or 0)
    return 0


_DONE = [0]  # rows marked by every worker


async def _batch(
    conn: Any, claim: str, mark: str, params: dict[str, Any], args: argparse.Namespace
) -> int | None:
    """One claim, `--hold` ms in the transaction (the publish), one mark;
    None once nothing is left to claim."""
    rows = await (await conn.execute(claim, params)).fetchall()
    if not rows:
        await conn.rollback()
        return None
    ids = [r[0] for r in rows if not r[-1]]
    if args.hold:
        await asyncio.sleep(args.hold / 1000)
    value: Any = ids if args.table == "outbox" else "[" + ",".join(f'"{i}"' for i in ids) + "]"
    await conn.execute(mark, {"ids": value, "consumer": "bench"})
    await conn.commit()
    return len(ids)


async def _worker(
    url: str, options: str, claim: str, mark: str, args: argparse.Namespace, worker: int
) -> None:
    """Another worker of the same relay: its own share of the keys."""
    params = {
        "limit": args.batch,
        "worker": worker,
        "workers": args.workers,
        "consumer": "bench",
        "budget": relay_session.UNBOUNDED,
        "alone": 1,
    }
    async with await psycopg.AsyncConnection.connect(url, options=options) as conn:
        while (claimed := await _batch(conn, claim, mark, params, args)) is not None:
            _DONE[0] += claimed


async def run(args: argparse.Namespace) -> None:
    name = f"bench_churn_{uuid.uuid4().hex[:8]}"
    async with await admin() as conn:
        await conn.execute(f'CREATE DATABASE "{name}"')
    url = db_url(name)
    try:
        await setup(url, args.table, args.messages, args.keys)
        claim, mark = claim_sql(args.table)
        options = " ".join(["-c jit=off", *relay_session.OUTBOX_SESSION_OPTIONS])
        conn = await psycopg.AsyncConnection.connect(url, options=options)
        stats_conn = await connect(url, autocommit=True)
        params: dict[str, Any] = {
            "limit": args.batch,
            "worker": 0,
            "workers": args.workers,
            "consumer": "bench",
            "budget": relay_session.UNBOUNDED,
            "alone": 1,
        }
        done, tenth = 0, max(1, args.messages // 10)
        others = [
            asyncio.create_task(_worker(url, options, claim, mark, args, w))
            for w in range(1, args.workers)
        ]
        window_start, window_done = time.perf_counter(), 0
        await stats_conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        print(f"{args.table}: {args.messages:,} rows, {args.keys} keys, batch {args.batch}")
        print(
            "done      rate/s  claim_buf  claim_ms  mark_buf  n_dead_tup  "
            "dead_tuple_pct  idx_pending_leaf_pages  last_vacuum"
        )
        next_report = tenth
        while True:
            if done >= next_report or done == 0:
                elapsed = time.perf_counter() - window_start
                rate = (done - window_done) / elapsed if done else 0.0
                cur = await conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + claim, params)
                plan = [r[0] for r in await cur.fetchall()]
                ms = next(
                    (
                        float(m.group(1))
                        for line in plan
                        if (m := re.search(r"Execution Time: ([\d.]+)", line))
                    ),
                    0.0,
                )
                await conn.rollback()
                ids = await (await conn.execute(claim, params)).fetchall()
                key = [r[0] for r in ids if not r[-1]]
                mark_plan = await (
                    await conn.execute(
                        "EXPLAIN (ANALYZE, BUFFERS) " + mark,
                        {
                            "ids": key
                            if args.table == "outbox"
                            else "[" + ",".join(f'"{k}"' for k in key) + "]",
                            "consumer": "bench",
                        },
                    )
                ).fetchall()
                await conn.rollback()
                _, dead, _, _, vac = await (
                    await stats_conn.execute(STATS, (args.table,))
                ).fetchone()  # type: ignore[misc]
                row = await (
                    await stats_conn.execute(
                        f"SELECT dead_tuple_percent FROM pgstattuple('{args.table}')"
                    )
                ).fetchone()
                idx = await (
                    await stats_conn.execute(
                        "SELECT leaf_pages FROM pg_indexes, pgstatindex(indexname::regclass) "
                        "WHERE tablename = %s AND indexname LIKE %s",
                        (args.table, f"{args.table}_pending_%"),
                    )
                ).fetchone()
                assert row is not None and idx is not None
                print(
                    f"{done:>8,}  {rate:>6,.0f}  {buffers(plan):>9,}  {ms:>8.2f}  "
                    f"{buffers([r[0] for r in mark_plan]):>8,}  {dead:>10,}  "
                    f"{row[0]:>14}  {idx[0]:>22,}  {vac}",
                    flush=True,
                )
                last = done >= args.messages * 0.9 and next_report >= 9 * tenth
                if args.explain and (done == 0 or last):
                    print("\n".join("    " + line for line in plan))
                window_start, window_done = time.perf_counter(), done
                next_report = done + tenth
            claimed = await _batch(conn, claim, mark, params, args)
            if claimed is None:
                break
            _DONE[0] += claimed
            done = _DONE[0]
        await asyncio.gather(*others)
        await conn.close()
        await stats_conn.close()
    finally:
        if not args.keep:
            async with await admin() as conn:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        else:
            print(f"kept database {name}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.churn", description=__doc__)
    parser.add_argument("--table", choices=("outbox", "inbox"), default="outbox")
    parser.add_argument("--messages", type=int, default=150_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="concurrent workers, each with its share of the keys (the outbox "
        "relay has 4, the inbox 3 dispatchers)",
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=0,
        help="ms between a batch's claim and its mark (the publish)",
    )
    parser.add_argument("--explain", action="store_true", help="print the first and last plan")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
