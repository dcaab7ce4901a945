"""The claim check on retry: a dead inbox row kept as a pointer gets its object's bytes.

relay.db.store's retry asks a `Restore` for each pointer-shaped inbox row
it is about to retry (the inbox_claim_checks query finds them); the
commands (relay retry, relay.dead, the console) build it here, with the
S3 store of --claim-check or without one: then each object is read from
the bucket its pointer names with boto3's own settings (the environment's
region, endpoint and credentials; relay.claimcheck.s3.fetch_object), and a
row whose object cannot be read stays dead saying why.
"""

from __future__ import annotations

from typing import Any

import orjson

from relay.claimcheck import read_pointer, where, without_size
from relay.claimcheck.inbound import Fetch
from relay.storable import json_body


def fetch_from(objects: Any) -> Fetch:
    """The Fetch of `relay retry` over a relay.claimcheck.s3.ObjectStore, or
    over None (no --claim-check given: the pointer's bucket with boto3's
    own settings)."""

    async def fetch(bucket: str, key: str) -> bytes | str:
        from relay.claimcheck.s3 import fetch_object  # boto3, only once a pointer row is found

        return await fetch_object(objects, bucket, key)

    return fetch


class Restore:
    """What relay.db.store's retry calls for a row that looks like a pointer:
    None (relay does not read it as one: leave it), (payload, headers) as
    JSON texts (the object's body, the headers less the size), or why the
    object could not be read (the row stays dead with that in last_error)."""

    def __init__(self, fetch: Fetch | None) -> None:
        self.fetch = fetch

    async def __call__(self, payload: str | None, headers: str) -> tuple[str, str] | str | None:
        pointer = read_pointer(payload)
        if pointer is None:  # pointer-shaped in SQL, not by relay's reading: leave it
            return None
        data: bytes | str = (
            await self.fetch(*pointer)
            if self.fetch is not None
            else "no --claim-check is configured"
        )
        problem = data if isinstance(data, str) else None
        if isinstance(data, bytes):
            text, problem = json_body(data)
            if text is not None:
                return text, orjson.dumps(without_size(orjson.loads(headers))).decode()
        return (
            f"not retried: the message is a claim check pointer to {where(*pointer)}, "
            f"whose object could not be read: {problem}"
        )


__all__ = ["Restore", "fetch_from"]
