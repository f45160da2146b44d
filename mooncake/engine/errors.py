"""The one error type the engine raises for bad input or bad model files."""

from __future__ import annotations


class EngineError(ValueError):
    """Bad input (empty prompt, too long, unknown token ids, bad sampling parameters) or an
    unreadable model file. Callers (workers) catch this one type and fail the request, never
    the process."""
