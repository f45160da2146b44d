"""Chained block hashes: equal keys exactly when equal prefixes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncake.hashing import block_keys, cache_namespace, cache_salt, common_prefix_blocks

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=64)


@given(tokens, tokens, st.integers(min_value=1, max_value=8))
def test_shared_keys_iff_shared_prefix(a: list[int], b: list[int], bt: int) -> None:
    ka = block_keys(a, bt, seed=1, salt="m")
    kb = block_keys(b, bt, seed=1, salt="m")
    shared = common_prefix_blocks(ka, kb)
    same_tokens = 0
    while same_tokens < min(len(ka), len(kb)):
        lo, hi = same_tokens * bt, (same_tokens + 1) * bt
        if a[lo:hi] != b[lo:hi]:
            break
        same_tokens += 1
    assert shared == same_tokens
    # Chaining: a key that matches at position i matches at every position before it.
    for i, (x, y) in enumerate(zip(ka, kb, strict=False)):
        if x == y:
            assert ka[:i] == kb[:i]


def test_only_whole_blocks_and_salts_separate_models() -> None:
    t = list(range(10))
    assert len(block_keys(t, 4, seed=0, salt="m")) == 2
    assert block_keys(t, 4, seed=0, salt="m") != block_keys(t, 4, seed=0, salt="other")
    assert block_keys(t, 4, seed=0, salt="m") != block_keys(t, 4, seed=1, salt="m")
    assert block_keys(t, 4, seed=0, salt="m") == block_keys(t, 4, seed=0, salt="m")
    assert all(len(k) == 32 for k in block_keys(t, 4, seed=0, salt="m"))


name = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)


@given(name, name, st.booleans(), st.booleans())
def test_namespaces_share_keys_only_when_they_are_the_same(
    x: str, y: str, x_shared: bool, y_shared: bool
) -> None:
    """Tenants never share a key with each other or with a shared namespace of any name;
    the same tenant (or the same shared namespace) always does."""
    nx = cache_namespace(x, x if x_shared else None)
    ny = cache_namespace(y, y if y_shared else None)
    t = list(range(8))
    kx = block_keys(t, 4, seed=0, salt=cache_salt("m", nx))
    ky = block_keys(t, 4, seed=0, salt=cache_salt("m", ny))
    same = (x == y) and (x_shared == y_shared)
    assert (kx == ky) == same
    assert not set(kx) & set(ky) or same
    # ... and another model never shares a namespace's keys.
    assert block_keys(t, 4, seed=0, salt=cache_salt("m2", nx)) != kx
