"""The claim check's S3 store: large bodies kept as objects, fetched as received.

- ObjectStore: boto3's S3 client, its calls in a thread pool of its own
  (boto3 is synchronous, as in the SQS adapter), and what each failure
  means: S3Unavailable (the endpoint, the credentials or the service: like
  a broker that is away, no attempt counted) or S3Refused (this object:
  a missing bucket or key, no permission; the row's fault or the setup's).
  The publisher's wrapper (relay.claimcheck.publisher) stores through it.
- ClaimCheckReader: the receiver's (relay.claimcheck.inbound); a received
  pointer becomes the object's bytes, or why S3 refused it.

relay never deletes an object: another consumer of the message may still
need it. An S3 lifecycle rule on the prefix expires them (docs/claim-check.md).

Memory: bodies are built, sent and dropped one upload at a time per slot
(UPLOADS, DOWNLOADS), so a batch of large rows holds at most that many
bodies beside the rows themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bce
from botocore.config import Config

from relay.config import ClaimCheckURL, redact_url
from relay.errors import BrokerUnavailable, ConfigError

T = TypeVar("T")

# Uploads (outbox) and downloads (inbox) in flight at once, per daemon.
UPLOADS = 4
DOWNLOADS = 4
CONNECT_TIMEOUT = 5
READ_TIMEOUT = 60

_TRANSPORT_ERRORS = (bce.ConnectionError, bce.HTTPClientError)
_CREDENTIAL_ERRORS = (
    bce.NoCredentialsError,
    bce.PartialCredentialsError,
    bce.CredentialRetrievalError,
)
_AUTH_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "TokenRefreshRequired",
    "InvalidToken",
    "RequestTimeTooSkewed",
}


class S3Unavailable(BrokerUnavailable):
    """S3 cannot be reached or will not talk to relay now: retried, no attempt counted."""


class S3Refused(Exception):
    """S3 answered and refused this object (missing bucket or key, no permission)."""


def _code(exc: bce.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "")


def _status(exc: bce.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _explain(exc: BaseException, endpoint: str) -> Exception:
    """S3Unavailable or S3Refused for what boto3 raised; other errors as they are."""
    if isinstance(exc, _TRANSPORT_ERRORS):
        return S3Unavailable(f"S3 at {endpoint}: {type(exc).__name__}: {exc}")
    if isinstance(exc, _CREDENTIAL_ERRORS):
        return S3Unavailable(f"S3 at {endpoint}: no usable AWS credentials ({exc})")
    if isinstance(exc, bce.ClientError):
        code, status = _code(exc), _status(exc)
        message = exc.response.get("Error", {}).get("Message") or ""
        text = f"{code or status}: {message}".rstrip(": ")
        if status >= 500 or status in (0, 429) or code in _AUTH_CODES or code == "SlowDown":
            return S3Unavailable(f"S3 at {endpoint}: {text}")
        return S3Refused(text)
    if isinstance(exc, bce.BotoCoreError):
        return S3Refused(f"{type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))


class ObjectStore:
    """S3 through boto3, every call in a thread of this store's pool."""

    def __init__(self, url: ClaimCheckURL, pool: int = UPLOADS) -> None:
        self.url = url
        self._pool = pool
        self._client: Any = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def endpoint(self) -> str:
        if self._client is None:
            return "S3"
        return f"{redact_url(self._client.meta.endpoint_url)} ({self._client.meta.region_name})"

    def _make_client(self) -> Any:
        config = Config(
            retries={"mode": "standard", "max_attempts": 3},
            max_pool_connections=self._pool + 2,
            connect_timeout=CONNECT_TIMEOUT,
            read_timeout=READ_TIMEOUT,
            user_agent_extra="relay",
            # An endpoint given in the URL (MinIO, LocalStack, moto) seldom
            # resolves bucket host names: ask for buckets in the path.
            s3={"addressing_style": "path"} if self.url.endpoint_url else None,
        )
        try:
            return boto3.session.Session().client(
                "s3", region_name=self.url.region, endpoint_url=self.url.endpoint_url, config=config
            )
        except bce.NoRegionError:
            raise ConfigError(
                "no AWS region for the claim check's S3: set AWS_DEFAULT_REGION "
                "or use s3://BUCKET?region=..."
            ) from None
        except ValueError as exc:
            raise ConfigError(f"invalid S3 endpoint or region for --claim-check: {exc}") from None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._pool, thread_name_prefix="relay-s3")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    def _client_now(self) -> Any:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _run(self, fn: Callable[[Any], T]) -> T:
        """fn(client) in the calling (pool) thread, boto3's errors explained."""
        client = self._client_now()
        try:
            return fn(client)
        except (bce.BotoCoreError, bce.ClientError) as exc:
            raise _explain(exc, self.endpoint) from exc

    async def probe(self) -> None:
        """S3Unavailable unless S3 answers (any answer from the bucket will do:
        a publisher allowed only PutObject is refused HeadBucket, and a
        missing bucket is the rows' failure, counted on each of them)."""

        def head(client: Any) -> None:
            try:
                client.head_bucket(Bucket=self.url.bucket)
            except bce.ClientError as exc:
                if isinstance(_explain(exc, self.endpoint), S3Unavailable):
                    raise

        await self._call(self._run, head)

    async def put_body(self, key: str, body: Callable[[], bytes | None]) -> int | None:
        """Store `body()` (built in the pool's thread, so that a large body
        never sits on the event loop) as the object `key`; its size, or
        None when body() returned None (nothing to store)."""

        def put(client: Any) -> int | None:
            data = body()
            if data is None:
                return None
            client.put_object(
                Bucket=self.url.bucket, Key=key, Body=data, ContentType="application/json"
            )
            return len(data)

        return await self._call(self._run, put)

    async def get(self, bucket: str, key: str) -> bytes:
        def get(client: Any) -> bytes:
            response = client.get_object(Bucket=bucket, Key=key)
            data: bytes = response["Body"].read()
            return data

        return await self._call(self._run, get)

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------
# Inbox: a received pointer becomes the object's bytes
# --------------------------------------------------------------------------


class ClaimCheckReader:
    """Fetches the objects of received pointers for the receiver
    (relay.claimcheck.resolve finds them and says what became of each)."""

    def __init__(self, url: ClaimCheckURL) -> None:
        self.url = url
        self.store = ObjectStore(url, DOWNLOADS)
        self._slots = asyncio.Semaphore(DOWNLOADS)

    async def fetch(self, bucket: str, key: str) -> bytes | str:
        """The object's bytes, or why S3 refused it; S3Unavailable while S3
        cannot be reached (the receiver holds the batch and tries again)."""
        async with self._slots:
            try:
                return await self.store.get(bucket, key)
            except S3Refused as exc:
                return str(exc)

    async def close(self) -> None:
        await self.store.close()


async def fetch_object(store: ObjectStore | None, bucket: str, key: str) -> bytes | str:
    """The object's bytes, or why it cannot be read (for `relay retry`).

    With no store (no --claim-check given), from the bucket the pointer
    names through boto3's own settings (AWS_DEFAULT_REGION,
    AWS_ENDPOINT_URL_S3, the credentials chain), as the contract has it:
    the pointer says where the object is, as it does for the receiver."""
    if store is None:
        own = ObjectStore(ClaimCheckURL(f"s3://{bucket}", bucket), pool=1)
        try:
            return await fetch_object(own, bucket, key)
        finally:
            await own.close()
    try:
        return await store.get(bucket, key)
    except (S3Refused, S3Unavailable, ConfigError) as exc:
        return str(exc)


__all__ = [
    "ClaimCheckReader",
    "ObjectStore",
    "S3Refused",
    "S3Unavailable",
    "fetch_object",
]
