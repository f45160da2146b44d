"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, with a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.engine.errors import EngineError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Also stop on the tokenizer's end-of-turn tokens (EOS, <|im_end|>).
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise EngineError("stop strings must be non-empty")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """logits [V] (already divided by temperature) with everything outside top-k / top-p
    set to -inf. Top-p keeps the smallest set whose probability reaches top_p."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [V]."""
    if params.temperature == 0 or generator is None:
        return int(torch.argmax(logits).item())
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
