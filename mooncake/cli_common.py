"""What every `mooncake` sub-command shares: the consoles, settings, result printing."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from mooncake.config import Settings, load_settings

console = Console()
err = Console(stderr=True)


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except Exception as exc:  # a bad MOONCAKE_* value: say which, do not trace back
        err.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(2) from exc


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
