"""The model engine: a LLaMA-family decoder in torch, GGUF and dummy loaders, a tokenizer
rebuilt from GGUF, a paged KV pool per engine (block KV keyed by chained hashes),
prefix-reusing prefill with per-layer hooks, and continuous-batching decode."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mooncake.engine.batch import Completion, DecodeBatch, Preempted, generate
    from mooncake.engine.dummy import dummy_model
    from mooncake.engine.engine import Engine, Prefilled
    from mooncake.engine.errors import EngineError
    from mooncake.engine.kv import BlockLayout, block_from_bytes, block_to_bytes
    from mooncake.engine.model import Decoder, LayerHooks
    from mooncake.engine.pool import KVPool, KVPoolExhausted, PagedKV
    from mooncake.engine.sampling import SamplingParams
    from mooncake.engine.spec import ModelSpec, RopeScaling

# Where each name lives. Imported on first use (PEP 562): the tokenizer, the spec and the GGUF
# header (what the Conductor and the gateway need) load without torch.
_HOME = {
    "BlockLayout": "kv", "block_from_bytes": "kv", "block_to_bytes": "kv",
    "Completion": "batch", "DecodeBatch": "batch", "Preempted": "batch", "generate": "batch",
    "Decoder": "model", "LayerHooks": "model",
    "Engine": "engine", "Prefilled": "engine",
    "EngineError": "errors",
    "KVPool": "pool", "KVPoolExhausted": "pool", "PagedKV": "pool",
    "ModelSpec": "spec", "RopeScaling": "spec",
    "SamplingParams": "sampling",
    "dummy_model": "dummy",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BlockLayout",
    "Completion",
    "DecodeBatch",
    "Decoder",
    "Engine",
    "EngineError",
    "KVPool",
    "KVPoolExhausted",
    "LayerHooks",
    "ModelSpec",
    "PagedKV",
    "Preempted",
    "Prefilled",
    "RopeScaling",
    "SamplingParams",
    "block_from_bytes",
    "block_to_bytes",
    "dummy_model",
    "generate",
]
