"""Prefill of one sequence, optionally starting from cached whole KV blocks.

Block keys come from `mooncake.hashing.block_keys` (seeded, salted by model id), so a key
names a prefix and its KV can be fetched from the store and handed to `prefill` as `prefix`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.engine.errors import EngineError
from mooncake.engine.kv import SequenceKV
from mooncake.engine.model import NO_HOOKS, Decoder, LayerHooks, attention
from mooncake.engine.tokenizer import ChatTokenizer
from mooncake.hashing import block_keys


@dataclass
class Prefilled:
    """A prefilled sequence: its KV and the logits of the positions just computed."""

    tokens: list[int]
    kv: SequenceKV
    logits: Tensor  # [V] for the last position, or [new tokens, V] with all_logits
    cached_tokens: int  # prompt tokens whose KV came from the prefix


class PrefillAttention:
    """Causal attention of S new tokens (positions start..start+S-1) over the sequence's
    KV, which already holds positions 0..start-1."""

    def __init__(self, kv: SequenceKV, start: int, new: int, device: torch.device) -> None:
        self.kv, self.start = kv, start
        self.mask: Tensor | None = None  # nothing cached: plain causal attention
        if start:
            rows = torch.arange(start, start + new, device=device)[:, None]
            cols = torch.arange(start + new, device=device)[None, :]
            self.mask = (cols <= rows)[None, None]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        end = self.start + k.shape[2]
        self.kv.write(layer, self.start, k[0], v[0])
        if q.shape[2] == 1:  # the last position only: it sees every key, no mask
            keys, values = self.kv.view(layer, end)
            return attention(q, keys[None], values[None], None, causal=False)
        if not self.start:
            return attention(q, k, v, None)
        keys, values = self.kv.view(layer, end)
        return attention(q, keys[None], values[None], self.mask)


class Engine:
    def __init__(
        self,
        model: Decoder,
        tokenizer: ChatTokenizer | None = None,
        *,
        block_tokens: int = 512,
        hash_seed: int = 0,
        model_id: str = "model",
    ) -> None:
        if block_tokens < 1:
            raise EngineError("block_tokens must be positive")
        self.model, self.tokenizer = model, tokenizer
        self.spec = model.spec
        self.block_tokens, self.hash_seed, self.model_id = block_tokens, hash_seed, model_id

    @property
    def device(self) -> torch.device:
        return self.model.device

    def check_tokens(self, tokens: Sequence[int], extra: int = 0) -> None:
        """EngineError unless tokens (plus `extra` to come) fit the model."""
        if len(tokens) == 0:
            raise EngineError("empty prompt")
        if len(tokens) + extra > self.spec.context:
            raise EngineError(
                f"prompt of {len(tokens)} tokens (+{extra}) exceeds the context of "
                f"{self.spec.context}"
            )
        bad = [t for t in tokens if not 0 <= int(t) < self.spec.vocab_size]
        if bad:
            raise EngineError(f"unknown token ids {bad[:5]} (vocabulary {self.spec.vocab_size})")

    def block_keys(self, tokens: Sequence[int]) -> list[str]:
        return block_keys(tokens, self.block_tokens, seed=self.hash_seed, salt=self.model_id)

    def new_kv(self, capacity: int) -> SequenceKV:
        return SequenceKV(self.spec, self.model.dtype, self.device, capacity)

    def prefix_from_blocks(self, blocks: Sequence[Tensor]) -> SequenceKV:
        """A prefix KV from consecutive whole blocks [layers, 2, kv_heads, T, head_dim]."""
        for b in blocks:
            if b.dim() != 5 or b.shape[3] != self.block_tokens:
                raise EngineError(f"a cached block must hold {self.block_tokens} tokens")
        moved = [b.to(device=self.device, dtype=self.model.dtype) for b in blocks]
        return SequenceKV.from_blocks(self.spec, moved, self.model.dtype, self.device)

    def blocks(self, kv: SequenceKV) -> list[Tensor]:
        """The whole blocks of a sequence's KV, in order (to store under `block_keys`)."""
        return [kv.block(i, self.block_tokens) for i in range(kv.length // self.block_tokens)]

    @torch.inference_mode()
    def prefill(
        self,
        tokens: Sequence[int],
        prefix: SequenceKV | None = None,
        hooks: LayerHooks = NO_HOOKS,
        all_logits: bool = False,
    ) -> Prefilled:
        """Compute the KV of `tokens` not covered by `prefix` (the KV of its first k whole
        blocks; empty allowed). With layer-wise loading, `prefix` may still be filling:
        layer i of it is read only after `hooks.before_layer(i)` returns."""
        tokens = [int(t) for t in tokens]
        self.check_tokens(tokens)
        start = 0 if prefix is None else prefix.length
        if start % self.block_tokens or start >= len(tokens):
            raise EngineError(
                f"a prefix must be whole blocks shorter than the prompt ({start} cached tokens, "
                f"{len(tokens)} in the prompt, blocks of {self.block_tokens})"
            )
        kv = prefix if prefix is not None else self.new_kv(len(tokens) + 64)
        kv.reserve(len(tokens) + 64)
        new = tokens[start:]
        ids = torch.tensor([new], device=self.device)
        positions = torch.arange(start, len(tokens), device=self.device)[None]
        backend = PrefillAttention(kv, start, len(new), self.device)
        logits = self.model(ids, positions, backend, hooks, last_only=not all_logits)[0]
        kv.length = len(tokens)
        return Prefilled(tokens=tokens, kv=kv, logits=logits, cached_tokens=start)

    def usable_cached_blocks(self, prompt_tokens: int, cached_blocks: int) -> int:
        """How many of the cached leading blocks prefill can use: at least one prompt token
        must be computed to get logits."""
        return max(0, min(cached_blocks, (prompt_tokens - 1) // self.block_tokens))
