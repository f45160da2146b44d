"""Random "dummy" weights of any shape, for benchmarks (the paper evaluates a dummy LLaMA)."""

from __future__ import annotations

import torch

from mooncake.engine.model import Decoder
from mooncake.engine.spec import ModelSpec


def dummy_model(
    spec: ModelSpec,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
) -> Decoder:
    """A decoder with N(0, std) linear and embedding weights and unit norms, reproducible
    from `seed` (weights are drawn on the CPU so every device gets the same model)."""
    g = torch.Generator().manual_seed(seed)
    model = Decoder(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_freq_factors = model.rope_freq_factors.float()
    return model
