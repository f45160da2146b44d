"""Fitting a trace's prompts to the model's context (`mooncake replay`, `bench memory`).

The Mooncake traces were recorded on a long-context model: the conversation trace's prompts
are 10k tokens at the median and reach 120k, while SmolLM2 reads 8,192. A request whose
prompt plus its output (`max_tokens`) does not fit the context would only fail in prefill,
so before it is sent it is changed by one of three modes:

- `scale` (the default): its block count and its length shrink by the same factor, the one
  that makes prompt + max_tokens fit: the leading hash ids are kept (so the prefixes the trace
  shares stay shared) and the last block keeps its share of a full block.
- `truncate`: the prompt is cut to exactly what fits (context - max_tokens tokens).
- `skip`: the request is left out.

Lengths here are the trace's (512 tokens a block); a replay that scales blocks down to
`tokens_per_block` tokens fits the scaled prompt, which is what the model reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports FitMode at start, numpy (mooncake.trace) only when used
    from mooncake.trace import TraceRequest


class FitMode(StrEnum):
    SCALE = "scale"
    TRUNCATE = "truncate"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Fitted:
    requests: list[TraceRequest]
    mode: FitMode
    context_tokens: int
    changed: int  # scaled or truncated
    skipped: int

    def summary(self) -> dict[str, object]:
        return {
            "mode": self.mode.value,
            "context_tokens": self.context_tokens,
            "changed": self.changed,
            "skipped": self.skipped,
        }


def prompt_tokens(input_length: int, tokens_per_block: int) -> int:
    """The prompt the model reads for a trace input length (blocks scaled down)."""
    from mooncake.trace import TRACE_BLOCK_TOKENS

    return math.ceil(input_length * tokens_per_block / TRACE_BLOCK_TOKENS)


def fit_request(
    req: TraceRequest, *, room_tokens: int, tokens_per_block: int, mode: FitMode
) -> TraceRequest | None:
    """`req` as it fits a prompt of at most `room_tokens` model tokens (itself when it
    fits; None when skipped, or when no prompt fits at all)."""
    from mooncake.trace import TRACE_BLOCK_TOKENS

    if prompt_tokens(req.input_length, tokens_per_block) <= room_tokens:
        return req
    room = room_tokens * TRACE_BLOCK_TOKENS // tokens_per_block  # in trace tokens
    if mode is FitMode.SKIP or room < 1:
        return None
    length = room
    if mode is FitMode.SCALE:
        blocks = len(req.hash_ids) * room // req.input_length
        # floor(L * k / n) <= room, since k <= n * room / L
        length = max(1, req.input_length * blocks // len(req.hash_ids)) if blocks else room
    kept = req.hash_ids[: math.ceil(length / TRACE_BLOCK_TOKENS)]
    return replace(req, input_length=length, hash_ids=kept)


def fit_trace(
    trace: Sequence[TraceRequest],
    *,
    context_tokens: int,
    max_tokens: Callable[[TraceRequest], int],
    tokens_per_block: int,
    mode: FitMode = FitMode.SCALE,
) -> Fitted:
    """Every request fitted so that its prompt + `max_tokens(request)` fits the context."""
    out: list[TraceRequest] = []
    changed = skipped = 0
    for req in trace:
        room = context_tokens - max_tokens(req)
        fitted = fit_request(req, room_tokens=room, tokens_per_block=tokens_per_block, mode=mode)
        if fitted is None:
            skipped += 1
            continue
        changed += fitted is not req
        out.append(fitted)
    return Fitted(out, mode, context_tokens, changed, skipped)
