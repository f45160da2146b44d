"""Load a LLaMA-family GGUF file: metadata -> ModelSpec, tensors -> Decoder weights (Q4_0,
Q4_1 and Q8_0 matrices kept in their blocks on the CPU, `engine.quant`; the rest dequantized
with `gguf.quants.dequantize`), vocabulary -> ChatTokenizer.

llama.cpp's converter permutes the rows of q and k per head from the Hugging Face "rotate
half" layout (row c*D/2 + i, c in {0, 1}) to the interleaved layout (row 2i + c). The decoder
uses the rotate-half layout, so `unpermute_rows` puts the rows back on load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from mooncake.engine.errors import EngineError
from mooncake.engine.gguf_meta import meta, open_gguf, smollm2_path, spec_from_gguf
from mooncake.engine.model import Decoder
from mooncake.engine.quant import GGUF_TYPES, QuantWeight, from_gguf_blocks, permute_rows
from mooncake.engine.spec import ModelSpec
from mooncake.engine.tokenizer import ChatTokenizer, tokenizer_from_gguf

__all__ = ["LoadedModel", "load_gguf", "open_gguf", "smollm2_path", "spec_from_gguf"]

LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "q.weight",
    "attn_k": "k.weight",
    "attn_v": "v.weight",
    "attn_output": "o.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "gate.weight",
    "ffn_up": "up.weight",
    "ffn_down": "down.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class LoadedModel:
    model: Decoder
    tokenizer: ChatTokenizer
    name: str


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (see the module docstring)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    import gguf

    try:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return np.asarray(data, dtype=np.float32).reshape(shape)
    except Exception as e:
        raise EngineError(f"cannot dequantize GGUF tensor {tensor.name}: {e}") from e


def _target_name(name: str, spec: ModelSpec) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = LAYER_RE.match(name)
    if not m or m.group(2) not in LAYER_NAMES or int(m.group(1)) >= spec.layers:
        raise EngineError(f"unexpected GGUF tensor {name}")
    return f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"


def _row_order(name: str, rows: int, spec: ModelSpec) -> np.ndarray | None:
    """The row order that undoes the q/k interleaving, or None for other tensors."""
    if name.endswith(".attn_q.weight"):
        return unpermute_rows(np.arange(rows), spec.heads)
    if name.endswith(".attn_k.weight"):
        return unpermute_rows(np.arange(rows), spec.kv_heads)
    return None


def _quantized(reader: Any, spec: ModelSpec) -> dict[str, QuantWeight]:
    """The 2-D tensors of a type `engine.quant` keeps in blocks, by target name."""
    out: dict[str, QuantWeight] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GGUF_TYPES or len(tensor.shape) != 2:
            continue
        cols, rows = (int(d) for d in tensor.shape.tolist())
        w = from_gguf_blocks(tensor.tensor_type.name, tensor.data, (rows, cols))
        order = _row_order(tensor.name, rows, spec)
        out[_target_name(tensor.name, spec)] = w if order is None else permute_rows(w, order)
    return out


def _attach(model: Decoder, quant: dict[str, QuantWeight]) -> None:
    layers: list[dict[str, QuantWeight]] = [{} for _ in range(model.spec.layers)]
    for name, w in quant.items():
        if name.startswith("layers."):
            _, i, proj, _ = name.split(".")
            layers[int(i)][proj] = w
    model.use_quantized(layers, quant.get("embed.weight"), quant.get("lm_head.weight"))


def _state_dict(
    reader: Any, spec: ModelSpec, skip: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if _target_name(tensor.name, spec) in skip:
            continue
        w = _dequantize(tensor)
        if tensor.name.endswith(".attn_q.weight"):
            w = unpermute_rows(w, spec.heads)
        elif tensor.name.endswith(".attn_k.weight"):
            w = unpermute_rows(w, spec.kv_heads)
        w = np.ascontiguousarray(w)
        # Unquantized tensors are read-only views of the memory-mapped file: copy those.
        t = torch.from_numpy(w if w.flags.writeable else w.copy())
        if not torch.isfinite(t).all():
            raise EngineError(f"GGUF tensor {tensor.name} has non-finite values (corrupt file?)")
        state[_target_name(tensor.name, spec)] = t
    return state


def load_gguf(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: Literal["quantized", "float32"] = "quantized",
) -> LoadedModel:
    """Read and validate a GGUF model; every failure is an EngineError. With `quantized`
    weights on the CPU in float32, tensors of the types `engine.quant` handles (Q4_0, Q4_1,
    Q8_0) stay in their blocks; every other tensor (and every tensor elsewhere, or with
    `float32`) is dequantized."""
    reader = open_gguf(path)
    fields = dict(reader.fields)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    spec = spec_from_gguf(fields, has_output)
    keep = weights == "quantized" and torch.device(device).type == "cpu" and dtype == torch.float32
    quant = _quantized(reader, spec) if keep else {}
    state = _state_dict(reader, spec, frozenset(quant))
    model = Decoder(spec)
    for name, w in quant.items():
        have, want = (w.out_features, w.in_features), tuple(model.state_dict()[name].shape)
        if have != want:
            raise EngineError(f"GGUF tensor for {name} has shape {have}, not {want}")
    expected = set(model.state_dict())
    missing = expected - set(state) - set(quant) - {"rope_freq_factors"}
    if missing:
        raise EngineError(f"GGUF lacks tensors: {sorted(missing)[:5]}")
    for name, value in state.items():
        want = model.state_dict()[name].shape
        if value.shape != want:
            raise EngineError(f"GGUF tensor for {name} has shape {tuple(value.shape)}, not {want}")
    model.load_state_dict(state, strict=False)
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_freq_factors = model.rope_freq_factors.float()  # keep RoPE math in float32
    if quant:
        _attach(model, quant)
    name = str(meta(fields, "general.name", Path(path).stem))
    return LoadedModel(model=model, tokenizer=tokenizer_from_gguf(fields), name=name)
