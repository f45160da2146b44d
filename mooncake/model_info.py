"""The shape of the model the engine workers run, read without building an engine.

Tools that drive the live system (`mooncake replay`, `mooncake bench memory`) need the
model's vocabulary (to make token ids) and its context (to fit prompts to it), and the bench
its KV bytes per token; loading the weights for that would take seconds and hundreds of
MiB. A GGUF model's header says it all; the dummy model's shape is in the settings.
"""

from __future__ import annotations

from mooncake.config import EngineSettings
from mooncake.engine.spec import ModelSpec


def model_spec(engine: EngineSettings) -> ModelSpec:
    """The configured model's spec (EngineError for a missing or unreadable GGUF file)."""
    if engine.model == "dummy":
        from mooncake.serving.models import dummy_spec

        return dummy_spec(engine)
    from mooncake.engine.gguf_loader import open_gguf, smollm2_path, spec_from_gguf

    reader = open_gguf(engine.gguf_path or smollm2_path())
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return spec_from_gguf(dict(reader.fields), has_output)
