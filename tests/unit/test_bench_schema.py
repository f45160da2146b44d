"""Every bench's JSON has one schema (mooncake/bench/schema.py): each model builds its JSON
Schema, every `mooncake bench` command has one, and real outputs (tiny runs of this
session, tests/data/bench/) validate while a renamed or retyped field does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.bench.schema import SCHEMAS, BenchSchemaError, json_schema, validate
from mooncake.cli import app
from mooncake.commands.bench import bench_app

SAMPLES = Path(__file__).parent.parent / "data" / "bench"


def test_every_bench_command_has_a_schema_and_each_builds() -> None:
    commands = {c.name for c in bench_app.registered_commands} - {"schema"}
    assert commands <= set(SCHEMAS), commands - set(SCHEMAS)
    for name in SCHEMAS:
        assert json_schema(name)["type"] == "object"


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.json")), ids=lambda p: p.stem)
def test_a_real_output_validates_and_a_changed_one_does_not(path: Path) -> None:
    result = json.loads(path.read_text())
    validate(path.stem, result)
    key = next(iter(result))
    with pytest.raises(BenchSchemaError, match="does not match"):
        validate(path.stem, {**{k: v for k, v in result.items() if k != key}, key + "_x": 1})
    with pytest.raises(BenchSchemaError, match=key):
        validate(path.stem, {**result, key: object()})


def test_the_schema_command_prints_one_and_refuses_an_unknown_bench() -> None:
    got = CliRunner().invoke(app, ["bench", "schema", "bus"])
    assert got.exit_code == 0 and "recorded_events_per_s" in json.loads(got.stdout)["properties"]
    bad = CliRunner().invoke(app, ["bench", "schema", "nope"])
    assert bad.exit_code == 2 and "no schema" in bad.output
