"""`mooncake bench vs-vllm`: goodput beside vLLM's OpenAI server on the same machine, the
same prompts and the same SLOs, both servers in one run, one after the other (issue 42).

1. vLLM's server (`vllm_peer`: its own interpreter, the shipped model written out as a
   bfloat16 Hugging Face directory) starts; a lone 512-token request with 128 tokens out
   measures its TTFT and decode speed; then the trace's requests at a speed found in the run
   (`PeakSearch`: where its goodput peaks), and at 2x and 4x that speed. It stops.
2. `mooncake up` starts as a user starts it (a child process with a private data directory,
   its embedded broker and database), and gets the same lone request and the same three runs.
3. Each server's process tree is sampled for PSS (a shared page counted as a share per
   process) while it runs.

The client is one for both: OpenAI's streamed `/v1/completions` over HTTP, token-id prompts,
greedy; a 429 is a rejection with the server's reason code. The figures and ratios are
`vs_vllm_figures`' (pure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from mooncake.bench.memwatch import pss_bytes
from mooncake.bench.vs_vllm_figures import (
    Answer,
    Ask,
    CpuUse,
    PeakSearch,
    Workload,
    asks,
    lone_figures,
    rate_of,
    run_figures,
    summary,
)
from mooncake.cpus import available, parse_cpus
from mooncake.services import free_port
from mooncake.trace import SHIPPED_CONVERSATION, TraceRequest, block_tokens, load_trace

Log = Callable[[str], None]

DEFAULT_TRACE = SHIPPED_CONVERSATION
DEFAULT_VLLM_PYTHON = Path(".venv-anchors/bin/python")
LONE_PROMPT, LONE_OUTPUT = 512, 128
LONE_HASH_ID = 1 << 40  # beyond any trace's ids


@dataclass(frozen=True)
class VsVllmOptions:
    vllm_python: Path = DEFAULT_VLLM_PYTHON
    trace: Path = DEFAULT_TRACE
    requests: int = 60
    work: Workload = field(default_factory=Workload)
    ttft_slo_s: float = 10.0
    tbt_slo_s: float = 0.2
    # None: found in the run (the speed where vLLM's goodput peaks, then 2x and 4x it).
    speeds: tuple[float, ...] | None = None
    first_speed: float = 0.1
    probes: int = 4
    request_timeout_s: float = 600.0
    start_timeout_s: float = 600.0
    cpus: str | None = None  # both servers' CPUs; None: every CPU this process may use
    vllm_kv_gib: int = 4
    work_dir: Path | None = None  # where the exported model and the logs go (a temp dir)
    peers: tuple[str, ...] = ("vllm", "mooncake")


# --- the client ----------------------------------------------------------------------------------


async def send(
    client: httpx.AsyncClient, url: str, model: str, ask: Ask, timeout_s: float
) -> Answer:
    """One streamed completion; what the client saw, whatever happened."""
    body = {
        "model": model,
        "prompt": ask.tokens,
        "max_tokens": ask.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    a = Answer(sent_s=time.perf_counter(), prompt_tokens=len(ask.tokens))
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await _refused(a, r)
                    return a
                await _read_stream(a, r)
    except TimeoutError:
        a.error = "client_timeout"
    except httpx.HTTPError as exc:
        a.error = type(exc).__name__
    a.end_s = time.perf_counter()
    return a


async def _refused(a: Answer, r: httpx.Response) -> None:
    text = (await r.aread()).decode(errors="replace")
    try:
        err = json.loads(text).get("error", {})
        code = err.get("code") or err.get("type")
    except (ValueError, AttributeError):
        code = None
    if r.status_code == 429:
        a.rejected = str(code or "overloaded")
    else:
        a.error = f"http_{r.status_code}" + (f"_{code}" if code else "")
    a.end_s = time.perf_counter()


async def _read_stream(a: Answer, r: httpx.Response) -> None:
    finished = False
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            a.error = str(chunk["error"].get("code") or "stream_error")
            return
        for choice in chunk.get("choices") or ():
            if choice.get("text") is not None and choice.get("finish_reason") is None:
                a.chunk_s.append(now)
            elif choice.get("text"):  # the last token may come with the finish reason
                a.chunk_s.append(now)
            finished = finished or choice.get("finish_reason") is not None
        if usage := chunk.get("usage"):
            a.tokens = int(usage.get("completion_tokens") or 0)
    a.first_s = a.chunk_s[0] if a.chunk_s else None
    a.tokens = a.tokens or len(a.chunk_s)
    a.completed = finished and a.first_s is not None
    if not a.completed:
        a.error = "stream_ended_early"


async def run_asks(url: str, model: str, run: Sequence[Ask], timeout_s: float) -> list[Answer]:
    """Open loop: each request sent at its time, whatever the others are doing."""
    limits = httpx.Limits(max_connections=len(run) + 4, max_keepalive_connections=8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def at(ask: Ask) -> Answer:
            await asyncio.sleep(max(0.0, t0 + ask.at_s - time.perf_counter()))
            return await send(client, url, model, ask, timeout_s)

        return list(await asyncio.gather(*(at(x) for x in run)))


async def served_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.get(f"{url}/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


def lone_ask(work: Workload, seed: int) -> Ask:
    """A prompt of LONE_PROMPT tokens that shares no block with any run (a hash id no
    trace uses, its own seed)."""
    tokens = block_tokens(LONE_HASH_ID, LONE_PROMPT, work.vocab_size, seed=seed)
    return Ask(0, 0.0, [int(t) for t in tokens], LONE_OUTPUT)


# --- memory --------------------------------------------------------------------------------------


def process_role(p: psutil.Process) -> str:
    """What a process of a server's tree is: our worker's role (`worker prefill ...`), else
    its name (nats-server, postgres, python for vLLM's server and the `up` supervisor)."""
    try:
        cmd = p.cmdline()
        if "worker" in cmd[:-1]:
            return str(cmd[cmd.index("worker") + 1])
        return str(p.name())
    except (psutil.Error, IndexError):
        return "?"


class PssWatch:
    """The largest PSS sum over a process and its descendants, sampled from a thread; and
    the CPU time each of them used between two `take_cpu`s (by role, `process_role`),
    from the samples: a process that ends loses its last interval, one that starts its
    first (each at most `interval_s`)."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak = 0  # since start
        self.window = 0  # since the last `reset`
        # (pid, start time: a reused pid is another process) -> (role, CPU seconds at its
        # first sample since `take_cpu`, at its latest)
        self._cpu: dict[tuple[int, float], tuple[str, float, float]] = {}
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-watch", daemon=True)

    def __enter__(self) -> PssWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> int:
        seen, self.window = self.window, 0
        return seen

    def take_cpu(self) -> tuple[dict[str, float], float]:
        """(CPU seconds by role, seconds) since the last call (or the start)."""
        self.sample()
        with self._lock:
            by_role: dict[str, float] = {}
            for role, first, last in self._cpu.values():
                by_role[role] = by_role.get(role, 0.0) + last - first
            now, since = time.monotonic(), self._since
            self._cpu = {key: (role, last, last) for key, (role, _, last) in self._cpu.items()}
            self._since = now
        return dict(sorted(by_role.items())), now - since

    def sample(self) -> int:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = sum(pss_bytes(p.pid) or 0 for p in procs)
        self.peak, self.window = max(self.peak, total), max(self.window, total)
        with self._lock:
            for p in procs:
                try:
                    times, key = p.cpu_times(), (p.pid, p.create_time())
                except psutil.Error:
                    continue
                used = times.user + times.system
                role, first, _ = self._cpu.get(key) or (process_role(p), used, used)
                self._cpu[key] = (role, first, used)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


# --- the servers ---------------------------------------------------------------------------------


@dataclass
class UpServer:
    """`mooncake up` as a user runs it, in a child process: a private data directory and
    namespace, its embedded broker (on a free port) and database, the gateway on a free
    port. `env` goes on top (a bench's own settings)."""

    work_dir: Path
    cpus: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port("127.0.0.1")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        env |= {
            "MOONCAKE_DATA_DIR": str(self.work_dir / "data"),
            "MOONCAKE_NAMESPACE": f"vsvllm{secrets.token_hex(3)}",
            "MOONCAKE_NATS_URL": f"nats://127.0.0.1:{free_port('127.0.0.1')}",
            "MOONCAKE_GATEWAY__HOST": "127.0.0.1",
            "MOONCAKE_GATEWAY__PORT": str(self.port),
        } | self.env
        argv = [sys.executable, "-m", "mooncake.cli", "up", "--no-metrics"]
        if self.cpus is not None:
            argv = ["taskset", "-c", self.cpus, *argv]
        log = (self.work_dir / "up.log").open("wb")
        self.proc = subprocess.Popen(
            argv,
            cwd=self.work_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    async def wait_ready(self, timeout_s: float, work: Workload) -> None:
        """Until the gateway answers a whole (small) completion: every role is up."""
        deadline = time.monotonic() + timeout_s
        probe = Ask(0, 0.0, lone_ask(work, seed=-99).tokens[:32], 2)
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"`mooncake up` exited: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                model = await served_model(self.url)
                (a,) = await run_asks(self.url, model, [probe], 30.0)
                if a.completed:
                    return
                last = a.rejected or a.error or "no tokens"
            await asyncio.sleep(1.0)
        raise RuntimeError(
            f"`mooncake up` not serving within {timeout_s:.0f} s ({last}): {self.log_tail()}"
        )

    def log_tail(self, chars: int = 2000) -> str:
        path = self.work_dir / "up.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # `up` stops its workers and servers
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# --- the run -------------------------------------------------------------------------------------


async def measure_lone(url: str, model: str, work: Workload, timeout_s: float) -> dict[str, Any]:
    """A warm-up request, then the lone one (prompts that share no block)."""
    await run_asks(url, model, [lone_ask(work, seed=-3)], timeout_s)
    (a,) = await run_asks(url, model, [lone_ask(work, seed=-2)], timeout_s)
    return lone_figures(a)


async def measure_speed(
    url: str,
    model: str,
    trace: Sequence[TraceRequest],
    speed: float,
    opts: VsVllmOptions,
    watch: PssWatch,
) -> dict[str, Any]:
    """One run of the trace at `speed` (its tokens seeded by the speed, the same for both
    servers and distinct across speeds)."""
    run = asks(trace, opts.work, speed, seed=seed_of(speed))
    watch.reset()
    watch.take_cpu()
    answers = await run_asks(url, model, run, opts.request_timeout_s)
    cpus = len(parse_cpus(opts.cpus)) if opts.cpus else len(available())
    cpu = CpuUse(*watch.take_cpu(), cpus=cpus)
    out = run_figures(answers, opts.ttft_slo_s, opts.tbt_slo_s, watch.reset() or None, cpu)
    return {"speed": speed, "rate_rps": round(rate_of(trace, speed), 4)} | out


def seed_of(speed: float) -> int:
    return 1 + round(speed * 1_000_000)


def speeds_after_peak(peak: float) -> tuple[float, float, float]:
    return (peak, peak * 2, peak * 4)


async def run_vllm(
    opts: VsVllmOptions, trace: Sequence[TraceRequest], work_dir: Path, log: Log
) -> dict[str, Any]:
    """vLLM's figures: lone, the search (unless speeds are given), the three runs."""
    from mooncake.bench import vllm_peer
    from mooncake.engine.gguf_meta import smollm2_path

    if (why := vllm_peer.available(opts.vllm_python)) is not None:
        return {"error": why}
    log(f"vs-vllm: writing the model out for vLLM ({work_dir / 'hf'})")
    model_dir = vllm_peer.export_model(
        opts.vllm_python, smollm2_path(), work_dir / "hf", timeout_s=opts.start_timeout_s
    )
    server = vllm_peer.VllmServer(
        python=opts.vllm_python,
        model_dir=model_dir,
        port=free_port("127.0.0.1"),
        cpus=opts.cpus or cpu_list(),
        kv_space_gib=opts.vllm_kv_gib,
        max_model_len=4096,
        log_dir=work_dir,
    )
    log("vs-vllm: starting vLLM's server")
    with server:
        server.wait_ready(opts.start_timeout_s)
        if server.pid is None:
            raise RuntimeError(f"vLLM's server exited: {server.log_tail()}")
        return await measure_server(
            "vllm",
            server.url,
            server.pid,
            trace,
            opts,
            log,
            search=opts.speeds is None,
            speeds=opts.speeds or (),
        )


async def run_mooncake(
    opts: VsVllmOptions,
    trace: Sequence[TraceRequest],
    work_dir: Path,
    speeds: Sequence[float],
    log: Log,
) -> dict[str, Any]:
    # The service's SLOs are the ones the bench judges it by (an operator sets them; vLLM
    # has none to set).
    slo = {"MOONCAKE_SLO__TTFT_S": str(opts.ttft_slo_s), "MOONCAKE_SLO__TBT_S": str(opts.tbt_slo_s)}
    up = UpServer(work_dir / "mooncake", cpus=opts.cpus, env=slo)
    log("vs-vllm: starting `mooncake up`")
    up.start()
    try:
        await up.wait_ready(opts.start_timeout_s, opts.work)
        return await measure_server("mooncake", up.url, up.pid, trace, opts, log, speeds=speeds)
    finally:
        up.stop()


async def measure_server(
    name: str,
    url: str,
    pid: int,
    trace: Sequence[TraceRequest],
    opts: VsVllmOptions,
    log: Log,
    *,
    search: bool = False,
    speeds: Sequence[float] = (),
) -> dict[str, Any]:
    model = await served_model(url)
    with PssWatch(pid) as watch:
        lone = await measure_lone(url, model, opts.work, opts.request_timeout_s)
        log(f"vs-vllm: {name} lone: {lone}")
        runs: dict[float, dict[str, Any]] = {}

        async def at(speed: float) -> dict[str, Any]:
            if speed not in runs:
                runs[speed] = await measure_speed(url, model, trace, speed, opts, watch)
                r = runs[speed]
                log(
                    f"vs-vllm: {name} speed {speed:g}: {r['good']}/{r['requests']} good, "
                    f"goodput {r['goodput_rps']} req/s, rejected {r['rejected']}, "
                    f"TTFT p50 {r['ttft_s']['p50']} s, TBT p90 {r['tbt_s']['p90']} s"
                )
            return runs[speed]

        if search:
            peak = PeakSearch(start=opts.first_speed, probes=opts.probes)
            while (s := peak.next_speed()) is not None:
                peak.record(s, (await at(s))["goodput_rps"])
            speeds = speeds_after_peak(peak.peak())
        for s in speeds:
            await at(s)
        watch.sample()
    return {
        "lone": lone,
        "runs": [runs[s] for s in speeds],
        "searched": sorted(runs) if search else None,
        "peak_pss_mb": round(watch.peak / (1 << 20), 1),
        "_peak_pss": watch.peak,
    }


def cpu_list() -> str:
    from mooncake.cpus import available, format_cpus

    return format_cpus(available())


async def run_vs_vllm_bench(opts: VsVllmOptions, log: Log = print) -> dict[str, Any]:
    trace = load_trace(opts.trace, limit=opts.requests)
    if len(trace) < 2:
        raise ValueError(f"{opts.trace} holds fewer than 2 requests")
    with contextlib.ExitStack() as stack:
        work_dir = opts.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        vllm: dict[str, Any] = {"error": "not run"}
        if "vllm" in opts.peers:
            try:
                vllm = await run_vllm(opts, trace, work_dir, log)
            except RuntimeError as exc:
                vllm = {"error": str(exc)[-1500:]}
        speeds = opts.speeds or (
            tuple(r["speed"] for r in vllm["runs"])
            if "runs" in vllm
            else speeds_after_peak(opts.first_speed)
        )
        ours: dict[str, Any] = {"error": "not run"}
        if "mooncake" in opts.peers:
            try:
                ours = await run_mooncake(opts, trace, work_dir, speeds, log)
            except RuntimeError as exc:
                ours = {"error": str(exc)[-1500:]}
    return report(opts, vllm, ours)


def report(opts: VsVllmOptions, vllm: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    both = "runs" in vllm and "runs" in ours
    rates = (
        [
            {"speed": a["speed"], "vllm": a, "mooncake": b}
            for a, b in zip(vllm["runs"], ours["runs"], strict=True)
        ]
        if both
        else []
    )
    top = (
        summary(
            rates,
            {"vllm": vllm["lone"], "mooncake": ours["lone"]},
            {"vllm": vllm.get("_peak_pss"), "mooncake": ours.get("_peak_pss")},
        )
        if both
        else {}
    )
    for side in (vllm, ours):
        side.pop("_peak_pss", None)
    return top | {
        "engine": "native",
        "requests": opts.requests,
        "slo": {"ttft_s": opts.ttft_slo_s, "tbt_p90_s": opts.tbt_slo_s},
        "workload": {
            "block_tokens": opts.work.block_tokens,
            "max_prompt": opts.work.max_prompt,
            "max_output": opts.work.max_output,
            "trace": opts.trace.name,
        },
        "vllm": vllm,
        "mooncake": ours,
    }
