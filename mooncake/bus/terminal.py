"""Exactly one terminal event per request: a compare-and-set claim in a JetStream KV bucket.

Whoever ends a request (a decode worker completing it, a worker failing it, the Conductor
cancelling it, a stage hitting its deadline) first claims the request's terminal slot with
`create` (atomic: it fails if the key exists). Only the winner publishes its terminal event;
the claim value is the event id it will publish, so a redelivered handler that claimed and
crashed before publishing wins again and publishes the same (deduplicated) event. Workers
also look the slot up before starting work, which is how a cancellation reaches queued work.
"""

from __future__ import annotations

import hashlib

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from mooncake.namespace import Namespace

BUCKET = "MC_TERMINAL"  # canonical; namespaced like the streams
TTL_S = 24 * 3600.0


def _key(request_id: str) -> str:
    return hashlib.sha256(request_id.encode()).hexdigest()[:48]


async def open_bucket(js: JetStreamContext, ns: Namespace, replicas: int = 1) -> KeyValue:
    name = ns.stream(BUCKET)
    try:
        return await js.key_value(name)
    except Exception:
        config = KeyValueConfig(
            bucket=name, history=1, ttl=TTL_S, storage=StorageType.FILE, replicas=replicas
        )
        return await js.create_key_value(config)


async def claim(kv: KeyValue, request_id: str, kind: str, event_id: str) -> bool:
    """True if this caller ends the request (first claim, or a retry of the same claim)."""
    value = f"{kind}:{event_id}".encode()
    try:
        await kv.create(_key(request_id), value)
        return True
    except KeyWrongLastSequenceError:
        entry = await kv.get(_key(request_id))
        return entry.value == value


async def ended(kv: KeyValue, request_id: str) -> str | None:
    """How the request ended ("completed", "failed", "cancelled"), None while it runs."""
    try:
        entry = await kv.get(_key(request_id))
    except KeyNotFoundError:
        return None
    return None if entry.value is None else entry.value.decode().split(":", 1)[0]
