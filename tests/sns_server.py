"""SNS for the tests: the same moto server as SQS (tests/sqs_server.py),
which delivers a topic's messages to the SQS queues subscribed to it, with
raw message delivery or in SNS's notification envelope.

`Sns` makes a test's own topics and subscribed queues and deletes them
afterwards; `env` points relay's SNS, SQS and STS clients at the server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from tests.sqs_server import REGION, Sqs, sqs, sqs_env, sqs_server  # noqa: F401 - fixtures


class Sns:
    """A test's own SNS topics and the SQS queues subscribed to them."""

    def __init__(self, sqs: Sqs) -> None:  # noqa: F811 - the fixture's type
        self.sqs = sqs
        self.endpoint = sqs.endpoint
        self.env = {
            **sqs_env(sqs.endpoint),
            "AWS_ENDPOINT_URL_SNS": sqs.endpoint,
            "AWS_ENDPOINT_URL_STS": sqs.endpoint,
        }
        self.client = boto3.session.Session().client(
            "sns",
            endpoint_url=sqs.endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.arns: dict[str, str] = {}

    def name(self, base: str, *, fifo: bool = False) -> str:
        """A topic (or queue) name unique to this test."""
        return self.sqs.name(base, fifo=fifo)

    def topic(self, name: str) -> str:
        """Create the topic `name` (FIFO when it ends in .fifo); its ARN."""
        attributes = {"FifoTopic": "true"} if name.endswith(".fifo") else {}
        arn = self.client.create_topic(Name=name, Attributes=attributes)["TopicArn"]
        self.arns[name] = arn
        return str(arn)

    def subscribe(self, topic: str, queue: str, *, raw: bool) -> str:
        """Create the queue `queue` and subscribe it to `topic`, with raw
        message delivery or not; the queue's name."""
        url = self.sqs.create(queue)
        queue_arn = self.sqs.client.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])[
            "Attributes"
        ]["QueueArn"]
        self.client.subscribe(
            TopicArn=self.arns[topic],
            Protocol="sqs",
            Endpoint=queue_arn,
            Attributes={"RawMessageDelivery": "true" if raw else "false"},
        )
        return queue

    def publish(
        self,
        topic: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: str | None = None,
    ) -> None:
        """One message as relay's SNS outbox sends it: its fields as attributes."""
        attributes: dict[str, Any] = {}
        for name, value in (
            ("message_id", message_id),
            ("type", type),
            ("key", key),
            ("headers", headers),
        ):
            if value is not None:
                attributes[name] = {"DataType": "String", "StringValue": value}
        self.client.publish(
            TopicArn=self.arns[topic], Message=body.decode(), MessageAttributes=attributes
        )

    def exists(self, name: str) -> bool:
        listed = self.client.list_topics().get("Topics", [])
        return any(t["TopicArn"].rpartition(":")[2] == name for t in listed)

    def cleanup(self) -> None:
        for arn in self.arns.values():
            with contextlib.suppress(Exception):
                self.client.delete_topic(TopicArn=arn)
        self.client.close()


@pytest.fixture
def sns(sqs: Sqs) -> Iterator[Sns]:  # noqa: F811 - the fixture
    helper = Sns(sqs)
    yield helper
    helper.cleanup()


__all__ = ["Sns", "sns", "sqs", "sqs_server"]
