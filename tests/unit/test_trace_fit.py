"""Fitting trace prompts to a model's context: every fitted prompt fits with its output, keeps
a prefix of the request's hash ids (prefix sharing survives), stays a valid trace request,
and a request that fits is left alone."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from mooncake.replay_live import LiveReplayOptions, fitted_trace
from mooncake.trace import TRACE_BLOCK_TOKENS, TraceRequest, dump_line
from mooncake.trace_fit import FitMode, fit_request, fit_trace, prompt_tokens


def request(length: int, first_id: int = 0) -> TraceRequest:
    blocks = math.ceil(length / TRACE_BLOCK_TOKENS)
    return TraceRequest(0, 0.0, length, 100, tuple(range(first_id, first_id + blocks)))


@given(
    length=st.integers(1, 130_000),
    room=st.integers(1, 9000),
    per_block=st.sampled_from([16, 64, 512]),
    mode=st.sampled_from(list(FitMode)),
)
def test_a_fitted_prompt_fits_and_keeps_a_prefix_of_its_hash_ids(
    length: int, room: int, per_block: int, mode: FitMode
) -> None:
    req = request(length)
    fitted = fit_request(req, room_tokens=room, tokens_per_block=per_block, mode=mode)
    fits = prompt_tokens(length, per_block) <= room
    if fits:
        assert fitted is req
        return
    if mode is FitMode.SKIP or room * TRACE_BLOCK_TOKENS // per_block < 1:
        assert fitted is None
        return
    assert fitted is not None
    assert 1 <= prompt_tokens(fitted.input_length, per_block) <= room
    assert fitted.hash_ids == req.hash_ids[: len(fitted.hash_ids)]
    assert len(fitted.hash_ids) == math.ceil(fitted.input_length / TRACE_BLOCK_TOKENS)
    if mode is FitMode.TRUNCATE:  # fills the room (in trace tokens)
        assert fitted.input_length == room * TRACE_BLOCK_TOKENS // per_block


def test_scale_shrinks_blocks_and_length_by_one_factor() -> None:
    req = request(10_426)  # 21 blocks, the last one 186/512 full
    fitted = fit_request(req, room_tokens=8160, tokens_per_block=512, mode=FitMode.SCALE)
    assert fitted is not None
    # 21 * 8160 / 10426 -> 16 blocks; the length by 16/21: 7943 tokens (last block 263/512)
    assert len(fitted.hash_ids) == 16 and fitted.input_length == 7943
    truncated = fit_request(req, room_tokens=8160, tokens_per_block=512, mode=FitMode.TRUNCATE)
    assert truncated is not None and truncated.input_length == 8160


def test_fit_trace_counts_what_it_changed_and_skipped() -> None:
    trace = [request(1000), request(20_000, 100), request(9000, 200)]
    out = fit_trace(
        trace, context_tokens=8192, max_tokens=lambda r: 32, tokens_per_block=512,
        mode=FitMode.SKIP,
    )  # fmt: skip
    assert [r.input_length for r in out.requests] == [1000] and out.skipped == 2
    out = fit_trace(trace, context_tokens=8192, max_tokens=lambda r: 32, tokens_per_block=512)
    assert out.changed == 2 and out.skipped == 0 and len(out.requests) == 3
    assert out.summary() == {"mode": "scale", "context_tokens": 8192, "changed": 2, "skipped": 0}


def test_replay_fits_to_the_context_it_is_given(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(dump_line(r) for r in [request(1000), request(20_000, 100)]))
    opts = LiveReplayOptions(path, tokens_per_block=512, max_output_tokens=32)
    trace, fitted = fitted_trace(opts)
    assert fitted is None and [r.input_length for r in trace] == [1000, 20_000]
    trace, fitted = fitted_trace(LiveReplayOptions(path, tokens_per_block=512, context_tokens=8192))
    assert fitted is not None and fitted["changed"] == 1
    assert all(prompt_tokens(r.input_length, 512) + 32 <= 8192 for r in trace)
