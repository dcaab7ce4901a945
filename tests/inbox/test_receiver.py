"""The inbox's receiver (broker → inbox table, acknowledged only once
committed) in this process, on the memory broker against the real PostgreSQL.

What each broker does on a lost connection is the contract suite's
(tests/brokers/test_contract.py); here the broker is irrelevant and the
memory broker injects the fault. `relay inbox` end to end, with its
receiver process, is tests/inbox/test_inbox.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from relay.brokers import Incoming
from relay.brokers.memory import MemoryBroker, MemoryConsumer
from relay.claimcheck.inbound import Inbound
from relay.db.writer import InboxWriter
from relay.receiving import Receiver
from tests.conftest import rows


class Open:
    """A gate that never holds the receiver back (no dispatchers here)."""

    async def wait(self, stopping: asyncio.Event) -> None:
        return

    def release(self) -> None:
        return


class Receiving:
    """A Receiver on a memory broker's queue "in" (bound to every topic);
    `reports` holds what it reported per stored batch: (received, new, dead,
    fetched, fetched bytes)."""

    def __init__(self, database: str) -> None:
        self.broker = MemoryBroker()
        self.broker.bind("in", "#")
        self.consumer = self.broker.consumer("in")
        self.writer = InboxWriter(database)
        self.reports: list[tuple[int, int, int, int, int]] = []
        self.receiver = Receiver(
            self.writer,
            self.consumer,
            Open(),
            lambda *report: self.reports.append(report),
            consumer_name="in",
            batch_size=10,
            stage=Inbound(None),
        )
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.receiver.run())

    async def received(self, count: int, timeout: float = 10) -> None:
        """Until `count` messages were received (stored or found stored)."""
        async with asyncio.timeout(timeout):
            while sum(r[0] for r in self.reports) < count:
                assert self.task is not None
                if self.task.done():
                    self.task.result()
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.receiver.stop()
        if self.task is not None:
            await asyncio.wait_for(self.task, 10)
        await self.consumer.close()
        await self.writer.close()


@pytest.fixture
async def receiving(database: str):
    helper = Receiving(database)
    yield helper
    await helper.stop()


def send(broker: MemoryBroker, count: int) -> None:
    for n in range(count):
        broker.send("orders", b'{"n": %d}' % n, message_id=f"m-{n}", type="T")


async def test_a_batch_lost_before_its_ack_comes_again_and_is_stored_once(
    engine, receiving, monkeypatch
):
    ack = MemoryConsumer.ack
    lost: list[int] = []

    async def ack_after_a_lost_connection(
        consumer: MemoryConsumer, batch: Sequence[Incoming]
    ) -> None:
        if not lost:  # the first ack: the connection breaks first, once
            lost.append(len(batch))
            receiving.broker.disconnect()
        await ack(consumer, batch)

    monkeypatch.setattr(MemoryConsumer, "ack", ack_after_a_lost_connection)
    send(receiving.broker, 5)
    receiving.start()
    # The batch was committed, then its ack failed (nothing reported): the
    # broker delivered it again, and the receiver found every row stored.
    await receiving.received(5)
    assert lost == [5]
    assert receiving.reports == [(5, 0, 0, 0, 0)]  # received, new, dead, fetched, bytes
    assert rows(engine, "SELECT count(*), count(DISTINCT message_id) FROM inbox") == [(5, 5)]
    assert not receiving.broker.queues["in"]  # nothing left to deliver


async def test_a_broker_down_at_start_is_waited_for_and_nothing_is_lost(engine, receiving):
    receiving.broker.go_down()
    send(receiving.broker, 3)
    receiving.start()
    await asyncio.sleep(0.7)  # the first retry (after 0.5 s) failed too
    assert receiving.reports == []
    receiving.broker.come_back()
    await receiving.received(3)
    assert rows(engine, "SELECT message_id FROM inbox ORDER BY message_id") == [
        ("m-0",),
        ("m-1",),
        ("m-2",),
    ]
