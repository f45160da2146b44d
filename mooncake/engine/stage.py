"""One stage of a chunked-pipeline prefill (CPP, `core.cpp`): a layer range of the model,
applied to one chunk of a prompt at a time.

Stage 0 embeds the chunk's token ids; every later stage takes the hidden state the stage
before it produced for the same chunk. Each stage keeps, in its engine's KV pool, the KV of
its own layers for every chunk it has run, so chunk k attends over chunks 0..k-1 without any
KV crossing between stages. The last stage returns the last position's logits with the last
chunk; every other call returns the chunk's hidden state [1, tokens, hidden] for the next
stage. The math is the engine's own prefill (`Decoder.run_layers`, `PagedPrefill`), cut in
chunks and layer ranges: a CPP prefill equals a single prefill to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mooncake.engine.engine import Engine
from mooncake.engine.errors import EngineError
from mooncake.engine.pool import KVPoolExhausted, PagedKV
from mooncake.memory import compute_heap


@torch.inference_mode()
def run_chunk(
    engine: Engine,
    kv: PagedKV,
    layers: tuple[int, int],
    start: int,
    chunk: Sequence[int] | Tensor,
    *,
    logits: bool = False,
) -> Tensor:
    """Positions `start`.. of the sequence whose KV (for `layers`) is `kv`: `chunk` is token
    ids on the stage that holds layer 0, else the previous stage's hidden state. With
    `logits` (the last stage, the last chunk) the last position's logits [V]."""
    first, end = layers
    model = engine.model
    if not 0 <= first < end <= len(model.layers):
        raise EngineError(f"layers {first}..{end} are not a range of this model's layers")
    if start != kv.length:
        raise EngineError(f"chunk at {start} does not follow the {kv.length} positions held")
    if logits and end != len(model.layers):
        raise EngineError("only the stage that holds the last layer has logits")
    if first == 0:
        if isinstance(chunk, Tensor):
            raise EngineError("the first stage takes token ids")
        engine.check_tokens(list(chunk), extra=start)
        x = model.embed_tokens(torch.tensor([list(chunk)], device=engine.device))
    else:
        if not isinstance(chunk, Tensor):
            raise EngineError("a later stage takes the previous stage's hidden state")
        x = chunk.to(device=engine.device, dtype=model.dtype)
    n = x.shape[1]
    if not kv.reserve(start + n):
        raise KVPoolExhausted(f"no room for {start + n} positions of KV")
    positions = torch.arange(start, start + n, device=engine.device)[None]
    with compute_heap():
        x = model.run_layers(x, positions, engine.prefill_backend(kv, start, n), range(first, end),
                             last_only=logits)  # fmt: skip
    kv.length = start + n
    return model.logits(x[:, -1])[0] if logits else x
