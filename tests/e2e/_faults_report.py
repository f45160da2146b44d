"""RELIABILITY.md's fault table from the fault suite's measured runs.

Usage: python tests/e2e/_faults_report.py [RESULTS.jsonl]   (default: $MC_FAULTS_OUT, else
<tmp>/mooncake-faults.jsonl). The newest row of each scenario is shown, in suite order.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ORDER = (
    "kill-recorder",
    "kill-store-master",
    "kill-conductor",
    "kill-prefill",
    "kill-decode",
    "kill-gateway",
    "kill-hot-store-node",
    "restart-nats",
    "stop-postgres",
)
COMMAND = "MC_FAULTS_FULL=1 .venv/bin/pytest -q tests/e2e/test_faults.py -k '{}'"


def newest_rows(lines: list[str]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for line in lines:
        if line.strip():
            row = json.loads(line)
            rows[row["scenario"]] = row  # later lines are newer
    return rows


def _s(v: object) -> str:
    return "n/a" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = (
        "| scenario | requests | in flight at the fault (on the killed worker) "
        "| work redone / re-dispatched | lost | duplicated | completed / failed "
        "| clients unanswered (tokens read back) | recovery (s) | first recorded (s) "
        "| events = streams | projections = rebuild | result | command |\n"
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|---|---|\n"
    )
    body = []
    for name in sorted(rows, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        r = rows[name]
        same = r["missing_from_record"] == 0 and r["not_in_streams"] == 0
        on_killed = r.get("on_killed")
        killed = f" ({on_killed} on {r['killed']})" if on_killed is not None else ""
        cells = [
            f"`{name}`",
            _s(r["requests"]),
            f"{r['in_flight']}{killed}",
            f"{_s(r.get('redone'))} / {_s(r.get('redispatched'))}",
            _s(r["lost"]),
            _s(r["duplicated"]),
            f"{r['completed']} / {r['failed']}",
            f"{r['client_unanswered']} ({_s(r.get('tokens_repaired'))})",
            _s(r["recovery_s"]),
            _s(r["recorded_s"]),
            f"yes ({r['stream_messages']} events)" if same else "**no**",
            "yes" if r["projections_equal"] else "**no**",
            "pass" if not r["violations"] else "**FAIL**",
            f"`{COMMAND.format(name)}`",
        ]
        body.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(body) + "\n"


def main(argv: list[str]) -> int:
    default = os.environ.get("MC_FAULTS_OUT") or str(
        Path(tempfile.gettempdir()) / "mooncake-faults.jsonl"
    )
    path = Path(argv[1] if len(argv) > 1 else default)
    if not path.exists():
        print(f"no results at {path}: run `make faults` first", file=sys.stderr)
        return 1
    sys.stdout.write(table(newest_rows(path.read_text().splitlines())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
