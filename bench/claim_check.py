"""Issue 34: the claim check (large messages through S3) against plain boto3, one moto server.

```sh
.venv/bin/python -m bench.claim_check                      # 100 x 1 MiB, 24 x 10 MiB
.venv/bin/python -m bench.claim_check --mib1 20 --mib10 8  # smoke size
```

- drain: `relay outbox --once --claim-check` over N rows of 1 MiB on an
  SQS queue, beside, in the same run and on the same moto server, the
  plain boto3 loop a user would write: put_object, then send_message with
  the pointer, one message after the other; and the same loop in as many
  threads as relay uploads at once (relay.claimcheck.s3.UPLOADS). relay runs at the
  default --batch-size and at 20; the rounds alternate, medians reported.
- memory: the peak RSS (VmHWM, the daemon and its receiver process) of
  `relay outbox --once` over M rows of 10 MiB, at the default
  --batch-size and at --batch-size 4, then of `relay inbox` (same batch
  size) taking the M pointers (bodies fetched from S3, stored, handled);
  beside each, the same daemon over M small rows (the base).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from bench.common import BenchError, Resources, connect, free_port, relay_env, scalar
from bench.harness import create_effects, wait_metric
from bench.reference import AWS, sqs_client, start_moto

MiB = 1024 * 1024
BATCH_20 = ("--batch-size", "20")  # four workers' batches overlap: S3 while PostgreSQL reads


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


async def fill(url: str, topic: str, count: int, size: int) -> None:
    """`count` pending rows of type Bench whose payload is about `size` bytes."""
    async with await connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO outbox (topic, type, payload) SELECT %s, 'Bench', "
            "jsonb_build_object('i', i::text, 'blob', repeat('x', %s)) "
            "FROM generate_series(1, %s) AS i",
            (topic, size, count),
        )


def plain_loop(endpoint: str, queue_url: str, bucket: str, bodies: int, threads: int) -> float:
    """put_object then send_message (the pointer), per message; seconds for all."""
    s3, sqs = s3_client(endpoint), sqs_client(endpoint, threads + 2)
    body = orjson.dumps({"i": "1", "blob": "x" * MiB})

    def one(n: int) -> None:
        key = f"plain/{uuid.uuid4()}"
        s3.put_object(Bucket=bucket, Key=key, Body=body)
        sqs.send_message(
            QueueUrl=queue_url,
            MessageBody=orjson.dumps(
                [
                    "software.amazon.payloadoffloading.PayloadS3Pointer",
                    {"s3BucketName": bucket, "s3Key": key},
                ]
            ).decode(),
            MessageAttributes={
                "ExtendedPayloadSize": {"DataType": "Number", "StringValue": str(len(body))}
            },
        )

    started = time.perf_counter()
    if threads == 1:
        for n in range(bodies):
            one(n)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(bodies)))
    return time.perf_counter() - started


async def outbox_once(
    res: Resources, url: str, broker: str, claim: str, env: dict[str, str], *extra: str
) -> tuple[float, float]:
    """Run `relay outbox --once`; (seconds from 'started' to exit, peak RSS MB)."""
    proc = res.relay(
        "outbox",
        "outbox",
        "--once",
        "--database-url",
        url,
        "--broker-url",
        broker,
        "--claim-check",
        claim,
        *extra,
        env=env,
    )
    ready = await proc.wait_log("outbox relay started", timeout=60)
    code = await proc.wait_exit(timeout=600)
    ended = time.monotonic()
    proc.rss.sample()
    if code != 0:
        raise BenchError(f"relay outbox --once exited {code}:\n{proc.tail()}")
    left = await scalar(url, "SELECT count(*) FROM outbox WHERE status <> 'published'")
    if left:
        raise BenchError(f"relay outbox --once left {left} rows unpublished:\n{proc.tail()}")
    return ended - ready, proc.rss.hwm_kb / 1024


async def inbox_drain(
    res: Resources,
    url: str,
    broker: str,
    queue: str,
    claim: str,
    env: dict[str, str],
    count: int,
    *extra: str,
) -> tuple[float, float, list[float]]:
    """`relay inbox --claim-check` until `count` rows are processed; (seconds,
    peak RSS MB, each process's peak: the daemon's, the receiver's)."""
    port = free_port()
    flags = {"--queue": queue, "--handlers": "bench.handlers", "--http-port": str(port)}
    flags |= {"--database-url": url, "--broker-url": broker, "--claim-check": claim}
    argv = [part for flag in flags.items() for part in flag]
    proc = res.relay("inbox", "inbox", *argv, *extra, env=env)
    ready = await proc.wait_log("inbox started", timeout=60)
    done = await wait_metric(proc, port, "relay_inbox_processed_total", count, timeout=600)
    proc.rss.sample()
    peak = proc.rss.hwm_kb / 1024
    each = [round(kb / 1024, 1) for kb in proc.rss.hwm_by_pid.values()]
    await proc.stop()
    return done - ready, peak, each


async def run(args: argparse.Namespace) -> dict[str, Any]:
    res = Resources("claimcheck")
    results: dict[str, Any] = {"mib1": args.mib1, "mib10": args.mib10}
    try:
        endpoint = await start_moto(res)
        s3 = s3_client(endpoint)
        sqs = sqs_client(endpoint, 8)
        bucket = f"bench-cc-{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(s3.create_bucket, Bucket=bucket)
        claim = f"s3://{bucket}/relay?endpoint_url={endpoint}"
        broker = f"sqs://?region=us-east-1&endpoint_url={endpoint}"
        env = relay_env(**AWS, AWS_ENDPOINT_URL_SQS=endpoint)

        def queue(tag: str) -> tuple[str, str]:
            name = f"bench-cc-{tag}-{uuid.uuid4().hex[:8]}"
            return name, sqs.create_queue(QueueName=name)["QueueUrl"]

        # -- drain rate, 1 MiB --------------------------------------------------
        from relay.claimcheck.s3 import UPLOADS

        _, plain_url = await asyncio.to_thread(queue, "plain")
        rates: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # alternated: a busy machine's drift hits both
            for threads in (1, UPLOADS):
                seconds = await asyncio.to_thread(
                    plain_loop, endpoint, plain_url, bucket, args.mib1, threads
                )
                rates.setdefault(f"plain_{threads}_thread", []).append(args.mib1 / seconds)
            for label, extra in (("relay_outbox", ()), ("relay_outbox_batch_20", BATCH_20)):
                name, _ = await asyncio.to_thread(queue, "relay")
                url = await res.database("cc1")
                await fill(url, name, args.mib1, MiB)
                seconds, peak = await outbox_once(res, url, broker, claim, env, *extra)
                rates.setdefault(label, []).append(args.mib1 / seconds)
                results[f"{label}_1mib_peak_rss_mb"] = round(peak, 1)
                await res.drop_database(url)
        for label, values in rates.items():
            results[f"{label}_msgs_s"] = [round(v, 1) for v in values]
            results[f"{label}_median_msgs_s"] = round(statistics.median(values), 1)
        for relay_label in ("relay_outbox", "relay_outbox_batch_20"):
            for threads in (1, UPLOADS):
                results[f"{relay_label}_vs_plain_{threads}_thread"] = round(
                    results[f"{relay_label}_median_msgs_s"]
                    / results[f"plain_{threads}_thread_median_msgs_s"],
                    2,
                )

        # -- memory, 10 MiB ------------------------------------------------------
        for label, size, extra in (
            ("small_base", 100, ()),
            ("10mib_default_batch", 10 * MiB, ()),
            ("10mib_batch_4", 10 * MiB, ("--batch-size", "4")),
        ):
            name, _ = await asyncio.to_thread(queue, label.replace("_", "-"))
            url = await res.database("cc10")
            await create_effects(url)
            await fill(url, name, args.mib10, size)
            seconds, peak = await outbox_once(res, url, broker, claim, env, *extra)
            results[f"outbox_{label}_peak_rss_mb"] = round(peak, 1)
            results[f"outbox_{label}_seconds"] = round(seconds, 2)
            seconds, peak, each = await inbox_drain(
                res, url, broker, name, claim, env, args.mib10, *extra
            )
            results[f"inbox_{label}_peak_rss_mb"] = round(peak, 1)
            results[f"inbox_{label}_process_peaks_mb"] = each
            results[f"inbox_{label}_seconds"] = round(seconds, 2)
            await res.drop_database(url)
        return results
    finally:
        problems = await res.close()
        if problems:
            print("cleanup:", problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib1", type=int, default=100, help="1 MiB messages for the drain")
    parser.add_argument("--mib10", type=int, default=24, help="10 MiB messages for the memory run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the drain comparison")
    results = asyncio.run(run(parser.parse_args()))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
