"""Chunked pipeline parallelism (CPP, PAPER.md §6): the plan of one long prefill over a group
of prefill workers, and what it costs.

A group of X workers holds consecutive layer ranges (stage s runs layers
`layer_ranges[s]`); the prompt's new tokens are cut into chunks; chunk k flows through the
stages in order, and stage s works on chunk k while stage s + 1 works on chunk k - 1. Each
stage attends, for its layers, over the KV of every earlier chunk it computed itself, so no
KV crosses between stages: only the chunk's hidden state does (activations, `hidden` x
`chunk` numbers), over the store's transfer engine.

Pure: the plan, the pipeline's schedule (`pipeline_finish_s`, what the Conductor's TTFT
estimate and the simulator both use) and the choice of a group size. No torch, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The paper's chunks are ">= ~1,000 tokens": smaller ones pay per-chunk overheads (a step of
# every stage, a transfer) for a pipeline fill that is short anyway.
DEFAULT_CHUNK_TOKENS = 1024

# The cost model's prefill time (`core.cost_model`): a prompt of `prompt_tokens` whose first
# `cached_tokens` are cached, all layers, one worker (seconds).
PrefillCost = Callable[[int, int], float]


def layer_ranges(layers: int, stages: int) -> list[tuple[int, int]]:
    """`layers` split into `stages` consecutive [first, end) ranges, as even as they go (a
    LLaMA-family model's layers all cost the same), the larger ones first."""
    if stages < 1 or layers < stages:
        raise ValueError(f"cannot split {layers} layers into {stages} stages")
    base, extra = divmod(layers, stages)
    out, first = [], 0
    for s in range(stages):
        end = first + base + (1 if s < extra else 0)
        out.append((first, end))
        first = end
    return out


def chunk_ranges(
    start: int, end: int, chunk_tokens: int, cost: PrefillCost | None = None
) -> list[tuple[int, int]]:
    """Positions [start, end) in chunks of `chunk_tokens` (the last one may be shorter) or,
    with `cost`, in as many chunks of about equal cost: a token attends over every position
    before it, so equal-sized chunks grow dearer, and the pipeline's drain (the last stage's
    share of the last chunk, after every other stage is done) is its dearest chunk's; with
    equal costs it is 1/chunks of the prefill. The first chunks are then longer than
    `chunk_tokens`, the last ones shorter."""
    if chunk_tokens < 1 or not 0 <= start < end:
        raise ValueError(f"no chunks of {chunk_tokens} in [{start}, {end})")
    even = [(a, min(a + chunk_tokens, end)) for a in range(start, end, chunk_tokens)]
    if cost is None or len(even) < 2:
        return even
    total, count = cost(end, start), len(even)
    bounds = [start]
    for i in range(1, count):
        # The least b whose prefix [start, b) costs i / count of the whole (bisection: the
        # cost grows with b), leaving at least one token to each chunk after it.
        target, lo, hi = total * i / count, bounds[-1] + 1, end - (count - i)
        if i >= 2:  # a token costs no less than the one before: no chunk outgrows the last
            near = bounds[-1] + (bounds[-1] - bounds[-2]) + 1
            if near < hi and cost(near, start) >= target:
                hi = near
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(mid, start) >= target:
                hi = mid
            else:
                lo = mid + 1
        bounds.append(lo)
    bounds.append(end)
    return list(itertools.pairwise(bounds))


# No chunk longer than this many times `chunk_tokens` (`capped`): a stage's inbox is sized
# for the longest chunk, and its memory is part of the worker's stated bound.
MAX_CHUNK_FACTOR = 4


def capped(chunks: Sequence[tuple[int, int]], max_tokens: int) -> list[tuple[int, int]]:
    """`chunks` with every chunk longer than `max_tokens` cut into the fewest even pieces
    that fit (equal-cost chunks of a very long prompt start long: its first tokens attend
    over little)."""
    if max_tokens < 1:
        raise ValueError("chunks hold at least one token")
    out: list[tuple[int, int]] = []
    for a, b in chunks:
        pieces = -(-(b - a) // max_tokens)
        bounds = [a + (b - a) * i // pieces for i in range(pieces + 1)]
        out += list(itertools.pairwise(bounds))
    return out


@dataclass(frozen=True, slots=True)
class CppPlan:
    """How one prefill runs: the stages' layers and the chunks' positions."""

    layers: tuple[tuple[int, int], ...]
    chunks: tuple[tuple[int, int], ...]

    @property
    def stages(self) -> int:
        return len(self.layers)

    @classmethod
    def of(
        cls, model_layers: int, stages: int, start: int, end: int, chunk_tokens: int,
        cost: PrefillCost | None = None,
    ) -> CppPlan:  # fmt: skip
        """With `cost`, chunks of about equal cost (`chunk_ranges`)."""
        return cls(
            tuple(layer_ranges(model_layers, stages)),
            tuple(chunk_ranges(start, end, chunk_tokens, cost)),
        )

    @property
    def max_chunk_tokens(self) -> int:
        return max(b - a for a, b in self.chunks)


def pipeline_finish_s(stage_s: Sequence[Sequence[float]], hop_s: float = 0.0) -> float:
    """When the last stage finishes the last chunk: `stage_s[s][k]` is stage s's time on
    chunk k, `hop_s` the time one chunk's activations take from a stage to the next. Stage s
    starts chunk k once it finished chunk k - 1 and chunk k has arrived from stage s - 1."""
    if not stage_s or not stage_s[0]:
        return 0.0
    chunks = len(stage_s[0])
    done = [0.0] * chunks  # when the previous stage finished each chunk (arrival without hop)
    for s, times in enumerate(stage_s):
        if len(times) != chunks:
            raise ValueError("every stage runs every chunk")
        free = 0.0
        for k in range(chunks):
            arrived = done[k] + (hop_s if s else 0.0)
            free = max(free, arrived) + times[k]
            done[k] = free
    return done[-1]


def cpp_ttft_s(
    prefill_s: PrefillCost, plan: CppPlan, model_layers: int, hop_s: float = 0.0
) -> float:
    """The prefill time of `plan`: each chunk costs what a prefill of its tokens after the
    earlier ones costs (its attention grows with them), shared by the stages in proportion
    to their layers; the chunks then flow through the pipeline."""
    per_chunk = [prefill_s(b, a) for a, b in plan.chunks]
    return _split_s(per_chunk, plan.layers, model_layers, hop_s)


def _split_s(
    per_chunk: Sequence[float], layers: Sequence[tuple[int, int]], model_layers: int, hop_s: float
) -> float:
    """The pipeline's finish with each chunk's one-worker time shared by the stages in
    proportion to their layers."""
    stage_s = [[t * (e - f) / model_layers for t in per_chunk] for f, e in layers]
    return pipeline_finish_s(stage_s, hop_s)


@dataclass(frozen=True, slots=True)
class CppConfig:
    """When the Conductor prefills a request on a group (`choose_group`)."""

    max_stages: int = 1  # the largest group; 1: every prefill on one worker
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    layers: int = 80  # the served model's layers (LLaMA3-70B's: the reference costs')
    # A group must cut the request's TTFT by this factor: it holds X workers for it.
    min_gain: float = 1.2
    # ... and keep this share of the X workers' time busy with it (the one worker's prefill
    # over X x the group's, the members' wait for the last of them to be free counted as
    # spent): the rest is lost to the pipeline's fill, the hops and the gang's alignment,
    # capacity every other request would have had.
    min_efficiency: float = 0.95


def group_prefill_s(
    prefill_s: PrefillCost, cfg: CppConfig, stages: int, start: int, end: int, hop_s: float
) -> float:
    """The pipelined prefill of positions [start, end) on `stages` stages as `choose_group`
    plans it (chunks of equal cost, even layer ranges): what a chosen group then takes."""
    plan = CppPlan.of(cfg.layers, stages, start, end, cfg.chunk_tokens, prefill_s)
    return cpp_ttft_s(prefill_s, plan, cfg.layers, hop_s)


@dataclass(frozen=True, slots=True)
class CppGroup:
    """A prefill on `1 + len(members)` stages: the leader (stage 0) and `members` (stages
    1..), starting when the last of them is free (`queue_s` from now)."""

    members: tuple[str, ...]
    queue_s: float
    prefill_s: float

    @property
    def stages(self) -> int:
        return 1 + len(self.members)


def choose_group(
    prefill_s: PrefillCost,
    cfg: CppConfig,
    *,
    start: int,
    end: int,
    leader_queue_s: float,
    others: Sequence[tuple[float, str]],
    hop_s: float = 0.0,
) -> CppGroup | None:
    """The group that prefills positions [start, end) soonest, led by the worker Algorithm 1
    chose (queue `leader_queue_s`) with the least-queued of `others` ((queue s, id) of every
    other prefill worker), or None where one worker is as good: no group whose TTFT beats
    the leader's own by `cfg.min_gain` while keeping `cfg.min_efficiency` of its workers'
    time busy. A prompt of one chunk runs on one worker."""
    if cfg.max_stages < 2 or not others:
        return None
    count = -(-(end - start) // cfg.chunk_tokens)
    # A pipeline of C chunks of one cost over X stages keeps at most C / (C + X - 1) of its
    # workers busy (the fill), X = 2 the most: past that bound no group qualifies, and the
    # costs are not worked out (most prompts: at 0.95 a group needs 19 chunks or more).
    if count < 2 or count / (count + 1) < cfg.min_efficiency * (1 - 1e-3):
        return None
    chunks = chunk_ranges(start, end, cfg.chunk_tokens, prefill_s)
    single = prefill_s(end, start)
    per_chunk = [prefill_s(b, a) for a, b in chunks]
    ranked = sorted(others)
    best: CppGroup | None = None
    limit = min(cfg.max_stages, len(ranked) + 1, len(chunks), cfg.layers)
    for stages in range(2, limit + 1):
        picked = ranked[: stages - 1]
        queue = max(leader_queue_s, picked[-1][0])
        t = _split_s(per_chunk, layer_ranges(cfg.layers, stages), cfg.layers, hop_s)
        waits = (queue - leader_queue_s) + sum(queue - q for q, _ in picked)
        efficiency = single / (stages * t + waits)
        if efficiency < cfg.min_efficiency or leader_queue_s + single < cfg.min_gain * (queue + t):
            continue
        if best is None or queue + t < best.queue_s + best.prefill_s:
            best = CppGroup(tuple(i for _, i in picked), queue, t)
    return best
