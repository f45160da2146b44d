"""A request against the model's context, decided before any work (`core.ingress.fit_context`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mooncake.core.ingress import fit_context
from mooncake.events import RejectReason


def test_the_three_outcomes_with_their_numbers() -> None:
    assert fit_context(100, 28, 128, max_tokens_given=True) == 28  # exactly fills it
    reason, detail = fit_context(128, 1, 128, max_tokens_given=False)  # type: ignore[misc]
    assert reason is RejectReason.PROMPT_TOO_LONG
    assert "128 tokens" in detail and "at most 127 tokens" in detail
    reason, detail = fit_context(100, 29, 128, max_tokens_given=True)  # type: ignore[misc]
    assert reason is RejectReason.MAX_TOKENS_TOO_LARGE
    assert "129" in detail and "at most 28 tokens" in detail
    assert fit_context(100, 29, 128, max_tokens_given=False) == 28  # a default is cut to fit


@given(
    prompt=st.integers(1, 10_000),
    max_tokens=st.integers(1, 1_000_000),
    context=st.integers(16, 10_000),
    given_=st.booleans(),
)
def test_what_runs_fits_and_only_what_cannot_is_refused(
    prompt: int, max_tokens: int, context: int, given_: bool
) -> None:
    out = fit_context(prompt, max_tokens, context, max_tokens_given=given_)
    if isinstance(out, int):
        assert 1 <= out <= max_tokens and prompt + out <= context
        assert out == max_tokens or not given_  # only a default is ever changed
    else:
        reason, detail = out
        assert detail
        if reason is RejectReason.PROMPT_TOO_LONG:
            assert prompt >= context
        else:
            assert reason is RejectReason.MAX_TOKENS_TOO_LARGE
            assert given_ and prompt < context < prompt + max_tokens
