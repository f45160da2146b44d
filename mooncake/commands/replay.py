"""`mooncake replay --from-db --policy NAME`: counterfactual replay of the recorded arrivals.

Reads every `request.submitted` event (and what the `requests` projection says became of
it) from Postgres, re-runs those arrivals through the simulator under another admission
policy (`mooncake.sim.counterfactual`), and prints recorded vs counterfactual outcomes.

The source is a flag so that replaying a trace file against the live system (a positional
`TRACE` argument, issue 6) can join it later without changing this form; until then
`--from-db` is required.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from mooncake.cli_common import console, err, print_result, settings_or_exit
from mooncake.trace_fit import FitMode

if TYPE_CHECKING:
    from mooncake.replay_live import LiveReplayOptions

REPLAY_PAYLOAD_TYPE = "request.submitted"
_QUERY = """
SELECT e.request_id, e.occurred_at, e.payload,
       r.status, r.policy, r.prompt_tokens, r.output_tokens, r.reject_reason, r.ttft_s, r.tbt_s
FROM events e LEFT JOIN requests r ON r.request_id = e.request_id
WHERE e.type = :type AND e.request_id IS NOT NULL
ORDER BY e.occurred_at, e.id
"""


class ReplayError(Exception):
    """Bad input for a replay: said in one line, exit code 2."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayOptions:
    policy: str
    prefill: int | None = None  # None: as many as the record's `instances` had, else 8
    decode: int | None = None
    speed: float = 1.0


async def load_recorded(database_url: str) -> tuple[list[Any], dict[str, int]]:
    """The recorded arrivals (first submission of each request id, in arrival order) and
    the number of prefill / decode instances the record knows."""
    from sqlalchemy import text

    from mooncake.db.engine import async_engine
    from mooncake.sim.counterfactual import RecordedRequest

    engine = async_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text(_QUERY), {"type": REPLAY_PAYLOAD_TYPE})).all()
            roles = (
                await conn.execute(text("SELECT role, count(*) FROM instances GROUP BY role"))
            ).all()
    finally:
        await engine.dispose()
    seen: set[str] = set()
    out: list[RecordedRequest] = []
    for rid, at, payload, status, policy, prompt_tokens, output_tokens, reason, ttft, tbt in rows:
        if rid in seen:  # a resubmission of the same id does not start a second request
            continue
        seen.add(rid)
        ids = payload.get("token_ids")
        out.append(
            RecordedRequest(
                request_id=rid,
                arrival_s=_epoch(at),
                token_ids=tuple(ids) if ids is not None else None,
                prompt=payload.get("prompt"),
                max_tokens=int(payload.get("params", {}).get("max_tokens", 128)),
                status=status,
                policy=policy,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens or 0,
                reject_reason=reason,
                ttft_s=ttft,
                tbt_s=tbt,
            )
        )
    return out, {str(role): int(n) for role, n in roles}


def _epoch(at: datetime) -> float:
    return at.timestamp()


def run_replay(
    database_url: str, opts: ReplayOptions, *, block_tokens: int = 512, hash_seed: int = 0
) -> dict[str, Any]:
    """Load, simulate under `opts.policy`, compare. Raises ReplayError on bad input."""
    from sqlalchemy.exc import SQLAlchemyError

    from mooncake.core.admission import POLICIES
    from mooncake.sim import SimConfig, run_simulation
    from mooncake.sim.counterfactual import compare, to_trace

    if opts.policy not in POLICIES:
        raise ReplayError(f"unknown policy {opts.policy!r}; one of {', '.join(POLICIES)}")
    if opts.speed <= 0 or (opts.prefill or 1) < 1 or (opts.decode or 1) < 1:
        raise ReplayError("--speed must be > 0 and --prefill / --decode at least 1")
    try:
        records, roles = asyncio.run(load_recorded(database_url))
    except (SQLAlchemyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReplayError(f"cannot read the record at {_safe(database_url)}: {first}") from exc
    if not records:
        raise ReplayError("nothing to replay: no request.submitted events in the record")
    prefill = opts.prefill or roles.get("prefill") or 8
    decode = opts.decode or roles.get("decode") or 8
    replay_in = to_trace(records, block_tokens, seed=hash_seed)
    cfg = SimConfig(
        policy=opts.policy,  # checked against POLICIES above
        prefill_instances=prefill,
        decode_instances=decode,
        speed=opts.speed,
        block_tokens=block_tokens,
    )
    result = compare(records, run_simulation(replay_in.trace, cfg))
    result["simulated"] = {
        "prefill_instances": prefill,
        "decode_instances": decode,
        "speed": opts.speed,
        "cost_model": "analytic reference (LLaMA3-70B on 8xA800)",
        "estimated_prompts": replay_in.estimated_prompts,
    }
    return result


def _safe(url: str) -> str:
    """The URL without its password, for messages."""
    head, sep, tail = url.rpartition("@")
    if not sep:
        return url
    scheme, _, cred = head.partition("://")
    return f"{scheme}://{cred.split(':', 1)[0]}@{tail}"


def print_comparison(result: dict[str, Any]) -> None:
    from mooncake.sim.counterfactual import comparison_rows

    sim = result["simulated"]
    table = Table(
        title=f"replay: recorded vs {result['counterfactual']['policy']} "
        f"({sim['prefill_instances']}P+{sim['decode_instances']}D, speed {sim['speed']}x)"
    )
    for col in ("", "recorded", "counterfactual"):
        table.add_column(col)
    for row in comparison_rows(result):
        table.add_row(*row)
    console.print(table)
    note = f"counterfactual times: {sim['cost_model']} cost model"
    if sim["estimated_prompts"]:
        note += f"; {sim['estimated_prompts']} text prompt lengths estimated at 4 bytes a token"
    console.print(note)


def replay(
    trace: Annotated[
        Path | None,
        typer.Argument(help="A Mooncake trace (JSONL) to replay against the live system"),
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Replay only the first N requests")] = None,
    tokens_per_block: Annotated[
        int | None,
        typer.Option(
            help="Tokens per trace block (traces use 512; default: MOONCAKE_BLOCK_TOKENS)"
        ),
    ] = None,
    max_output: Annotated[int, typer.Option(help="Cap on output tokens per request")] = 32,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each request")] = 300.0,
    from_db: Annotated[
        bool, typer.Option("--from-db", help="Replay the arrivals recorded in Postgres")
    ] = False,
    policy: Annotated[
        str, typer.Option(help="Admission policy: none, baseline, early, predicted or forecast")
    ] = "predicted",
    database_url: Annotated[
        str | None, typer.Option(help="Postgres URL (default: MOONCAKE_DATABASE_URL)")
    ] = None,
    prefill: Annotated[int | None, typer.Option(help="Prefill instances (default: recorded)")] = (
        None
    ),
    decode: Annotated[int | None, typer.Option(help="Decode instances (default: recorded)")] = (
        None
    ),
    speed: Annotated[float, typer.Option(help="Arrival speed factor")] = 1.0,
    fit_context: Annotated[
        FitMode,
        typer.Option(
            help="TRACE prompts that, with their output, exceed the model's context: scale "
            "(fewer blocks, hash ids kept) | truncate | skip"
        ),
    ] = FitMode.SCALE,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Replay TRACE against the live system, or (--from-db) re-run the recorded arrivals
    through the simulator under POLICY (counterfactual)."""
    if trace is not None and from_db:
        err.print("[red]give either a TRACE or --from-db, not both[/red]")
        raise typer.Exit(2)
    if trace is None and not from_db:
        err.print("[red]nothing to replay:[/red] give a TRACE file or --from-db")
        raise typer.Exit(2)
    settings = settings_or_exit()
    if trace is not None:
        per_block = tokens_per_block or settings.block_tokens
        live = _live_options(settings, trace, speed, limit, per_block, max_output, timeout)
        _replay_live(settings, dataclasses.replace(live, fit=fit_context), as_json)
        return
    url = database_url or settings.database_url
    if not url:
        err.print("[red]no database:[/red] pass --database-url or set MOONCAKE_DATABASE_URL")
        raise typer.Exit(2)
    opts = ReplayOptions(policy=policy, prefill=prefill, decode=decode, speed=speed)
    try:
        result = run_replay(
            url, opts, block_tokens=settings.block_tokens, hash_seed=settings.hash_seed
        )
    except ReplayError as exc:
        err.print(f"[red]replay:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from exc
    if as_json:
        print_result("replay", result, True)
    else:
        print_comparison(result)


def _live_options(
    settings: Any,
    trace: Path,
    speed: float,
    limit: int | None,
    tokens_per_block: int,
    max_output: int,
    timeout: float,
) -> LiveReplayOptions:
    """The live replay's options, with the model's vocabulary and context (exit 2 if bad)."""
    from mooncake.engine.errors import EngineError
    from mooncake.model_info import model_spec
    from mooncake.replay_live import LiveReplayOptions

    if tokens_per_block < 1 or max_output < 1 or timeout <= 0:
        err.print("[red]--tokens-per-block and --max-output must be >= 1, --timeout > 0[/red]")
        raise typer.Exit(2)
    try:
        spec = model_spec(settings.engine)
    except EngineError as exc:
        err.print(f"[red]replay:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from exc
    return LiveReplayOptions(
        trace, speed, limit, tokens_per_block, max_output, spec.vocab_size, timeout,
        context_tokens=spec.context,
    )  # fmt: skip


def _replay_live(settings: Any, opts: LiveReplayOptions, as_json: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from mooncake.client import SystemDown
    from mooncake.replay_live import run_live_replay
    from mooncake.trace import TraceError

    trace, total = opts.trace, opts.limit
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=as_json) as progress:
        task = progress.add_task(f"replay {trace.name}", total=total)

        def done(out: Any) -> None:
            progress.advance(task)

        try:
            result = asyncio.run(run_live_replay(settings, opts, done, check_system=True))
        except SystemDown as exc:
            err.print(f"[red]replay: nothing sent:[/red] {exc}", soft_wrap=True)
            raise typer.Exit(1) from exc
        except (TraceError, ValueError, OSError) as exc:
            err.print(f"[red]replay:[/red] {exc}", soft_wrap=True)
            raise typer.Exit(2) from exc
        except Exception as exc:  # NATS unreachable and the like: one line, no traceback
            err.print(f"[red]replay failed:[/red] {type(exc).__name__}: {exc}", soft_wrap=True)
            raise typer.Exit(1) from exc
    if fitted := result.get("fitted"):
        err.print(
            f"fit to the model's context ({fitted['context_tokens']} tokens, "
            f"{fitted['mode']}): {fitted['changed']} prompts changed, {fitted['skipped']} skipped"
        )
    print_result("replay", result if as_json else _flat(result), as_json)


def _flat(result: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested summary -> one level of dotted keys (for the table; JSON keeps the same)."""
    out: dict[str, Any] = {}
    for k, v in result.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
