"""Prefill of one sequence, optionally starting from KV it already holds (a cached prefix).

Block keys come from `mooncake.hashing.request_keys` (seeded, salted by the model id and the
request's cache namespace), so a key names a prefix and its KV can be fetched from the store
(or found in the engine's own pool) and handed to `prefill` as `prefix`.

Every engine owns one KV pool (`engine.pool`), allocated once from a byte budget; all of its
sequences' KV lives in pages of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mooncake.engine.errors import EngineError
from mooncake.engine.fused import FusedDecode
from mooncake.engine.graphs import GraphDecode
from mooncake.engine.kv import BlockLayout
from mooncake.engine.model import NO_HOOKS, Decoder, LayerHooks
from mooncake.engine.paged import PagedPrefill, prefill_attention_choice
from mooncake.engine.pool import KVPool, KVPoolExhausted, PagedKV, page_tokens_for
from mooncake.engine.threads import StepThreads
from mooncake.engine.tokenizer import ChatTokenizer
from mooncake.engine.turns import NO_TURNS, TurnHooks, Turns
from mooncake.hashing import DEFAULT_CACHE_NAMESPACE, request_keys
from mooncake.memory import compute_heap

# Without a budget, an engine's pool holds this many full contexts (tests, tools): the
# memory is reserved, and only what is written becomes resident.
DEFAULT_POOL_CONTEXTS = 4


def min_pool_tokens(spec_context: int, block_tokens: int) -> int:
    """The fewest KV positions an engine's pool may hold: one full context and two blocks."""
    return spec_context + 2 * block_tokens


@dataclass
class Prefilled:
    """A prefilled sequence: its KV and the logits of the positions just computed."""

    tokens: list[int]
    kv: PagedKV
    logits: Tensor  # [V] for the last position, or [new tokens, V] with all_logits
    cached_tokens: int  # prompt tokens whose KV came from the prefix


class Engine:
    def __init__(
        self,
        model: Decoder,
        tokenizer: ChatTokenizer | None = None,
        *,
        block_tokens: int = 512,
        hash_seed: int = 0,
        model_id: str = "model",
        kv_budget_bytes: int | None = None,
        decode: Literal["fused", "eager"] = "fused",
        attention: Literal["float32", "bfloat16"] = "float32",
        gemm: Literal["float32", "bfloat16"] = "float32",
        kv: Literal["float32", "bfloat16"] | None = None,
    ) -> None:
        if block_tokens < 1:
            raise EngineError("block_tokens must be positive")
        self.model, self.tokenizer = model, tokenizer
        self.spec = model.spec
        self.block_tokens, self.hash_seed, self.model_id = block_tokens, hash_seed, model_id
        # The KV pool's (and the store's blocks') element type: the model's unless `kv` is
        # given (EngineSettings.kv: bfloat16 halves the bytes a decode step reads).
        kv_dtype = model.dtype if kv is None else getattr(torch, kv)
        per_token = self.spec.kv_bytes_per_token(kv_dtype.itemsize)
        minimum = min_pool_tokens(self.spec.context, block_tokens) * per_token
        budget = kv_budget_bytes or DEFAULT_POOL_CONTEXTS * minimum
        if budget < minimum:
            raise EngineError(
                f"a KV budget of {budget / 2**20:.0f} MiB cannot hold one full context of this "
                f"model ({self.spec.context} tokens + 2 blocks = {minimum / 2**20:.0f} MiB)"
            )
        self.pool = KVPool(
            self.spec,
            kv_dtype,
            model.device,
            budget_bytes=budget,
            page_tokens=page_tokens_for(block_tokens),
        )
        # The fastest decode step the device has, unless "eager" is asked for: each layer in
        # one native call on the CPU (engine.fused), replayed CUDA graphs on a GPU
        # (engine.graphs).
        fast = decode == "fused"
        self.fused = FusedDecode.of(model, self.pool) if fast else None
        self.graphs = GraphDecode.of(model, self.pool) if fast else None
        # A fused step's thread count, one or all, whichever measures faster per batch size
        # (engine.threads): its results do not depend on it.
        self.step_threads = StepThreads(applies=self.fused is not None)
        # "bfloat16": prefill attention's products in bfloat16 where the CPU has them and
        # they measure faster (EngineSettings.attention; paged.prefill_kernel).
        self.attention = attention
        self._attention_path: str | None = None  # prefill_attention, chosen at first use
        # "bfloat16": prefill GEMMs over quantized weights in bfloat16 where the CPU has
        # bfloat16 matrix instructions that measure faster (EngineSettings.gemm;
        # Decoder.use_bf16_gemms, gemm.bf16_gemms_fast). The
        # model is this engine's: the choice is set on it.
        self.gemm = gemm
        model.use_bf16_gemms(gemm == "bfloat16")
        # Turns at the host's CPUs with its other engine processes (engine.turns): none
        # unless the worker that runs this engine shares its host (`serving.models`).
        self.turns: Turns = NO_TURNS

    @property
    def decode_path(self) -> str:
        """How decode steps run: "fused" (engine.fused), "graphs" (engine.graphs) or "eager"
        (the model's forward op by op)."""
        if self.fused is not None:
            return "fused"
        return "graphs" if self.graphs is not None else "eager"

    @property
    def prefill_attention(self) -> str:
        """How prefill attention runs: "torch bfloat16" (torch's fused attention over
        bfloat16 copies), "native bfloat16" or "native float32" (the CPU's prefill kernel,
        engine.native), or "torch" (the model's attention: other devices and dtypes, or no C
        compiler). bfloat16 only where asked for and it measures faster here."""
        if self._attention_path is None:
            self._attention_path = prefill_attention_choice(self.pool, self.attention == "bfloat16")
        return self._attention_path

    @property
    def prefill_gemm(self) -> str:
        """How prefill GEMMs multiply: "bfloat16" (asked for, and applied: see
        Decoder.use_bf16_gemms) or "float32"."""
        return "bfloat16" if self.model.bf16_gemms else "float32"

    def prefill_backend(self, kv: PagedKV, start: int, new: int) -> PagedPrefill:
        """The attention backend of a prefill of `new` tokens after `start` held in `kv`."""
        path = self.prefill_attention
        return PagedPrefill(kv, start, new, bf16=path == "native bfloat16",
                            torch_bf16=path == "torch bfloat16")  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def layout(self) -> BlockLayout:
        """The byte layout of this model's KV block objects in the store."""
        s = self.spec
        return BlockLayout(s.layers, s.kv_heads, s.head_dim, self.pool.dtype)

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

    def block_keys(
        self, tokens: Sequence[int], namespace: str = DEFAULT_CACHE_NAMESPACE
    ) -> list[str]:
        """The chained keys of `tokens`' whole blocks in a request's cache `namespace`
        (`hashing.cache_namespace`; the default tenant's own by default)."""
        return request_keys(
            tokens, self.block_tokens, seed=self.hash_seed, model_id=self.model_id,
            namespace=namespace,
        )  # fmt: skip

    def new_kv(self) -> PagedKV:
        return self.pool.sequence()

    @torch.inference_mode()
    def prefix_from_blocks(self, blocks: Sequence[Tensor]) -> PagedKV:
        """A sequence KV from consecutive blocks [layers, 2, kv_heads, T, head_dim] (any
        dtype or device) copied into pages of the pool: whole blocks of `block_tokens`,
        the last one may be a partial tail (a prompt's KV as the store holds it)."""
        s = self.spec
        for i, b in enumerate(blocks):
            is_whole = b.dim() == 5 and b.shape[3] == self.block_tokens
            if not is_whole and (i < len(blocks) - 1 or b.dim() != 5 or b.shape[3] < 1):
                raise EngineError(f"a cached block must hold {self.block_tokens} tokens")
            got = (b.shape[0], b.shape[1], b.shape[2], b.shape[4])
            if got != (s.layers, 2, s.kv_heads, s.head_dim):
                raise EngineError(f"KV block shape {tuple(b.shape)} does not fit this model")
        kv = self.new_kv()
        tokens = sum(b.shape[3] for b in blocks)
        if not kv.reserve(tokens):
            raise KVPoolExhausted(f"no room for {tokens} tokens of KV")
        per = self.block_tokens // self.pool.page_tokens
        table = kv.table()
        for j, b in enumerate(blocks):  # one block at a time: no second copy of the prompt
            if b.shape[3] == self.block_tokens:
                self.pool.write_layers(table[j * per : (j + 1) * per], b[:, None])
                continue
            for layer in range(s.layers):  # the partial tail
                kv.load_layer(layer, j * self.block_tokens, b[layer])
        kv.length = tokens
        return kv

    def blocks(self, kv: PagedKV) -> list[Tensor]:
        """The whole blocks of a sequence's KV, in order, as [layers, 2, kv_heads, T,
        head_dim] tensors (to store under `block_keys`)."""
        n = kv.length // self.block_tokens
        if not n:
            return []
        pages = kv.table()[: n * (self.block_tokens // self.pool.page_tokens)]
        per_layer = [
            self.pool.read_blocks(i, pages, self.block_tokens) for i in range(self.spec.layers)
        ]
        stacked = torch.stack(per_layer)  # [layers, n, 2, heads, T, dim]
        return [stacked[:, j] for j in range(n)]

    @torch.inference_mode()
    def prefill(
        self,
        tokens: Sequence[int],
        prefix: PagedKV | None = None,
        hooks: LayerHooks = NO_HOOKS,
        all_logits: bool = False,
    ) -> Prefilled:
        """Compute the KV of `tokens` not covered by `prefix` (the KV of the first k tokens,
        k < len(tokens); it becomes the result's KV). With layer-wise loading, `prefix` may
        still be filling: layer i of it is read only after `hooks.before_layer(i)` returns.
        KVPoolExhausted if the pool cannot give the pages (callers ask `pool.fits` first)."""
        tokens = [int(t) for t in tokens]
        self.check_tokens(tokens)
        start = 0 if prefix is None else prefix.length
        if start >= len(tokens):
            raise EngineError(
                f"a prefix must be shorter than the prompt ({start} cached tokens, "
                f"{len(tokens)} in the prompt)"
            )
        kv = prefix if prefix is not None else self.new_kv()
        if not kv.reserve(len(tokens)):
            raise KVPoolExhausted(f"no room for a prompt of {len(tokens)} tokens")
        new = tokens[start:]
        ids = torch.tensor([new], device=self.device)
        positions = torch.arange(start, len(tokens), device=self.device)[None]
        backend = self.prefill_backend(kv, start, len(new))
        with self.turns.turn(), compute_heap():
            logits = self.model(
                ids, positions, backend, TurnHooks(hooks, self.turns), last_only=not all_logits
            )[0]
        kv.length = len(tokens)
        return Prefilled(tokens=tokens, kv=kv, logits=logits, cached_tokens=start)

    def usable_cached_blocks(self, prompt_tokens: int, cached_blocks: int) -> int:
        """How many of the cached leading blocks prefill can use: at least one prompt token
        must be computed to get logits."""
        return max(0, min(cached_blocks, (prompt_tokens - 1) // self.block_tokens))
