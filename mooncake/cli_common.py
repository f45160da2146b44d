"""What every `mooncake` sub-command shares: the consoles, settings, result printing."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Literal

import typer
from rich.console import Console
from rich.table import Table

from mooncake.config import Settings, load_settings, resolve_precision

console = Console()
err = Console(stderr=True)


def settings_or_exit(**overrides: object) -> Settings:
    """The settings, with command-line options (`overrides`, None = not given) on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return load_settings(**given)
    except Exception as exc:  # a bad MOONCAKE_* value or option: say which, do not trace back
        err.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(2) from exc


@contextlib.contextmanager
def trace_errors_exit(command: str) -> Iterator[None]:
    """A traces directory without the traces, or a bad trace line (`trace.TraceError`), as
    one line naming `command` and exit code 2, not a traceback."""
    from mooncake.trace import TraceError

    try:
        yield
    except TraceError as exc:
        err.print(f"[red]{command}:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from exc


ATTENTION_HELP = (
    "Prefill attention's products: float32, or bfloat16 where the CPU has AVX512_BF16 and "
    "it measures faster there, or auto (bfloat16 where faster, silently float32 elsewhere; "
    "engine.attention)"
)
GEMM_HELP = (
    "Prefill GEMMs' products over quantized weights: float32, or bfloat16 where the CPU has "
    "AMX or AVX512_BF16 and it measures faster there, or auto (bfloat16 where faster, "
    "silently float32 elsewhere; engine.gemm)"
)


def precision(value: str, option: str) -> Literal["float32", "bfloat16"]:
    """An --attention / --gemm value (auto: bfloat16 where it measures faster, as
    `config.resolve_precision`), or a usage error (exit 2) naming the choices."""
    if value not in ("auto", "float32", "bfloat16"):
        raise typer.BadParameter("auto, float32 or bfloat16", param_hint=option)
    return "float32" if value == "float32" else resolve_precision("bfloat16")


KV_CACHE_HELP = (
    "Bytes of each prefill/decode worker's KV pool, e.g. 1.5GiB (MOONCAKE_KV_CACHE_BYTES); "
    "default: an eighth of this machine's memory over its engine workers"
)


def print_result(title: str, result: dict[str, object], as_json: bool) -> None:
    """One JSON object on stdout (for scripts), or a table for people."""
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value")
    for k, v in result.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(table)
