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

from mooncake.bus.publish import retry_transient
from mooncake.namespace import Namespace

BUCKET = "MC_TERMINAL"  # canonical; namespaced like the streams
TTL_S = 24 * 3600.0
# How long a claim keeps trying through transient broker errors (a restart, a failover).
CLAIM_GIVE_UP_S = 30.0


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


async def claim(
    kv: KeyValue, request_id: str, kind: str, event_id: str, *, give_up_s: float = CLAIM_GIVE_UP_S
) -> bool:
    """True if this caller ends the request (first claim, or a retry of the same claim).

    A claim that meets a broker restart or a slow ack (timeout, no responders, a closed
    connection) is tried again with the same value, like every publish (`bus.publish`): if
    the first try did land, the retry finds its own value and still wins. Without this a
    decode that finished while the broker restarted threw its work away and did it again."""
    value = f"{kind}:{event_id}".encode()
    return await retry_transient(lambda: _claim_once(kv, _key(request_id), value), give_up_s)


async def _claim_once(kv: KeyValue, key: str, value: bytes) -> bool:
    try:
        await kv.create(key, value)
        return True
    except KeyWrongLastSequenceError:
        entry = await kv.get(key)
        return entry.value == value


async def ended(kv: KeyValue, request_id: str, *, redo: str | None = None) -> str | None:
    """How the request ended ("completed", "failed", "cancelled"), None while it runs.

    `redo`: the id of the terminal event the caller would publish. A claim with that id is
    reported as not ended: whoever made it (the same stage, on an instance killed between the
    claim and the publish) may not have published, and only doing the work again publishes it
    (the same claim wins again; the event is deduplicated by its id if it did go out)."""
    try:
        entry = await kv.get(_key(request_id))
    except KeyNotFoundError:
        return None
    if entry.value is None:
        return None
    kind, _, event_id = entry.value.decode().partition(":")
    return None if redo is not None and event_id == redo else kind
