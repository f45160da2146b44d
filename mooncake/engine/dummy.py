"""Random "dummy" weights of any shape, for benchmarks (the paper evaluates a dummy LLaMA),
and the shapes of the models `bench engine --shape` runs without a model file."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mooncake.engine.model import Decoder
from mooncake.engine.spec import ModelSpec

# The published configs' shapes (config.json of each model on the Hugging Face hub); the
# context is cut to 8,192 positions (what a benchmark's KV pool is sized for).
SHAPES: dict[str, ModelSpec] = {
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": ModelSpec(
        vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, context=8192,
        rope_base=100000.0, tied_embeddings=True,
    ),
    # meta-llama/Llama-3.2-1B (its LLaMA-3 RoPE frequency scaling left out: plain RoPE)
    "llama-1b": ModelSpec(
        vocab_size=128256, hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
        context=8192, rope_base=500000.0, tied_embeddings=True,
    ),
    # meta-llama/Llama-3.1-8B (likewise)
    "llama-8b": ModelSpec(
        vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
        context=8192, rope_base=500000.0, tied_embeddings=False,
    ),
}  # fmt: skip


def dummy_model(
    spec: ModelSpec,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
    on_device: bool = False,
) -> Decoder:
    """A decoder with N(0, std) linear and embedding weights and unit norms, reproducible
    from `seed`. The weights are drawn on the CPU, so every device gets the same model;
    with `on_device` they are made and drawn on `device` itself (an 8B shape's float32
    weights are 32 GB: too slow to draw and copy from the CPU), reproducible per device."""
    dev = torch.device(device)
    if on_device:
        g = torch.Generator(device=dev).manual_seed(seed)
        with torch.device(dev):
            model = Decoder(spec)
        _fill(model, lambda p: p.normal_(0.0, std, generator=g))
    else:
        g = torch.Generator().manual_seed(seed)
        model = Decoder(spec)
        _fill(model, lambda p: p.copy_(torch.randn(p.shape, generator=g) * std))
    model = model.to(device=dev, dtype=dtype).eval()
    model.rope_freq_factors = model.rope_freq_factors.float()
    return model


def _fill(model: Decoder, draw: Callable[[torch.Tensor], object]) -> None:
    """Unit norms; every other parameter drawn by `draw`, in the model's parameter order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                draw(p)
