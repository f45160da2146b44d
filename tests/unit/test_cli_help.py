"""Every command's --help reads whole at 80 columns: no option help cut short with "…"."""

from __future__ import annotations

from typing import Any

import typer
from typer.testing import CliRunner

from mooncake.cli import app


def _paths(cmd: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    if hasattr(cmd, "commands"):  # a group (typer's own click)
        for name, sub in cmd.commands.items():
            paths += _paths(sub, (*prefix, name))
    return paths


def test_help_is_never_cut_at_80_columns() -> None:
    paths = _paths(typer.main.get_command(app))
    assert len(paths) > 10  # the walk found the commands
    cut = {}
    for path in paths:
        out = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert out.exit_code == 0, (path, out.output)
        if "…" in out.output:
            cut[" ".join(path)] = [line for line in out.output.splitlines() if "…" in line]
    assert cut == {}
