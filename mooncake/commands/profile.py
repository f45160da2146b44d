"""`mooncake profile engine` / `profile ssd`: timings the Conductor's cost model is fitted to."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from mooncake.cli_common import ATTENTION_HELP, GEMM_HELP, err, precision, settings_or_exit

profile_app = typer.Typer(help="Profiles the cost model fits", no_args_is_help=True)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


@profile_app.command("engine")
def profile_engine_cmd(
    out: Annotated[str, typer.Option(help="Where to write the profile JSON")] = "profile.json",
    dummy: Annotated[bool, typer.Option(help="A random model of the shape below")] = False,
    layers: Annotated[int, typer.Option(help="--dummy: layers")] = 30,
    hidden: Annotated[int, typer.Option(help="--dummy: hidden size")] = 576,
    heads: Annotated[int, typer.Option(help="--dummy: attention heads")] = 9,
    kv_heads: Annotated[int, typer.Option(help="--dummy: KV heads")] = 3,
    ffn: Annotated[int, typer.Option(help="--dummy: FFN size")] = 1536,
    vocab: Annotated[int, typer.Option(help="--dummy: vocabulary")] = 49152,
    context: Annotated[int, typer.Option(help="--dummy: context length")] = 8192,
    prompts: Annotated[str, typer.Option(help="Prompt lengths")] = "256,512,1024,2048",
    cached: Annotated[str, typer.Option(help="Cached prefix lengths")] = "0,256,512,1024,1536",
    batches: Annotated[str, typer.Option(help="Decode batch sizes")] = "1,2,4,8",
    contexts: Annotated[str, typer.Option(help="Decode contexts")] = "128,512,1024,2048",
    block_tokens: Annotated[int, typer.Option(min=1, help="KV block size")] = 256,
    reps: Annotated[int, typer.Option(min=1, help="Timed repetitions (median)")] = 3,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    attention: Annotated[
        str | None, typer.Option(help=f"{ATTENTION_HELP}; default: the setting")
    ] = None,
    gemm: Annotated[str | None, typer.Option(help=f"{GEMM_HELP}; default: the setting")] = None,
) -> None:
    """Time prefill over (prompt, cached prefix) and decode steps over (batch, context) on
    the real engine (SmolLM2 unless --dummy), as a worker runs it (its weights packed, its
    engine.attention and engine.gemm settings unless given here); write a
    mooncake.profile/1 JSON."""
    from pathlib import Path

    import torch

    from mooncake.config import PRECISION_BYTES, resolve_precision
    from mooncake.engine import Engine, EngineError, KVPoolExhausted, ModelSpec, dummy_model
    from mooncake.engine.gguf_loader import load_gguf, smollm2_path
    from mooncake.engine.profile import pool_tokens_for, profile_engine

    configured = settings_or_exit().engine
    attention_p = precision(attention or configured.attention, "--attention")
    gemm_p = precision(gemm or configured.gemm, "--gemm")
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if dummy:
            spec = ModelSpec(vocab, hidden, layers, heads, kv_heads, ffn, context)
            model, tokenizer = dummy_model(spec, device=device), None
            name = f"dummy-l{layers}-h{hidden}-a{heads}-kv{kv_heads}-f{ffn}-v{vocab}"
        else:
            loaded = load_gguf(smollm2_path(), device=device)
            model, tokenizer, name = loaded.model, loaded.tokenizer, loaded.name
        model.pack_weights()  # as a worker holds them (serving.models.build_engine)
        grid = {k: _int_list(v) for k, v in
                (("prompts", prompts), ("cached", cached), ("batches", batches),
                 ("contexts", contexts))}  # fmt: skip
        # A KV pool that holds the largest point of the grids (batch x context) at once.
        tokens = pool_tokens_for(grid["prompts"], grid["batches"], grid["contexts"],
                                 block_tokens, reps, model.spec.context)  # fmt: skip
        # The pool's element type as a worker's (engine.kv; float32 for --dummy, exact).
        kv = resolve_precision(configured.kv, exact=dummy)
        per_token = model.spec.kv_bytes_per_token(PRECISION_BYTES[kv])
        engine = Engine(model, tokenizer, block_tokens=block_tokens,
                        kv_budget_bytes=tokens * per_token, attention=attention_p,
                        gemm=gemm_p, kv=kv)  # fmt: skip
        err.print(
            f"KV pool for the grids: {tokens:,} tokens ({tokens * per_token / 2**30:.2f} GiB)"
        )
        doc = profile_engine(engine, model_name=name, reps=reps, log=err.print, **grid)
    except (EngineError, KVPoolExhausted) as exc:
        err.print(f"[red]profile failed:[/red] {exc}")
        raise typer.Exit(2) from exc
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    err.print(f"wrote {out}: {len(doc['prefill'])} prefill and {len(doc['decode'])} decode points")


@profile_app.command("ssd")
def profile_ssd_cmd(
    directory: Annotated[
        str | None,
        typer.Option("--dir", help="The SSD directory (default: the settings' store.ssd_dir)"),
    ] = None,
    size_mib: Annotated[int, typer.Option(min=1, help="Bytes to write and read back, MiB")] = 256,
    chunk_kib: Annotated[int, typer.Option(min=4, help="One read, KiB (a KV block)")] = 1024,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout")] = False,
) -> None:
    """Measure how fast the SSD tier reads KV blocks back (page cache dropped), and print the
    setting that makes the Conductor charge SSD reads at that speed."""
    from pathlib import Path

    from mooncake.config import load_settings
    from mooncake.store.ssd_probe import probe_ssd

    if directory is None:  # where the workers put it (serving/local_store.py)
        settings = load_settings()
        directory = str(settings.store.ssd_dir or settings.data_dir / "ssd")
    try:
        probe = probe_ssd(Path(directory), size_mib << 20, chunk_kib << 10)
    except OSError as exc:
        err.print(f"[red]cannot probe {directory}:[/red] {exc}")
        raise typer.Exit(2) from exc
    rate = probe.read_bytes_per_s
    setting = f"MOONCAKE_CONDUCTOR__SSD_READ_BYTES_PER_S={rate:.3g}"
    if as_json:
        doc = {
            "directory": probe.directory, "filesystem": probe.filesystem,
            "size_bytes": probe.size_bytes, "chunk_bytes": probe.chunk_bytes,
            "read_s": probe.read_s, "ssd_read_bytes_per_s": rate, "setting": setting,
        }  # fmt: skip
        print(json.dumps(doc))
        return
    err.print(
        f"{probe.directory} ({probe.filesystem}): read {probe.size_bytes / 2**20:.0f} MiB in "
        f"{probe.read_s * 1000:.0f} ms = {rate / 1e9:.2f} GB/s"
    )
    if probe.filesystem in ("tmpfs", "ramfs", "overlay"):
        err.print("[yellow]not a block device: this is memory's speed, not an SSD's[/yellow]")
    print(setting)
