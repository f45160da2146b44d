"""SmolLM2 against an independent implementation: Hugging Face transformers'
LlamaForCausalLM and tokenizer, loaded from the same GGUF file by transformers' own code
(its own metadata mapping and q/k un-permutation; eager attention, not SDPA).

Tolerance: both run float32 on the CPU from the same dequantized weights, so logits differ
only by summation order (eager vs SDPA attention, fused vs unfused ops). Over 30 layers that
is ~1e-5 relative; logits here are O(10-30), so 2e-3 absolute (about 100x float32 epsilon
times the logit scale, times depth) is tight enough to catch any real error (a wrong RoPE
layout, norm, or head grouping moves logits by O(1)) and loose enough for reordering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from mooncake.engine import Engine, SamplingParams, generate
from mooncake.engine.gguf_loader import LoadedModel, smollm2_path

ATOL = 2e-3

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference() -> tuple[object, object]:
    path = smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return tok, model.eval()


def test_tokenizer_matches_reference(smollm2: LoadedModel, reference: tuple[Any, Any]) -> None:
    ref_tok, _ = reference
    texts = ["Hello world 12345 it's", "  leading spaces\nand\ttabs", "héllo ünïcode 😀 <|im_end|>"]
    for text in texts:
        assert smollm2.tokenizer.encode(text) == ref_tok(text)["input_ids"], text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref_ids = ref_tok.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(ref_ids, list):
        ref_ids = ref_ids["input_ids"]
    assert smollm2.tokenizer.encode_chat(messages) == list(ref_ids)


def test_logits_match_reference(
    engine: Engine, reference: tuple[Any, Any], chat: Callable[[str], list[int]]
) -> None:
    _, ref_model = reference
    tokens = chat("Name three colours of the rainbow, please.")
    ours = engine.prefill(tokens, all_logits=True).logits
    with torch.inference_mode():
        theirs = ref_model(torch.tensor([tokens])).logits[0].float()
    assert ours.shape == theirs.shape
    print("max |logit difference|", (ours - theirs).abs().max().item())
    diff = (ours - theirs).abs().max().item()
    assert diff < ATOL, f"max |logit difference| {diff}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_answer_names_paris(engine: Engine, chat: Callable[[str], list[int]]) -> None:
    tokens = chat("What is the capital of France?")
    (out,) = generate(engine, [tokens], [SamplingParams(max_tokens=24)])
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"
