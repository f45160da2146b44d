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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The paper's chunks are ">= ~1,000 tokens": smaller ones pay per-chunk overheads (a step of
# every stage, a transfer) for a pipeline fill that is short anyway.
DEFAULT_CHUNK_TOKENS = 1024


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


def chunk_ranges(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Positions [start, end) in chunks of `chunk_tokens` (the last one may be shorter)."""
    if chunk_tokens < 1 or not 0 <= start < end:
        raise ValueError(f"no chunks of {chunk_tokens} in [{start}, {end})")
    return [(a, min(a + chunk_tokens, end)) for a in range(start, end, chunk_tokens)]


@dataclass(frozen=True, slots=True)
class CppPlan:
    """How one prefill runs: the stages' layers and the chunks' positions."""

    layers: tuple[tuple[int, int], ...]
    chunks: tuple[tuple[int, int], ...]

    @property
    def stages(self) -> int:
        return len(self.layers)

    @classmethod
    def of(cls, model_layers: int, stages: int, start: int, end: int, chunk_tokens: int) -> CppPlan:
        return cls(
            tuple(layer_ranges(model_layers, stages)),
            tuple(chunk_ranges(start, end, chunk_tokens)),
        )


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


# The cost model's prefill time (`core.cost_model`): a prompt of `prompt_tokens` whose first
# `cached_tokens` are cached, all layers, one worker (seconds).
PrefillCost = Callable[[int, int], float]


def cpp_ttft_s(
    prefill_s: PrefillCost, plan: CppPlan, model_layers: int, hop_s: float = 0.0
) -> float:
    """The prefill time of `plan`: each chunk costs what a prefill of its tokens after the
    earlier ones costs (its attention grows with them), shared by the stages in proportion
    to their layers; the chunks then flow through the pipeline."""
    per_chunk = [prefill_s(b, a) for a, b in plan.chunks]
    stage_s = [[t * (e - f) / model_layers for t in per_chunk] for f, e in plan.layers]
    return pipeline_finish_s(stage_s, hop_s)


@dataclass(frozen=True, slots=True)
class CppChoice:
    """A group size and its predicted prefill time (stages 1: no pipeline)."""

    stages: int
    prefill_s: float


def choose_stages(
    prefill_s: PrefillCost,
    *,
    start: int,
    end: int,
    model_layers: int,
    available: int,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    hop_s: float = 0.0,
    min_gain: float = 1.2,
) -> CppChoice:
    """The group size for a prefill of positions [start, end): the size whose pipeline
    finishes first, among 1 .. `available` (at most one chunk per stage would leave stages
    idle), unless it beats one worker by less than `min_gain` (a group holds X workers for
    the request: it must pay for them). A prompt of one chunk runs on one worker."""
    single = prefill_s(end, start)
    best = CppChoice(1, single)
    chunks = len(chunk_ranges(start, end, chunk_tokens))
    for stages in range(2, min(available, chunks, model_layers) + 1):
        plan = CppPlan.of(model_layers, stages, start, end, chunk_tokens)
        t = cpp_ttft_s(prefill_s, plan, model_layers, hop_s)
        if t < best.prefill_s:
            best = CppChoice(stages, t)
    if best.stages > 1 and single < min_gain * best.prefill_s:
        return CppChoice(1, single)
    return best
