"""Load a LLaMA-family Hugging Face model directory: config.json -> ModelSpec,
*.safetensors (one file or shards) -> Decoder weights, tokenizer.json (when present) ->
ChatTokenizer.

Hugging Face checkpoints store q and k in the "rotate half" layout the decoder uses, so
weights load as they are (no un-permutation, unlike GGUF). Supported RoPE scaling: none and
linear; others (llama3, yarn, dynamic) are refused with an EngineError rather than run wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mooncake.engine.errors import EngineError
from mooncake.engine.model import Decoder
from mooncake.engine.spec import ModelSpec, RopeScaling
from mooncake.engine.tokenizer import ChatTokenizer

ARCHS = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


@dataclass(frozen=True)
class HFModel:
    model: Decoder
    tokenizer: ChatTokenizer | None  # None when the directory has no tokenizer.json
    name: str


def hf_name(ours: str) -> str:
    """Our state-dict name -> the Hugging Face one (the inverse of the loader's mapping)."""
    for theirs, mine in GLOBAL_NAMES.items():
        if ours == mine:
            return theirs
    m = re.match(r"^layers\.(\d+)\.(\w+)\.weight$", ours)
    inverse = {v: k for k, v in LAYER_NAMES.items()}
    if not m or m.group(2) not in inverse:
        raise EngineError(f"no Hugging Face name for {ours}")
    return f"model.layers.{m.group(1)}.{inverse[m.group(2)]}.weight"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"cannot read {path}: {e}") from e
    if not isinstance(doc, dict):
        raise EngineError(f"{path} is not a JSON object")
    return doc


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") not in MODEL_TYPES and not set(archs) & set(ARCHS):
        raise EngineError(
            f"unsupported model (model_type {cfg.get('model_type')!r}, architectures {archs})"
        )
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim")
        if head_dim is not None and int(head_dim) != hidden // heads:
            raise EngineError(f"head_dim {head_dim} != hidden_size / heads is unsupported")
        # transformers >= 5 nests RoPE settings in rope_parameters; older configs do not.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear"):
            raise EngineError(f"unsupported RoPE scaling {kind!r}")
        factor = float(rope.get("factor", 1.0)) if kind == "linear" else 1.0
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return ModelSpec(
            vocab_size=int(cfg["vocab_size"]),
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            ffn=int(cfg["intermediate_size"]),
            context=int(cfg.get("max_position_embeddings", 2048)),
            rope_base=float(theta),
            rope_scaling=RopeScaling(factor=factor),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise EngineError(f"config.json lacks {e.args[0]}") from e
    except (TypeError, ValueError) as e:
        raise EngineError(f"bad value in config.json: {e}") from e


def _target_name(name: str, spec: ModelSpec) -> str | None:
    if name in GLOBAL_NAMES:
        if name == "lm_head.weight" and spec.tied_embeddings:
            return None  # some tied checkpoints still carry a copy: the embedding wins
        return GLOBAL_NAMES[name]
    m = LAYER_RE.match(name)
    if m and m.group(2) in LAYER_NAMES and int(m.group(1)) < spec.layers:
        return f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.weight"
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a derived buffer older checkpoints saved
    raise EngineError(f"unexpected tensor {name} in the checkpoint")


def _state_dict(files: list[Path], spec: ModelSpec) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError, ValueError) as e:
            raise EngineError(f"cannot read {f}: {e}") from e
        for name, t in tensors.items():
            target = _target_name(name, spec)
            if target is not None:
                state[target] = t.float()
    return state


def _tokenizer(directory: Path, cfg: dict[str, Any]) -> ChatTokenizer | None:
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a plain Exception
        raise EngineError(f"cannot read {path}: {e}") from e
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = _read_json(tcfg_path) if tcfg_path.is_file() else {}
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        text = tcfg.get("eos_token")
        text = text.get("content") if isinstance(text, dict) else text
        eos = tok.token_to_id(text) if isinstance(text, str) else None
    if eos is None:
        raise EngineError(f"{directory} names no EOS token (config.json or tokenizer_config)")
    template = tcfg.get("chat_template")
    return ChatTokenizer(
        tok,
        eos_id=int(eos),
        template=template if isinstance(template, str) else None,
        special_tokens=special,
    )


def load_hf(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> HFModel:
    """Read and validate a Hugging Face LLaMA directory; every failure is an EngineError."""
    d = Path(directory)
    if not d.is_dir():
        raise EngineError(f"no model directory at {d}")
    cfg = _read_json(d / "config.json")
    spec = spec_from_config(cfg)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{d} holds no .safetensors file")
    state = _state_dict(files, spec)
    model = Decoder(spec)
    expected = model.state_dict()
    missing = set(expected) - set(state) - {"rope_freq_factors"}
    if missing:
        raise EngineError(f"checkpoint lacks tensors: {sorted(missing)[:5]}")
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise EngineError(
                f"tensor for {name} has shape {tuple(value.shape)}, not "
                f"{tuple(expected[name].shape)}"
            )
        if not torch.isfinite(value).all():
            raise EngineError(f"tensor {name} has non-finite values (corrupt checkpoint?)")
    model.load_state_dict(state, strict=False)
    model = model.to(device=device, dtype=dtype).eval()
    model.rope_freq_factors = model.rope_freq_factors.float()  # keep RoPE math in float32
    name = str(cfg.get("_name_or_path") or d.name)
    return HFModel(model=model, tokenizer=_tokenizer(d, cfg), name=name)
