"""The shape of a LLaMA-family model: everything the decoder needs besides its weights."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.engine.errors import EngineError


@dataclass(frozen=True)
class RopeScaling:
    """Linear RoPE scaling (positions divided by `factor`); 1.0 means none. Per-frequency
    factors (LLaMA 3 style, GGUF `rope_freqs.weight`) are carried as weights, not here."""

    factor: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int
    rope_base: float = 10000.0
    rope_dim: int | None = None  # rotary dims per head; None: the whole head
    rope_scaling: RopeScaling = RopeScaling()
    rms_eps: float = 1e-5
    tied_embeddings: bool = True

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn", "context")
        for name in positive:
            if getattr(self, name) < 1:
                raise EngineError(f"model spec: {name} must be positive")
        if self.hidden % self.heads:
            raise EngineError("model spec: hidden must be a multiple of heads")
        if self.heads % self.kv_heads:
            raise EngineError("model spec: heads must be a multiple of kv_heads (GQA)")
        if self.head_dim % 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise EngineError("model spec: rotary and head dims must be even, rotary <= head")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim if self.rope_dim is not None else self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """PAPER.md §2: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes
