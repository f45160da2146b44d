"""`mooncake simulate paper --quick --out DIR` writes one valid PNG per experiment."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mooncake.cli import app

from helpers import small_traces

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = (
    "capacity.png", "hit_rate.png", "scheduling.png", "overload.png",
    "load_paper_8p8d.png", "load_decode_bound_8p2d_tbt30ms.png", "pd_ratio.png",
)  # fmt: skip


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR", f"{path.name} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_paper_quick_writes_the_plots_next_to_the_tables(tmp_path: Path) -> None:
    # Small traces: the first 120 requests of each shipped trace (quick caps them anyway).
    traces = small_traces(tmp_path / "traces", 120)
    out = tmp_path / "out"
    args = ["simulate", "paper", "--quick", "--json", "--traces", str(traces), "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    written = {Path(p).name for p in json.loads(res.stdout.splitlines()[-1])["written"]}
    assert "paper.md" in written and set(PLOTS) <= written
    for name in PLOTS:
        width, height = _png_size(out / name)
        assert width >= 300 and height >= 200
    # The load plot has one panel per policy, so it is taller than one panel.
    assert _png_size(out / "load_paper_8p8d.png")[1] > _png_size(out / "scheduling.png")[1]
