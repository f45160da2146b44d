"""Continuous batching: sequences join and leave a decode batch between steps.

The batch keeps every running sequence's KV resident in one tensor per layer,
[2, slots, kv_heads, capacity, head_dim] (`BatchKV`): a sequence copies its prefilled KV into
a free slot once, when it joins, and its `SequenceKV` then views that slot, so each step
writes the new token's k, v in place (one indexed write per layer for the whole batch) and
attention reads the slots directly, with a mask (row b sees its own positions 0..len_b), so
sequences of different lengths decode together in one forward pass. A sequence that leaves
gets a private copy of its KV back and the last slot moves into the hole, so the running
sequences always fill slots 0..B-1.

`DecodeAttention` is the same step over any list of `SequenceKV` (gathering them into a
padded tensor per layer); it is kept for callers that drive the decoder by hand.
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


CAPACITY_STEP = 256  # the resident KV grows in multiples of this many tokens


class BatchKV:
    """The resident KV of a decode batch (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.spec, self.dtype, self.device = engine.spec, engine.model.dtype, engine.device
        self.layers: list[Tensor] = []
        self.members: list[SequenceKV] = []

    @property
    def slots(self) -> int:
        return self.layers[0].shape[1] if self.layers else 0

    @property
    def capacity(self) -> int:
        return self.layers[0].shape[3] if self.layers else 0

    def _grown(self, need: int) -> int:
        """Capacity for `need` tokens: doubling, in multiples of CAPACITY_STEP, so that a
        batch reallocates (and copies every slot) only every so often."""
        want = max(need, 2 * self.capacity if need > self.capacity else self.capacity)
        return -(-want // CAPACITY_STEP) * CAPACITY_STEP

    @torch.inference_mode()
    def _realloc(self, slots: int, capacity: int) -> None:
        shape = (2, slots, self.spec.kv_heads, capacity, self.spec.head_dim)
        # Zeros, not empty: masked positions still enter the attention's matmul with V.
        new = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.spec.layers)
        ]
        n, used = len(self.members), min(self.capacity, capacity)
        for old, grown in zip(self.layers, new, strict=False):
            grown[:, :n, :, :used] = old[:, :n, :, :used]
        self.layers = new
        for i, kv in enumerate(self.members):
            self._point(i, kv)

    def _point(self, slot: int, kv: SequenceKV) -> None:
        kv.layers = [t[:, slot] for t in self.layers]

    def _attached(self, slot: int, kv: SequenceKV) -> bool:
        return kv.layers[0].data_ptr() == self.layers[0][:, slot].data_ptr()

    @torch.inference_mode()
    def join(self, kv: SequenceKV) -> None:
        n = len(self.members)
        need = kv.length + 1
        if n + 1 > self.slots or need > self.capacity:
            self._realloc(max(n + 1, 2 * self.slots, 4), self._grown(need))
        self._copy_in(n, kv)
        self.members.append(kv)

    def _copy_in(self, slot: int, kv: SequenceKV) -> None:
        n = kv.length
        for t, own in zip(self.layers, kv.layers, strict=True):
            t[:, slot, :, :n] = own[:, :, :n]
        self._point(slot, kv)

    @torch.inference_mode()
    def leave(self, kv: SequenceKV) -> None:
        """Give `kv` a private copy of its KV and close the hole with the last slot."""
        slot = next(i for i, m in enumerate(self.members) if m is kv)
        keep = max(kv.length, 1)
        kv.layers = [t[:, slot, :, :keep].clone() for t in self.layers]
        last = len(self.members) - 1
        if slot != last:
            moved = self.members[last]
            n = moved.length
            for t in self.layers:
                t[:, slot, :, :n] = t[:, last, :, :n]
            self.members[slot] = moved
            self._point(slot, moved)
        self.members.pop()

    @torch.inference_mode()
    def prepare(self) -> None:
        """Before a step: room for one more token per sequence, and every member still
        attached (a caller that grew a member's KV by hand gets it copied back in)."""
        need = max(kv.length for kv in self.members) + 1
        if need > self.capacity:
            self._realloc(self.slots, self._grown(need))
        for i, kv in enumerate(self.members):
            if not self._attached(i, kv):
                self._copy_in(i, kv)


class SlotAttention:
    """DecodeAttention over a `BatchKV`: sequence b is slot b."""

    def __init__(self, kv: BatchKV) -> None:
        self.layers = kv.layers
        lengths = [m.length for m in kv.members]
        self.total = max(lengths) + 1
        device = kv.device
        self.rows = torch.arange(len(lengths), device=device)
        self.pos = torch.tensor(lengths, device=device)
        cols = torch.arange(self.total, device=device)[None, :]
        # All of one length (batch 1, say): every row sees every key, no mask needed.
        self.mask: Tensor | None = None
        if min(lengths) != max(lengths):
            self.mask = (cols <= self.pos[:, None])[:, None, None, :]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        t = self.layers[layer]
        b = q.shape[0]
        t[:, self.rows, :, self.pos] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)
        keys, values = t[0, :b, :, : self.total], t[1, :b, :, : self.total]
        return attention(q, keys, values, self.mask, causal=False)


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
        self.kv = BatchKV(engine)
        self.slots: list[Sequence] = []  # slot order, parallel to self.kv.members

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
        self.kv.join(seq.kv)
        self.slots.append(seq)
        self.running[seq_id] = seq
        done = self._accept(seq, sample(logits, params, gen))
        return done[0] if done else None

    def resume(
        self,
        seq_id: str,
        kv: SequenceKV,
        prompt_tokens: list[int],
        first_token: int,
        params: SamplingParams,
    ) -> Completion | None:
        """Join the batch with a prompt's KV and its first token already chosen (by a prefill
        instance elsewhere: disaggregation); the first token meets the same stop and
        max_tokens rules as in `add`. Returns the completion at once if it finishes."""
        if seq_id in self.running:
            raise EngineError(f"sequence {seq_id!r} is already decoding")
        if params.stop and self.engine.tokenizer is None:
            raise EngineError("stop strings need a tokenizer")
        if kv.length != len(prompt_tokens):
            raise EngineError(f"KV of {kv.length} tokens for a prompt of {len(prompt_tokens)}")
        if not 0 <= first_token < self.engine.spec.vocab_size:
            raise EngineError(f"unknown first token {first_token}")
        # A sampled (temperature > 0) sequence gets a fresh generator here: it is seeded like
        # `add`'s but has not drawn the first token, so seeded outputs can differ from `add`.
        gen = make_generator(params, self.engine.device)
        seq = Sequence(seq_id, kv, params, gen, len(prompt_tokens))
        self.kv.join(seq.kv)
        self.slots.append(seq)
        self.running[seq_id] = seq
        done = self._accept(seq, int(first_token))
        return done[0] if done else None

    def cancel(self, seq_id: str) -> Completion | None:
        """Take a sequence out of the batch before it finishes (finish reason "cancelled");
        None if it is not running."""
        seq = self.running.get(seq_id)
        return None if seq is None else self._finish(seq, "cancelled")

    def __len__(self) -> int:
        return len(self.running)

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Decode one token for every running sequence; returns those that finished (and
        left the batch)."""
        seqs = list(self.slots)
        if not seqs:
            return []
        device = self.engine.device
        self.kv.prepare()
        ids = torch.tensor([[s.output[-1]] for s in seqs], device=device)
        backend = SlotAttention(self.kv)
        logits = self.engine.model(ids, backend.pos[:, None], backend)
        finished: list[Completion] = []
        for s in seqs:  # every length first: a leaving sequence moves another's slot
            s.kv.length += 1
        # Greedy rows (the common case) take their token from one argmax over the batch.
        greedy = [s.params.temperature == 0 or s.generator is None for s in seqs]
        top = logits.argmax(-1).tolist() if any(greedy) else []
        for i, s in enumerate(seqs):
            token = top[i] if greedy[i] else sample(logits[i], s.params, s.generator)
            finished += self._accept(s, token)
        return finished

    def _accept(self, seq: Sequence, token: int) -> list[Completion]:
        p, tok = seq.params, self.engine.tokenizer
        eos = tok.stop_ids if (tok is not None and p.stop_on_eos) else frozenset()
        if token in p.stop_token_ids or token in eos:
            return [self._finish(seq, "stop")]
        seq.output.append(token)
        if tok is not None and p.stop:  # without stop strings the text is made at the end
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
        tok = self.engine.tokenizer
        if tok is not None and not seq.params.stop:
            seq.text = tok.decode(seq.output)
        del self.running[seq.id]
        slot = self.slots.index(seq)
        self.kv.leave(seq.kv)
        last = self.slots.pop()
        if last is not seq:
            self.slots[slot] = last
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
