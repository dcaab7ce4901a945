"""What the outbox's mark costs PostgreSQL, by the table's fillfactor (issue 52).

The mark (`outbox_mark_published`: status, published_at and last_error of a
batch's rows, by id) is most of what a published row costs PostgreSQL once
the claim is gone (docs/wal-capture.md, "The mark"). It is never a HOT
update (`status` is in the partial indexes' predicates), but a page with
room keeps the new row version beside the old one: one page dirtied
instead of two. This measures that, on a cluster of its own with the
server's defaults (bench.pgserver): for each fillfactor, ROWS rows are
committed in transactions of 1,000 over 100 keys, a checkpoint is taken,
then they are marked in batches of BATCH by id on one backend, whose CPU
(utime + stime) and wall time are taken, with the WAL written, the heap
and index blocks the marks
touched, the HOT updates (none expected) and the table's size. Rounds
interleave the fillfactors.

    python -m bench.mark [--rows 100000] [--batch 2000] [--rounds 3] [--fillfactors 100,90,70]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.cpu import cpu_seconds
from bench.pgserver import own_postgres
from bench.wal import make_database
from relay.db.sql import query

MARK = query("outbox_mark_published").replace(":ids", "%(ids)s")
INSERT = (
    "INSERT INTO outbox (topic, key, type, payload) "
    "SELECT 'bench', 'k' || (g %% 100), 'Bench', "
    "jsonb_build_object('n', g, 'text', repeat('x', 200)) "
    "FROM generate_series(CAST(%(start)s AS int), CAST(%(end)s AS int)) g"
)
STATS = (
    "SELECT s.n_tup_hot_upd, pg_total_relation_size('outbox'), pg_relation_size('outbox'), "
    "io.heap_blks_read + io.heap_blks_hit, io.idx_blks_read + io.idx_blks_hit "
    "FROM pg_stat_user_tables s JOIN pg_statio_user_tables io USING (relid) "
    "WHERE s.relname = 'outbox'"
)


async def row(conn: psycopg.AsyncConnection[Any], sql: str, params: Any = None) -> Any:
    found = await (await conn.execute(sql, params)).fetchone()
    assert found is not None
    return found


async def one(url: str, fillfactor: int, rows: int, batch: int) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("TRUNCATE outbox")
        await conn.execute(f"ALTER TABLE outbox SET (fillfactor = {int(fillfactor)})")
        for start in range(1, rows + 1, 1000):
            await conn.execute(INSERT, {"start": start, "end": min(start + 999, rows)})
        await conn.execute("VACUUM ANALYZE outbox")
        await conn.execute("CHECKPOINT")
        ids = [
            r[0]
            for r in await (await conn.execute("SELECT id FROM outbox ORDER BY seq")).fetchall()
        ]
        await conn.execute("SELECT pg_stat_force_next_flush()")
        before = await row(conn, STATS)
        pid, lsn = await row(conn, "SELECT pg_backend_pid(), pg_current_wal_lsn()")
        cpu, wall = cpu_seconds(pid), time.perf_counter()
        for at in range(0, len(ids), batch):
            await conn.execute(MARK, {"ids": ids[at : at + batch]})
        cpu, wall = cpu_seconds(pid) - cpu, time.perf_counter() - wall
        [wal] = await row(conn, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [lsn])
        await conn.execute("SELECT pg_stat_force_next_flush()")
        after = await row(conn, STATS)
    return {
        "fillfactor": fillfactor,
        "rows": rows,
        "batch": batch,
        "backend_cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "wal_mb": round(float(wal) / 1e6, 1),
        "hot_updates": after[0] - before[0],
        "heap_blocks": int(after[3] - before[3]),
        "index_blocks": int(after[4] - before[4]),
        "table_mb_before": round(before[2] / 1e6, 1),
        "table_mb_after": round(after[2] / 1e6, 1),
        "total_mb_after": round(after[1] / 1e6, 1),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    async with own_postgres() as server:
        url = await make_database(server.url)
        for round_ in range(1, args.rounds + 1):
            for fillfactor in args.fillfactors:
                result = await one(url, fillfactor, args.rows, args.batch)
                result["round"] = round_
                print(json.dumps(result), flush=True)
                results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--fillfactors", type=lambda s: [int(x) for x in s.split(",")], default=[100, 90, 70]
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
