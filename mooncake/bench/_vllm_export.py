"""Write a GGUF model out as a bfloat16 Hugging Face directory, for vLLM (no GGUF loader).

Runs under the anchors interpreter (`.venv-anchors`), where mooncake is not installed: this
file imports only the standard library, torch and transformers (which needs `gguf`).

    python _vllm_export.py MODEL.gguf OUT_DIR MARKER_NAME

The marker file is written last, so its presence means the export finished.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _drop_gguf_quantizer(model: Any) -> None:
    """Detach transformers' GGUF quantizer once every weight is a plain dense tensor.

    transformers 5 keeps a `GgufHfQuantizer` on a model loaded from GGUF even when it has
    dequantized every weight (no GGUF matmul kernel on this CPU), and `save_pretrained` then
    refuses ("not serializable"). With no packed module left, the model is an ordinary dense one.
    """
    import torch

    packed = [n for n, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
    odd = [n for n, p in model.named_parameters() if not torch.is_floating_point(p)]
    if packed or odd:
        raise RuntimeError(f"weights still packed after loading: {(packed + odd)[:5]}")
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except AttributeError:
                pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_roundtrip(model: Any, tok: Any, out_dir: Path) -> float:
    """Reload the written directory as plain safetensors and compare logits with the source."""
    import torch
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a = model(ids).logits.float()
        b = again(ids).logits.float()
    diff = float((a - b).abs().max())
    if diff > 1e-3:
        raise RuntimeError(f"exported model disagrees with the GGUF one: max logit diff {diff}")
    return diff


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: _vllm_export.py MODEL.gguf OUT_DIR MARKER_NAME", file=sys.stderr)
        return 2
    gguf, out_dir, marker = Path(argv[0]), Path(argv[1]), argv[2]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    src, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if not getattr(tok, "chat_template", None):
        print(f"warning: {name} carries no chat template", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
    _drop_gguf_quantizer(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    max_diff = _check_roundtrip(model, tok, out_dir)
    info = {
        "gguf": str(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "dtype": "bfloat16",
        "params": sum(p.numel() for p in model.parameters()),
        "chat_template": bool(getattr(tok, "chat_template", None)),
        "roundtrip_max_logit_diff": max_diff,
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out_dir / marker).write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
