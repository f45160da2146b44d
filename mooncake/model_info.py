"""The shape and tokenizer of the model the engine workers run, read without building an engine.

Tools that drive the live system (`mooncake replay`, `mooncake bench memory`) need the
model's vocabulary (to make token ids) and its context (to fit prompts to it), and the bench
its KV bytes per token; the Conductor needs the tokenizer (text prompts) and the context (to
reject a prompt that cannot fit before any work); the gateway needs the tokenizer. Loading the
weights for that would take seconds and hundreds of MiB: a GGUF model's header says it all, and
the dummy model's shape is in the settings. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.config import EngineSettings, Settings
from mooncake.engine.spec import ModelSpec
from mooncake.engine.tokenizer import ChatTokenizer, tokenizer_from_gguf


@dataclass(frozen=True)
class ModelHeader:
    """What a GGUF header (or the dummy model's settings) says: the spec and the tokenizer
    (None for the dummy model, which takes token ids only)."""

    spec: ModelSpec
    tokenizer: ChatTokenizer | None


def dummy_spec(s: EngineSettings) -> ModelSpec:
    d = s.dummy
    return ModelSpec(d.vocab, d.hidden, d.layers, d.heads, d.kv_heads, d.ffn, d.context)


def model_header(engine: EngineSettings) -> ModelHeader:
    """The configured model's header (EngineError for a missing or unreadable GGUF file)."""
    if engine.model == "dummy":
        return ModelHeader(dummy_spec(engine), None)
    from mooncake.engine.gguf_meta import open_gguf, smollm2_path, spec_from_gguf

    reader = open_gguf(engine.gguf_path or smollm2_path())
    fields = dict(reader.fields)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return ModelHeader(spec_from_gguf(fields, has_output), tokenizer_from_gguf(fields))


def model_spec(engine: EngineSettings) -> ModelSpec:
    """The configured model's spec (EngineError for a missing or unreadable GGUF file)."""
    return model_header(engine).spec


def build_tokenizer(settings: Settings) -> ChatTokenizer | None:
    """Only the tokenizer; None for the dummy model."""
    return model_header(settings.engine).tokenizer
