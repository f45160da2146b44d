"""Building the engine and tokenizer a worker runs, from settings (one place for all roles)."""

from __future__ import annotations

import torch

from mooncake import events as ev
from mooncake.config import EngineSettings, Settings
from mooncake.engine import Engine, ModelSpec, dummy_model
from mooncake.engine import SamplingParams as EngineSampling
from mooncake.engine.tokenizer import ChatTokenizer


def dummy_spec(s: EngineSettings) -> ModelSpec:
    d = s.dummy
    return ModelSpec(d.vocab, d.hidden, d.layers, d.heads, d.kv_heads, d.ffn, d.context)


def build_engine(settings: Settings) -> Engine:
    """The configured model on the configured device (EngineError on a bad model file)."""
    s = settings.engine
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    if s.model == "dummy":
        model, tokenizer = dummy_model(dummy_spec(s), device=s.device), None
    else:
        from mooncake.engine.gguf_loader import load_gguf, smollm2_path

        loaded = load_gguf(s.gguf_path or smollm2_path(), device=s.device)
        model, tokenizer = loaded.model, loaded.tokenizer
    return Engine(
        model,
        tokenizer,
        block_tokens=settings.block_tokens,
        hash_seed=settings.hash_seed,
        model_id=settings.model_id,
    )


def build_tokenizer(settings: Settings) -> ChatTokenizer | None:
    """Only the tokenizer (the Conductor turns prompts into tokens and block keys); None for
    the dummy model, which takes token ids only."""
    s = settings.engine
    if s.model == "dummy":
        return None
    from mooncake.engine.gguf_loader import open_gguf, smollm2_path
    from mooncake.engine.tokenizer import tokenizer_from_gguf

    reader = open_gguf(s.gguf_path or smollm2_path())
    return tokenizer_from_gguf(dict(reader.fields))


def engine_params(p: ev.SamplingParams) -> EngineSampling:
    """A request's sampling parameters as the engine takes them."""
    return EngineSampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
    )
