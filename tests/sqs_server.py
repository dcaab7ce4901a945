"""SQS for the tests: moto's standalone server on a free loopback port.

Started once per session as a subprocess and spoken to over HTTP, by boto3
in the tests and by the relay subprocesses, the way a real endpoint is:
`AWS_ENDPOINT_URL_SQS` points both at it. Each test creates its own queues
through `Sqs` and deletes them afterwards.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import orjson
import pytest

from tests.conftest import free_port
from tests.moto_main import MOTO_MAIN
from tests.waits import wait_while_progressing

MOTO_SERVER = Path(sys.executable).parent / "moto_server"
REGION = "us-east-1"


def sqs_env(endpoint: str) -> dict[str, str]:
    """What a relay (or boto3) needs to talk to the test server; no real credentials."""
    return {
        "AWS_ENDPOINT_URL_SQS": endpoint,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }


@pytest.fixture(scope="session")
def sqs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint URL of a moto server running for this session."""
    if not MOTO_SERVER.exists():
        pytest.skip(f"{MOTO_SERVER} not found: pip install 'moto[server]'")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [sys.executable, "-c", MOTO_MAIN, "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
                    return True
            except OSError:
                return False

        wait_while_progressing(
            answers, proc, quiet=30, what=f"moto_server answering on port {port}"
        )
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class Sqs:
    """A test's own SQS queues on the moto server, deleted afterwards."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.env = sqs_env(endpoint)
        self.client = boto3.session.Session().client(
            "sqs",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.prefix = f"relay-test-{uuid.uuid4().hex[:10]}"
        self.urls: dict[str, str] = {}

    def name(self, base: str, *, fifo: bool = False) -> str:
        """A queue name unique to this test."""
        return f"{self.prefix}-{base}" + (".fifo" if fifo else "")

    def create(self, name: str, **attributes: Any) -> str:
        attrs = {k: str(v) for k, v in attributes.items()}
        if name.endswith(".fifo"):
            attrs.setdefault("FifoQueue", "true")
        url = self.client.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]
        self.urls[name] = url
        return url

    def receive(
        self, name: str, *, wait: int = 1, visibility: int | None = None, delete: bool = True
    ) -> list[dict[str, Any]]:
        """One ReceiveMessage of up to 10 messages, deleted unless told otherwise."""
        params: dict[str, Any] = {
            "QueueUrl": self.urls[name],
            "MaxNumberOfMessages": 10,
            "WaitTimeSeconds": wait,
            "MessageAttributeNames": ["All"],
            "MessageSystemAttributeNames": ["All"],
        }
        if visibility is not None:
            params["VisibilityTimeout"] = visibility
        messages = self.client.receive_message(**params).get("Messages", [])
        if messages and delete:
            self.client.delete_message_batch(
                QueueUrl=self.urls[name],
                Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                    for i, m in enumerate(messages)
                ],
            )
        return messages

    def send(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """One message as relay's SQS outbox sends it: its fields as attributes."""
        attributes = {}
        for name, value in (
            ("message_id", message_id),
            ("type", type),
            ("key", key),
            ("headers", orjson.dumps(headers).decode() if headers else None),
        ):
            if value is not None:
                attributes[name] = {"DataType": "String", "StringValue": value}
        self.client.send_message(
            QueueUrl=self.urls[queue], MessageBody=body.decode(), MessageAttributes=attributes
        )

    def count(self, name: str) -> int:
        """Visible plus in-flight messages."""
        attrs = self.client.get_queue_attributes(
            QueueUrl=self.urls[name],
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return sum(int(v) for v in attrs.values())

    def cleanup(self) -> None:
        for url in self.urls.values():
            with contextlib.suppress(Exception):
                self.client.delete_queue(QueueUrl=url)
        self.client.close()


@pytest.fixture
def sqs(sqs_server: str) -> Iterator[Sqs]:
    helper = Sqs(sqs_server)
    yield helper
    helper.cleanup()


__all__ = ["Sqs", "sqs", "sqs_env", "sqs_server"]
