"""Continuous batching over the paged KV pool: sequences join and leave between steps.

Every sequence's KV stays in the pages it holds in the engine's pool (`PagedKV`); a step
writes each sequence's new token into its next page slot and attends through the block
tables (`engine.paged.PagedDecode`), so nothing is copied when a sequence joins or leaves
and nothing grows by doubling: a leaving sequence just gives its pages back.

Before each step every sequence needs room for one more token. When the pool is out of
pages (after evicting idle cached blocks), the youngest sequences are preempted until the
rest fit: they leave the batch with their pages released and are listed in `preempted`
(their output so far), for the caller to resume later (`rejoin`) once it has recomputed or
reloaded their KV. A sequence is never failed for lack of memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mooncake.core import kv_admission
from mooncake.engine.engine import Engine, Prefilled
from mooncake.engine.errors import EngineError
from mooncake.engine.paged import PagedDecode
from mooncake.engine.pool import PagedKV
from mooncake.engine.sampling import SamplingParams, make_generator, sample
from mooncake.engine.tokenizer import ChatTokenizer


@dataclass
class Sequence:
    id: str
    kv: PagedKV
    params: SamplingParams
    generator: torch.Generator | None
    prompt_tokens: int
    joined: int  # join order: the youngest is preempted first
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


@dataclass(frozen=True)
class Preempted:
    """A sequence taken out for lack of pages: its output so far (the last token is the
    next step's input, its KV not computed yet)."""

    id: str
    prompt_tokens: int
    output: list[int]


class DecodeBatch:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = engine.pool
        self.running: dict[str, Sequence] = {}
        self.slots: list[Sequence] = []  # join order
        self.preempted: list[Preempted] = []
        self._joined = 0

    def add(self, seq_id: str, prefilled: Prefilled, params: SamplingParams) -> Completion | None:
        """Join the batch with the first token sampled from the prefill logits; returns the
        completion at once if that token already finishes the sequence."""
        logits = prefilled.logits if prefilled.logits.dim() == 1 else prefilled.logits[-1]
        seq = self._join(seq_id, prefilled.kv, params, len(prefilled.tokens))
        done = self._accept(seq, sample(logits, params, seq.generator))
        return done[0] if done else None

    def resume(
        self,
        seq_id: str,
        kv: PagedKV,
        prompt_tokens: list[int],
        first_token: int,
        params: SamplingParams,
    ) -> Completion | None:
        """Join the batch with a prompt's KV and its first token already chosen (by a prefill
        instance elsewhere: disaggregation); the first token meets the same stop and
        max_tokens rules as in `add`. Returns the completion at once if it finishes."""
        if kv.length != len(prompt_tokens):
            raise EngineError(f"KV of {kv.length} tokens for a prompt of {len(prompt_tokens)}")
        if not 0 <= first_token < self.engine.spec.vocab_size:
            raise EngineError(f"unknown first token {first_token}")
        # A sampled (temperature > 0) sequence gets a fresh generator here: it is seeded like
        # `add`'s but has not drawn the first token, so seeded outputs can differ from `add`.
        seq = self._join(seq_id, kv, params, len(prompt_tokens))
        done = self._accept(seq, int(first_token))
        return done[0] if done else None

    def rejoin(
        self,
        seq_id: str,
        kv: PagedKV,
        prompt_tokens: int,
        output: list[int],
        params: SamplingParams,
    ) -> None:
        """Take a preempted sequence back: `kv` holds the prompt and every output token but
        the last (recomputed or reloaded); decoding goes on from the last token. Its tokens
        were accepted already, so nothing is checked again (a sampled sequence gets a fresh
        generator)."""
        if not output or kv.length != prompt_tokens + len(output) - 1:
            raise EngineError(
                f"KV of {kv.length} tokens for {prompt_tokens} prompt + {len(output)} output"
            )
        seq = self._join(seq_id, kv, params, prompt_tokens)
        seq.output = list(output)
        tok = self.engine.tokenizer
        if tok is not None and params.stop:
            seq.text = tok.decode(seq.output)

    def cancel(self, seq_id: str) -> Completion | None:
        """Take a sequence out of the batch before it finishes (finish reason "cancelled");
        None if it is not running."""
        seq = self.running.get(seq_id)
        return None if seq is None else self._finish(seq, "cancelled")

    def take_preempted(self) -> list[Preempted]:
        out, self.preempted = self.preempted, []
        return out

    def __len__(self) -> int:
        return len(self.running)

    @torch.inference_mode()
    def _logits(self, seqs: list[Sequence]) -> Tensor:
        """One decode step's logits [batch, vocab] for `seqs`."""
        graphs, kvs = self.engine.graphs, [s.kv for s in seqs]
        if graphs is not None and graphs.applies(len(seqs), max(len(kv.pages) for kv in kvs)):
            return graphs([s.output[-1] for s in seqs], kvs)
        ids = torch.tensor([[s.output[-1]] for s in seqs], device=self.engine.device)
        backend = PagedDecode(self.pool, kvs)
        fused = self.engine.fused
        if fused is not None:
            return fused(ids, backend)
        out: Tensor = self.engine.model(ids, backend.positions[:, None], backend)
        return out

    def step(self) -> list[Completion]:
        """Decode one token for every running sequence; returns those that finished (and
        left the batch). Sequences preempted for room are in `preempted`."""
        seqs = self._make_room()
        if not seqs:
            return []
        # The host's CPUs for this step (engine.turns); on one thread or all of them,
        # whichever measures faster for this batch (engine.threads), timed inside the turn.
        with self.engine.turns.turn(), self.engine.step_threads.step(len(seqs)):
            logits = self._logits(seqs)
        for s in seqs:
            s.kv.length += 1
        # Greedy rows (the common case) take their token from one argmax over the batch.
        greedy = [s.params.temperature == 0 or s.generator is None for s in seqs]
        top = logits.argmax(-1).tolist() if any(greedy) else []
        finished: list[Completion] = []
        for i, s in enumerate(seqs):
            token = top[i] if greedy[i] else sample(logits[i], s.params, s.generator)
            finished += self._accept(s, token)
        return finished

    # --- internals ------------------------------------------------------------------------

    def _join(self, seq_id: str, kv: PagedKV, params: SamplingParams, prompt: int) -> Sequence:
        if seq_id in self.running:
            raise EngineError(f"sequence {seq_id!r} is already decoding")
        if params.stop and self.engine.tokenizer is None:
            raise EngineError("stop strings need a tokenizer")
        if kv.pool is not self.pool:
            raise EngineError("a sequence's KV must live in this engine's pool")
        gen = make_generator(params, self.engine.device)
        self._joined += 1
        seq = Sequence(seq_id, kv, params, gen, prompt, self._joined)
        self.slots.append(seq)
        self.running[seq_id] = seq
        return seq

    def _make_room(self) -> list[Sequence]:
        """Pages for one more token of every sequence, oldest first; the youngest leave
        (preempted) while the pool cannot give them."""
        for seq in list(self.slots):
            if seq.id not in self.running:
                continue  # preempted while making room for an older one
            while not seq.kv.reserve(seq.kv.length + 1):
                victim = self.running[kv_admission.victim({s.id: s.joined for s in self.slots})]
                self._preempt(victim)
                if victim is seq:
                    break
        return list(self.slots)

    def _preempt(self, seq: Sequence) -> None:
        self._leave(seq)
        self.preempted.append(Preempted(seq.id, seq.prompt_tokens, list(seq.output)))

    def _leave(self, seq: Sequence) -> None:
        del self.running[seq.id]
        self.slots.remove(seq)
        seq.kv.release()

    def _accept(self, seq: Sequence, token: int) -> list[Completion]:
        p, tok = seq.params, self.engine.tokenizer
        if is_stop_token(token, p, tok):
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
        self._leave(seq)
        return Completion(seq.id, list(seq.output), seq.text, reason, seq.prompt_tokens)


def is_stop_token(token: int, params: SamplingParams, tokenizer: ChatTokenizer | None) -> bool:
    """Whether sampling `token` ends the sequence (a stop id the request names, or the
    tokenizer's end-of-turn ids unless the request opted out): it is not part of the output."""
    if token in params.stop_token_ids:
        return True
    return tokenizer is not None and params.stop_on_eos and token in tokenizer.stop_ids


def generate(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Completion]:
    """Prefill each prompt, then decode them all in one continuous batch (a preempted
    sequence is recomputed and rejoins as soon as the pool has room again)."""
    if len(prompts) != len(params):
        raise EngineError("one SamplingParams per prompt")
    batch = DecodeBatch(engine)
    done: dict[str, Completion] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        first = batch.add(str(i), engine.prefill(prompt), p)
        if first is not None:
            done[first.id] = first
    waiting: list[Preempted] = []
    while len(batch) or waiting:
        done.update((c.id, c) for c in batch.step())
        waiting += batch.take_preempted()
        while waiting and (not len(batch) or _fits_again(engine, prompts, waiting[0])):
            w = waiting.pop(0)
            tokens = prompts[int(w.id)] + w.output[:-1]
            kv = engine.prefill(tokens).kv
            batch.rejoin(w.id, kv, w.prompt_tokens, w.output, params[int(w.id)])
    return [done[str(i)] for i in range(len(prompts))]


def _fits_again(engine: Engine, prompts: list[list[int]], w: Preempted) -> bool:
    """Room for a preempted sequence's KV and some more tokens (so it does not go out at
    the next step)."""
    return engine.pool.fits(len(prompts[int(w.id)]) + len(w.output) + 4 * engine.pool.page_tokens)
