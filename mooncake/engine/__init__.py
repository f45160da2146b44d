"""The model engine: a LLaMA-family decoder in torch, GGUF and dummy loaders, a tokenizer
rebuilt from GGUF, a paged KV pool per engine (block KV keyed by chained hashes),
prefix-reusing prefill with per-layer hooks, and continuous-batching decode."""

from mooncake.engine.batch import Completion, DecodeBatch, Preempted, generate
from mooncake.engine.dummy import dummy_model
from mooncake.engine.engine import Engine, Prefilled
from mooncake.engine.errors import EngineError
from mooncake.engine.kv import BlockLayout, block_from_bytes, block_to_bytes
from mooncake.engine.model import Decoder, LayerHooks
from mooncake.engine.pool import KVPool, KVPoolExhausted, PagedKV
from mooncake.engine.sampling import SamplingParams
from mooncake.engine.spec import ModelSpec, RopeScaling

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
