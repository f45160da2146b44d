"""The Hugging Face directory loader: a tiny random LLaMA written as config.json +
safetensors (HF names) loads back to the same logits, and transformers reads the same
directory to the same logits (so the name mapping is the real one, not just self-consistent).

Tolerance: our reload has bit-identical weights and runs the same code, so logits must be
equal; transformers runs float32 with its own op order, so 1e-4 on logits of O(1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mooncake.engine import Engine, EngineError, ModelSpec, dummy_model
from mooncake.engine.hf_loader import hf_name, load_hf

SPEC = ModelSpec(
    vocab_size=97, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, context=128,
    rope_base=5000.0, rms_eps=1e-5, tied_embeddings=False,
)  # fmt: skip


def write_checkpoint(directory: Path, spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    model = dummy_model(spec, seed=seed, std=0.2)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms off 1.0, so swapping two of them would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    state = {
        hf_name(k): v.detach().clone().contiguous()
        for k, v in model.state_dict().items()
        if k != "rope_freq_factors"
    }
    save_file(state, str(directory / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "intermediate_size": spec.ffn,
        "max_position_embeddings": spec.context,
        "rope_theta": spec.rope_base,
        "rms_norm_eps": spec.rms_eps,
        "tie_word_embeddings": spec.tied_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return model


def test_roundtrip_identical_logits_and_transformers_agrees(tmp_path: Path) -> None:
    original = write_checkpoint(tmp_path, SPEC)
    loaded = load_hf(tmp_path)
    assert loaded.model.spec == SPEC and loaded.tokenizer is None
    tokens = [int(t) for t in torch.randint(0, SPEC.vocab_size, (23,))]
    ours = Engine(loaded.model).prefill(tokens, all_logits=True).logits
    again = Engine(original).prefill(tokens, all_logits=True).logits  # type: ignore[arg-type]
    assert torch.equal(ours, again)
    transformers = pytest.importorskip("transformers")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = ref(torch.tensor([tokens])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_tied_embeddings_and_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    spec = ModelSpec(vocab_size=8, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32, context=64)
    original = write_checkpoint(tmp_path, spec, seed=3)
    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world", "a", "b", "c", "d"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    loaded = load_hf(tmp_path)
    assert loaded.model.lm_head is None
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("hello world") == [1, 2]
    assert loaded.tokenizer.stop_ids == frozenset({7})
    tokens = [1, 2, 3, 4]
    ours = Engine(loaded.model).prefill(tokens).logits
    assert torch.equal(ours, Engine(original).prefill(tokens).logits)  # type: ignore[arg-type]


def test_bad_directories_raise_engine_errors(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no model directory"):
        load_hf(tmp_path / "missing")
    with pytest.raises(EngineError, match=r"config\.json"):
        load_hf(tmp_path)
    write_checkpoint(tmp_path, SPEC)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineError, match="cannot read"):
        load_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="RoPE scaling"):
        load_hf(tmp_path)
