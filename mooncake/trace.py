"""Mooncake request traces: where they are, loading, and hash id -> deterministic tokens.

The two FAST'25 traces (conversation, synthetic) ship with the package, gzipped, in
`data/traces` (data/README.md); `traces_dir` is the one place that decides which directory a
command reads them from: its `--traces`, else the `traces` setting (MOONCAKE_TRACES), else
the shipped one. Any trace file may be plain JSONL or gzipped (`.jsonl.gz`).

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
[...]}`; hash id i covers prompt tokens [512·i, 512·(i+1)) and ids are prefix-chained (a
shared id means a shared prefix). To drive a real model, each block's tokens are derived
from its hash id alone, so equal ids give equal tokens and the prefix structure survives.
Blocks may be scaled down (`tokens_per_block` < 512) to fit a CPU: the prefix structure is
kept, only the lengths shrink.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from mooncake.config import Settings

TRACE_BLOCK_TOKENS = 512
# The first 200 requests of the conversation trace, shipped in the package (data/README.md).
SHIPPED_CONVERSATION = Path(__file__).parent / "data" / "conversation_head.jsonl"
# The whole FAST'25 traces, gzipped, shipped in the package (data/README.md).
SHIPPED_TRACES = Path(__file__).parent / "data" / "traces"
# The traces a traces directory holds, each as NAME_trace.jsonl or NAME_trace.jsonl.gz.
TRACE_NAMES = ("conversation", "synthetic")
# A plain file is taken before a gzipped one of the same name: it is what someone who
# unpacked a trace there to edit it means.
_TRACE_SUFFIXES = (".jsonl", ".jsonl.gz")
_EXPECTED = (
    "a directory holding conversation_trace.jsonl and synthetic_trace.jsonl, "
    "each plain or gzipped as .jsonl.gz"
)


class TraceError(ValueError):
    """A trace file that cannot be read, with the line that broke it."""


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    timestamp: int = Field(ge=0)
    input_length: int = Field(ge=1)
    output_length: int = Field(ge=0)
    hash_ids: list[int] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _find(directory: Path, name: str) -> Path | None:
    """NAME_trace.jsonl, else NAME_trace.jsonl.gz, in `directory`; None where neither is."""
    for suffix in _TRACE_SUFFIXES:
        path = directory / f"{name}_trace{suffix}"
        if path.is_file():
            return path
    return None


def traces_dir(directory: Path | str | None = None, *, settings: Settings | None = None) -> Path:
    """The directory the traces are read from: `directory` (a command's --traces) where
    given, else `settings.traces` (MOONCAKE_TRACES) where set, else the copies shipped in
    the package. It is checked here, before anything is loaded: one that does not hold every
    trace of TRACE_NAMES is a TraceError naming it, where it came from and what it lacks,
    not a FileNotFoundError deep in a run."""
    if directory is not None:
        found, label = Path(directory), f"traces directory {directory}"
    elif settings is not None and settings.traces is not None:
        found, label = settings.traces, f"MOONCAKE_TRACES={settings.traces}"
    else:
        found, label = SHIPPED_TRACES, f"shipped traces directory {SHIPPED_TRACES}"
    if not found.is_dir():
        raise TraceError(f"{label}: not a directory (expected {_EXPECTED})")
    missing = [f"{n}_trace.jsonl[.gz]" for n in TRACE_NAMES if _find(found, n) is None]
    if missing:
        raise TraceError(f"{label}: no {' and no '.join(missing)} there (expected {_EXPECTED})")
    return found


def trace_path(
    name: str, directory: Path | str | None = None, *, settings: Settings | None = None
) -> Path:
    """The file of trace `name` (one of TRACE_NAMES) in `traces_dir(directory, settings)`."""
    path = _find(traces_dir(directory, settings=settings), name)
    if path is None:
        raise TraceError(f"no trace named {name!r}; one of {', '.join(TRACE_NAMES)}")
    return path


def _open_text(path: Path | str) -> TextIO:
    """A trace file as text, gunzipped on the fly where its name ends in .gz (the shipped
    traces are gzipped: a quarter of the size)."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_trace(path: Path | str, *, limit: int | None = None) -> Iterator[TraceRequest]:
    """Validated requests in file order (a .gz file gunzipped); a bad line raises TraceError
    naming it, as does a gzipped file that is cut short or not gzip at all."""
    try:
        yield from _iter_lines(path, limit)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise TraceError(f"{path}: not a whole gzip file ({exc})") from exc


def _iter_lines(path: Path | str, limit: int | None) -> Iterator[TraceRequest]:
    with _open_text(path) as fh:
        for lineno, raw in enumerate(fh, start=1):
            if limit is not None and lineno > limit:
                return
            if not raw.strip():
                continue
            try:
                line = _Line.model_validate_json(raw)
            except ValidationError as exc:
                raise TraceError(f"{path}:{lineno}: {exc.errors()[0]['msg']}") from exc
            if len(line.hash_ids) != math.ceil(line.input_length / TRACE_BLOCK_TOKENS):
                raise TraceError(
                    f"{path}:{lineno}: {len(line.hash_ids)} hash ids for "
                    f"{line.input_length} tokens (expected one per {TRACE_BLOCK_TOKENS})"
                )
            yield TraceRequest(
                lineno - 1,
                line.timestamp / 1000.0,
                line.input_length,
                line.output_length,
                tuple(line.hash_ids),
            )


def load_trace(path: Path | str, *, limit: int | None = None) -> list[TraceRequest]:
    return list(iter_trace(path, limit=limit))


def block_tokens(hash_id: int, tokens_per_block: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """The tokens of one block, a pure function of (seed, hash id)."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, hash_id])
    return rng.integers(0, vocab_size, size=tokens_per_block, dtype=np.int64)


def request_tokens(
    req: TraceRequest,
    *,
    vocab_size: int,
    tokens_per_block: int = TRACE_BLOCK_TOKENS,
    seed: int = 0,
) -> list[int]:
    """The request's prompt: its blocks' tokens, the last one cut to the (scaled) length."""
    length = math.ceil(req.input_length * tokens_per_block / TRACE_BLOCK_TOKENS)
    blocks = [block_tokens(h, tokens_per_block, vocab_size, seed) for h in req.hash_ids]
    return [int(t) for t in np.concatenate(blocks)[:length]]


def reuse_ratio(
    requests: list[TraceRequest],
    capacity_blocks: int | None = None,
    *,
    partial_blocks: bool = False,
) -> float:
    """Share of input tokens that are a cached prefix under one global LRU pool of
    `capacity_blocks` blocks (None: unbounded). Only whole blocks are reused (the paper's
    rule) unless `partial_blocks`, which also counts a hit on the trailing partial block
    (how the traces' README measured it)."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    reused = total = 0
    for r in requests:
        total += r.input_length
        hit = 0
        for h in r.hash_ids:
            if h not in cache:
                break
            hit += 1
        if partial_blocks:
            reused += min(hit * TRACE_BLOCK_TOKENS, r.input_length)
        else:
            reused += min(hit, r.input_length // TRACE_BLOCK_TOKENS) * TRACE_BLOCK_TOKENS
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return reused / total if total else 0.0


def dump_line(req: TraceRequest) -> str:
    return json.dumps(
        {
            "timestamp": round(req.arrival_s * 1000),
            "input_length": req.input_length,
            "output_length": req.output_length,
            "hash_ids": list(req.hash_ids),
        }
    )
