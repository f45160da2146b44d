"""Continuous batching and sampling on SmolLM2."""

from __future__ import annotations

from collections.abc import Callable

from mooncake.engine import Completion, DecodeBatch, Engine, SamplingParams, generate

PROMPTS = [
    "What is the capital of France?",
    "Count from one to five.",
    "Give me a very long and detailed explanation of why the sky is blue during the day.",
    "Hi",
]
GREEDY = SamplingParams(max_tokens=12, stop_on_eos=False)


def test_batched_greedy_matches_each_alone(
    engine: Engine, chat: Callable[[str], list[int]]
) -> None:
    prompts = [chat(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    alone = [generate(engine, [p], [GREEDY])[0].tokens for p in prompts]
    # Continuous batching: sequences join at different steps and leave at different steps.
    batch = DecodeBatch(engine)
    done: dict[str, Completion] = {}
    limits = [12, 5, 12, 8]
    for step in range(30):
        if step < len(prompts):
            params = SamplingParams(max_tokens=limits[step], stop_on_eos=False)
            batch.add(str(step), engine.prefill(prompts[step]), params)
        done.update((c.id, c) for c in batch.step())
        if not len(batch) and step >= len(prompts):
            break
    assert sorted(done) == ["0", "1", "2", "3"]
    for i, tokens in enumerate(alone):
        assert done[str(i)].tokens == tokens[: limits[i]], i
        assert done[str(i)].finish_reason == "length"


def test_sampling_is_seeded_and_filters(engine: Engine, chat: Callable[[str], list[int]]) -> None:
    prompt = chat("Tell me a story.")
    hot = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, stop_on_eos=False)
    a, b = generate(engine, [prompt, prompt], [hot, hot])
    assert a.tokens == b.tokens  # same seed, same tokens, even within one batch
    other = SamplingParams(max_tokens=8, temperature=1.5, seed=8, stop_on_eos=False)
    (c,) = generate(engine, [prompt], [other])
    assert c.tokens != a.tokens
    top1 = SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=3, stop_on_eos=False)
    (g,) = generate(engine, [prompt], [SamplingParams(max_tokens=8, stop_on_eos=False)])
    assert generate(engine, [prompt], [top1])[0].tokens == g.tokens


def test_stop_strings_tokens_and_max_tokens(
    engine: Engine, chat: Callable[[str], list[int]]
) -> None:
    prompt = chat("What is the capital of France?")
    (full,) = generate(engine, [prompt], [SamplingParams(max_tokens=24)])
    assert full.finish_reason == "stop" and "Paris" in full.text
    (cut,) = generate(engine, [prompt], [SamplingParams(max_tokens=24, stop=("Paris",))])
    assert cut.finish_reason == "stop" and "Paris" not in cut.text
    assert full.text.startswith(cut.text)
    stop_id = full.tokens[2]
    (by_id,) = generate(engine, [prompt], [SamplingParams(stop_token_ids=(stop_id,))])
    assert by_id.tokens == full.tokens[:2] and by_id.finish_reason == "stop"
    (one,) = generate(engine, [prompt], [SamplingParams(max_tokens=1)])
    assert one.tokens == full.tokens[:1] and one.finish_reason == "length"
