"""Continuous batching: sequences join and leave a decode batch between steps.

Each sequence keeps its own KV (`SequenceKV`). A step gathers every sequence's KV of each
layer into one padded [B, kv_heads, T, head_dim] tensor with a mask (row b sees its own
positions 0..len_b), so sequences of different lengths decode together in one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mooncake.engine.engine import Engine, Prefilled
from mooncake.engine.errors import EngineError
from mooncake.engine.kv import SequenceKV
from mooncake.engine.model import attention
from mooncake.engine.sampling import SamplingParams, make_generator, sample


class DecodeAttention:
    """One new token per sequence, each at its own position."""

    def __init__(self, kvs: list[SequenceKV], device: torch.device) -> None:
        self.kvs = kvs
        self.lengths = [kv.length for kv in kvs]
        self.total = max(self.lengths) + 1
        cols = torch.arange(self.total, device=device)[None, :]
        lens = torch.tensor(self.lengths, device=device)[:, None]
        self.mask = (cols <= lens)[:, None, None, :]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, heads, _, dim = k.shape
        keys = k.new_zeros((b, heads, self.total, dim))
        values = torch.zeros_like(keys)
        for i, (kv, n) in enumerate(zip(self.kvs, self.lengths, strict=True)):
            kv.write(layer, n, k[i], v[i])
            keys[i, :, : n + 1], values[i, :, : n + 1] = kv.view(layer, n + 1)
        return attention(q, keys, values, self.mask)


@dataclass
class Sequence:
    id: str
    kv: SequenceKV
    params: SamplingParams
    generator: torch.Generator | None
    prompt_tokens: int
    output: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" or "length" once finished


@dataclass(frozen=True)
class Completion:
    id: str
    tokens: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int


class DecodeBatch:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.running: dict[str, Sequence] = {}

    def add(self, seq_id: str, prefilled: Prefilled, params: SamplingParams) -> Completion | None:
        """Join the batch with the first token sampled from the prefill logits; returns the
        completion at once if that token already finishes the sequence."""
        if seq_id in self.running:
            raise EngineError(f"sequence {seq_id!r} is already decoding")
        if params.stop and self.engine.tokenizer is None:
            raise EngineError("stop strings need a tokenizer")
        logits = prefilled.logits if prefilled.logits.dim() == 1 else prefilled.logits[-1]
        gen = make_generator(params, self.engine.device)
        seq = Sequence(seq_id, prefilled.kv, params, gen, len(prefilled.tokens))
        self.running[seq_id] = seq
        done = self._accept(seq, sample(logits, params, gen))
        return done[0] if done else None

    def __len__(self) -> int:
        return len(self.running)

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Decode one token for every running sequence; returns those that finished (and
        left the batch)."""
        seqs = list(self.running.values())
        if not seqs:
            return []
        device = self.engine.device
        ids = torch.tensor([[s.output[-1]] for s in seqs], device=device)
        positions = torch.tensor([[s.kv.length] for s in seqs], device=device)
        backend = DecodeAttention([s.kv for s in seqs], device)
        logits = self.engine.model(ids, positions, backend)
        finished: list[Completion] = []
        for i, s in enumerate(seqs):
            s.kv.length += 1
            finished += self._accept(s, sample(logits[i], s.params, s.generator))
        return finished

    def _accept(self, seq: Sequence, token: int) -> list[Completion]:
        p, tok = seq.params, self.engine.tokenizer
        eos = tok.stop_ids if (tok is not None and p.stop_on_eos) else frozenset()
        if token in p.stop_token_ids or token in eos:
            return [self._finish(seq, "stop")]
        seq.output.append(token)
        if tok is not None:
            seq.text = tok.decode(seq.output)
            cut = min((i for s in p.stop if (i := seq.text.find(s)) >= 0), default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                return [self._finish(seq, "stop")]
        # The next step writes this token's KV at position kv.length: it must fit the context.
        if len(seq.output) >= p.max_tokens or seq.kv.length >= self.engine.spec.context:
            return [self._finish(seq, "length")]
        return []

    def _finish(self, seq: Sequence, reason: str) -> Completion:
        seq.finish_reason = reason
        del self.running[seq.id]
        return Completion(seq.id, list(seq.output), seq.text, reason, seq.prompt_tokens)


def generate(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Completion]:
    """Prefill each prompt, then decode them all in one continuous batch."""
    if len(prompts) != len(params):
        raise EngineError("one SamplingParams per prompt")
    batch = DecodeBatch(engine)
    done: dict[str, Completion] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        first = batch.add(str(i), engine.prefill(prompt), p)
        if first is not None:
            done[first.id] = first
    while len(batch):
        done.update((c.id, c) for c in batch.step())
    return [done[str(i)] for i in range(len(prompts))]
