"""Mooncake request traces (../shared/traces): loading, and hash id -> deterministic tokens.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
[...]}`; hash id i covers prompt tokens [512·i, 512·(i+1)) and ids are prefix-chained (a
shared id means a shared prefix). To drive a real model, each block's tokens are derived
from its hash id alone, so equal ids give equal tokens and the prefix structure survives.
Blocks may be scaled down (`tokens_per_block` < 512) to fit a CPU: the prefix structure is
kept, only the lengths shrink.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

TRACE_BLOCK_TOKENS = 512
# The first 200 requests of the conversation trace, shipped in the package (data/README.md).
SHIPPED_CONVERSATION = Path(__file__).parent / "data" / "conversation_head.jsonl"


class TraceError(ValueError):
    """A trace file that cannot be read, with the line that broke it."""


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    timestamp: int = Field(ge=0)
    input_length: int = Field(ge=1)
    output_length: int = Field(ge=0)
    hash_ids: list[int] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def iter_trace(path: Path | str, *, limit: int | None = None) -> Iterator[TraceRequest]:
    """Validated requests in file order; a bad line raises TraceError naming it."""
    with open(path, encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if limit is not None and lineno > limit:
                return
            if not raw.strip():
                continue
            try:
                line = _Line.model_validate_json(raw)
            except ValidationError as exc:
                raise TraceError(f"{path}:{lineno}: {exc.errors()[0]['msg']}") from exc
            if len(line.hash_ids) != math.ceil(line.input_length / TRACE_BLOCK_TOKENS):
                raise TraceError(
                    f"{path}:{lineno}: {len(line.hash_ids)} hash ids for "
                    f"{line.input_length} tokens (expected one per {TRACE_BLOCK_TOKENS})"
                )
            yield TraceRequest(
                lineno - 1,
                line.timestamp / 1000.0,
                line.input_length,
                line.output_length,
                tuple(line.hash_ids),
            )


def load_trace(path: Path | str, *, limit: int | None = None) -> list[TraceRequest]:
    return list(iter_trace(path, limit=limit))


def block_tokens(hash_id: int, tokens_per_block: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """The tokens of one block, a pure function of (seed, hash id)."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, hash_id])
    return rng.integers(0, vocab_size, size=tokens_per_block, dtype=np.int64)


def request_tokens(
    req: TraceRequest,
    *,
    vocab_size: int,
    tokens_per_block: int = TRACE_BLOCK_TOKENS,
    seed: int = 0,
) -> list[int]:
    """The request's prompt: its blocks' tokens, the last one cut to the (scaled) length."""
    length = math.ceil(req.input_length * tokens_per_block / TRACE_BLOCK_TOKENS)
    blocks = [block_tokens(h, tokens_per_block, vocab_size, seed) for h in req.hash_ids]
    return [int(t) for t in np.concatenate(blocks)[:length]]


def reuse_ratio(
    requests: list[TraceRequest],
    capacity_blocks: int | None = None,
    *,
    partial_blocks: bool = False,
) -> float:
    """Share of input tokens that are a cached prefix under one global LRU pool of
    `capacity_blocks` blocks (None: unbounded). Only whole blocks are reused (the paper's
    rule) unless `partial_blocks`, which also counts a hit on the trailing partial block
    (how the traces' README measured it)."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    reused = total = 0
    for r in requests:
        total += r.input_length
        hit = 0
        for h in r.hash_ids:
            if h not in cache:
                break
            hit += 1
        if partial_blocks:
            reused += min(hit * TRACE_BLOCK_TOKENS, r.input_length)
        else:
            reused += min(hit, r.input_length // TRACE_BLOCK_TOKENS) * TRACE_BLOCK_TOKENS
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return reused / total if total else 0.0


def dump_line(req: TraceRequest) -> str:
    return json.dumps(
        {
            "timestamp": round(req.arrival_s * 1000),
            "input_length": req.input_length,
            "output_length": req.output_length,
            "hash_ids": list(req.hash_ids),
        }
    )
