"""Chained block hashes (PAPER.md §2): a prompt is cut into blocks of `block_tokens`
tokens; block i's key is the hash of its tokens chained with block i-1's key, so equal keys
mean equal prefixes. Only whole blocks get keys (the partial tail is recomputed).

Keys are salted with a model id (two models never share a key) and a fixed seed, and use
BLAKE2b (stdlib, fast): `k0 = H(seed ‖ salt ‖ t0)`, `ki = H(k(i-1) ‖ ti)`, where `ti` is
the block's token ids as little-endian uint32.

A request's salt also names its cache namespace (`cache_salt`): by default its tenant's own,
so two tenants never share a cached block (a hit on another tenant's prefix would show in
the TTFT what that tenant asked), or a shared namespace the request (or its tenant, by
configuration) opts into.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16  # 128-bit keys, hex-encoded (32 characters)


DEFAULT_TENANT = "default"


def cache_namespace(tenant: str, shared: str | None) -> str:
    """The namespace a request's blocks are keyed in: the shared one it opted into, else its
    tenant's own. The two kinds never collide ("tenant:" / "shared:")."""
    return f"shared:{shared}" if shared else f"tenant:{tenant}"


DEFAULT_CACHE_NAMESPACE = cache_namespace(DEFAULT_TENANT, None)


def cache_salt(model_id: str, namespace: str) -> str:
    """The salt of `block_keys` for a model and a namespace (`cache_namespace`)."""
    return f"{model_id}\x1f{namespace}"


def _root(seed: int, salt: str) -> bytes:
    return hashlib.blake2b(
        struct.pack("<Q", seed & 0xFFFF_FFFF_FFFF_FFFF) + salt.encode(), digest_size=KEY_BYTES
    ).digest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def block_keys(tokens: Sequence[int], block_tokens: int, *, seed: int, salt: str) -> list[str]:
    """The chained keys of every whole block of `tokens` (hex strings)."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be positive")
    keys: list[str] = []
    prev = _root(seed, salt)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.blake2b(
            prev + _tokens_bytes(tokens[start : start + block_tokens]), digest_size=KEY_BYTES
        ).digest()
        keys.append(digest.hex())
        prev = digest
    return keys


def request_keys(
    tokens: Sequence[int],
    block_tokens: int,
    *,
    seed: int,
    model_id: str,
    namespace: str = DEFAULT_CACHE_NAMESPACE,
) -> list[str]:
    """A request's block keys: `block_keys` salted with its model and cache namespace (what
    the Conductor, the prefill worker and the reaper all key a prompt's blocks by)."""
    return block_keys(tokens, block_tokens, seed=seed, salt=cache_salt(model_id, namespace))


def common_prefix_blocks(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading blocks two key chains share (chaining makes this a prefix test)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
