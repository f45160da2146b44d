"""The `mooncake` system: prefill pool + decode pool + a KVCache pool in the prefill nodes'
DRAM, scheduled by the Conductor (core/conductor.py Algorithm 1, core/admission.py).

The simulator only feeds the core facts (`Assigned`, `PrefillStarted`, `BlocksStored`, ...)
and acts on its Decisions; every scheduling choice is the core's. Per request:
1. arrival: `admission.decide(policy, view, ...)`; a rejection ends it (stage admission /
   prefill), an admission queues it FCFS on the chosen prefill instance;
2. prefill start: the prefix actually reused is re-read from the caches (blocks may have been
   evicted since the decision); it runs for transfer (remote prefix) + `prefill_s`;
3. prefill end: the first token; the node stores every whole block of the prompt (LRU,
   evictions reported to the block index); the KV streams to the decode instance, overlapped
   layer by layer with the prefill, so only one layer's share is left to wait for;
4. decode: `baseline` re-checks the decode stage's own load here (rejecting wastes the
   prefill); then continuous batching until the last token, each decode instance admitting
   by free KV pages and preempting the youngest when they run out (sim/decode.py); a request
   whose KV exceeds a whole instance is rejected there (stage decode, `kv_never_fits`).

`cache_scope="local"` gives each prefill instance only its own DRAM (the Conductor never
takes a remote prefix); `scheduler` picks how instances are chosen (FAST'25 Fig. 5).
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake.core import admission
from mooncake.core import cluster as cl
from mooncake.core import conductor as cd
from mooncake.core.cost_model import Costs
from mooncake.core.cpp import CppConfig, group_prefill_s
from mooncake.sim.cache import LRUBlocks
from mooncake.sim.decode import DecodeHooks, DecodeWorker, KvPool
from mooncake.sim.loop import EventLoop
from mooncake.sim.request import SimRequest

if TYPE_CHECKING:
    from mooncake.sim.runner import SimConfig


@dataclass(slots=True)
class Job:
    """A prefill: on one instance, or on a CPP group (`members`: stage 0 first) that starts
    it together once every member has reached it in its queue (gang scheduling)."""

    req: SimRequest
    decision: cd.Decision
    members: tuple[str, ...]
    waiting: set[str] = field(default_factory=set)


class PrefillWorker:
    """One prefill instance: an FCFS queue, one prefill at a time. A group's job waits at the
    head of each member's queue until all of them are there: every job is queued on its
    members at its arrival, so every queue holds the jobs in the same order and no two groups
    wait on each other."""

    def __init__(self, iid: str, system: MooncakeSystem) -> None:
        self.id = iid
        self.system = system
        self.queue: deque[Job] = deque()
        self.busy = False

    def submit(self, job: Job) -> None:
        self.queue.append(job)
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            self.busy = False
            return
        self.busy = True
        job = self.queue[0]
        job.waiting.add(self.id)
        if len(job.waiting) < len(job.members):
            return  # held for the rest of its group
        workers = [self.system.prefill[m] for m in job.members]
        for w in workers:
            w.queue.popleft()
        duration = self.system.start_prefill(job.members, job.req, job.decision)
        self.system.loop.after(duration, self._finished, job, workers)

    def _finished(self, job: Job, workers: list[PrefillWorker]) -> None:
        self.system.prefilled(job.members[0], job.req, job.decision)
        for w in workers:
            w._next()


class MooncakeSystem:
    def __init__(self, loop: EventLoop, cfg: SimConfig, costs: Costs) -> None:
        self.loop, self.cfg, self.costs = loop, cfg, costs
        self.rng = random.Random(cfg.seed)
        self.ccfg = cd.ConductorConfig(
            block_tokens=cfg.block_tokens,
            balancing_threshold=cfg.balancing_threshold,
            pool_fetch=cfg.cache_scope == "global",
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            uniform_decode_s=cfg.uniform_decode_s,
            cpp=CppConfig(max_stages=cfg.cpp_stages, chunk_tokens=cfg.cpp_chunk_tokens),
        )
        self.view = cl.ClusterView()
        self.caches: dict[str, LRUBlocks] = {}
        self.prefill: dict[str, PrefillWorker] = {}
        self.decode: dict[str, DecodeWorker] = {}
        cap = cfg.cache_blocks_per_node
        pool = KvPool.sized(cfg.kv_capacity_tokens, cfg.page_tokens, cfg.decode_max_batch)
        hooks = DecodeHooks(self._joined, self._done, self._never_fits)
        for i in range(cfg.prefill_instances):
            pid = f"p{i:02d}"
            self.view.apply(cl.InstanceJoined(pid, "prefill"), 0.0)
            self.prefill[pid] = PrefillWorker(pid, self)
            self.caches[pid] = LRUBlocks(cap)
        for i in range(cfg.decode_instances):
            did = f"d{i:02d}"
            self.view.apply(cl.InstanceJoined(did, "decode", "", cfg.kv_capacity_tokens), 0.0)
            self.decode[did] = DecodeWorker(did, loop, costs, hooks, pool)
        self.rejections: dict[str, int] = {}
        self.took_remote = 0

    # --- arrival ---------------------------------------------------------------------------

    def arrive(self, req: SimRequest) -> None:
        now = self.loop.now
        keys = req.keys if self.cfg.scheduler != "load-balance" else ()
        sreq = cd.ScheduleRequest(req.rid, req.prompt, keys)
        decision = admission.decide(self.cfg.policy, self.view, sreq, self.ccfg, self.costs, now)
        if decision.admitted and self.cfg.scheduler == "random":
            decision = self._random_instance(decision, sreq, now)
        if not decision.admitted:
            reason = decision.reason.value if decision.reason is not None else "rejected"
            self._reject(req, decision.stage, reason)
            return
        fact = cd.assignment(decision)
        assert fact is not None
        self.view.apply(fact, now)
        self.took_remote += decision.takes_remote
        job = Job(req, decision, (fact.prefill_instance, *fact.stage_instances))
        req.prefill_stages = len(job.members)
        for m in job.members:
            self.prefill[m].submit(job)

    def _random_instance(self, d: cd.Decision, sreq: cd.ScheduleRequest, now: float) -> cd.Decision:
        """The `random` scheduler of FAST'25 Fig. 5: any prefill instance, local prefix only."""
        p = self.view.prefill[self.rng.choice(sorted(self.prefill))]
        local = self.caches[p.id].prefix_blocks(sreq.keys)
        tokens = cd.prefix_tokens(local, sreq.prompt_tokens, self.ccfg.block_tokens)
        t_prefill = self.costs.prefill.prefill_s(sreq.prompt_tokens, tokens)
        ttft = p.queue_s(now) + t_prefill
        return dataclasses.replace(
            d, prefill_instance=p.id, prefix_tokens=tokens, takes_remote=False, copy=None,
            transfer_s=0.0, queue_s=p.queue_s(now), prefill_s=t_prefill, predicted_ttft_s=ttft,
            stage_instances=(),
        )  # fmt: skip

    def _reject(self, req: SimRequest, stage: str, reason: str) -> None:
        req.rejected = f"{stage}:{reason}"
        self.rejections[stage] = self.rejections.get(stage, 0) + 1

    # --- prefill ---------------------------------------------------------------------------

    def start_prefill(
        self, group: tuple[str, ...], req: SimRequest, decision: cd.Decision
    ) -> float:
        """Seconds the prefill takes on `group` (stage 0 first), with the prefix that is
        really there now on stage 0's node (every stage loads its layers of it)."""
        pid = group[0]
        self.view.apply(cl.PrefillStarted(req.rid), self.loop.now)
        local = self.caches[pid].prefix_blocks(req.keys)
        prefix = local
        if decision.takes_remote:
            prefix = max(local, self.view.blocks.match(req.keys).best_blocks)
        bt = self.cfg.block_tokens
        tokens = cd.prefix_tokens(prefix, req.prompt, bt)
        transfer = 0.0
        if prefix > local:
            moved = cd.prefix_tokens(prefix - local, req.prompt, bt)
            transfer = self.costs.transfer.transfer_s(moved)
        compute = self._compute_s(len(group), req.prompt, tokens)
        req.reused_tokens = tokens
        req.prefill_compute_s = compute
        return transfer + compute

    def _compute_s(self, stages: int, prompt: int, cached: int) -> float:
        """One instance's prefill, or the pipeline's over `stages` (core/cpp.py)."""
        if stages == 1:
            return self.costs.prefill.prefill_s(prompt, cached)
        cpp = self.ccfg.cpp
        hop = self.costs.hop_s(cpp.chunk_tokens)
        return group_prefill_s(self.costs.prefill.prefill_s, cpp, stages, cached, prompt, hop)

    def prefilled(self, pid: str, req: SimRequest, decision: cd.Decision) -> None:
        now = self.loop.now
        evicted = self.caches[pid].insert(req.keys)
        if req.keys:
            self.view.apply(cl.BlocksStored(pid, req.keys), now)
        if evicted:
            self.view.apply(cl.BlocksRemoved(pid, tuple(evicted)), now)
        self.view.apply(cl.PrefillFinished(req.rid), now)
        req.first_token(now)
        if req.generated >= req.output:
            req.finished_at = now
            self.view.apply(cl.DecodeFinished(req.rid, req.generated), now)
            return
        layer_share = self.costs.transfer.transfer_s(req.prompt) / 80.0
        self.loop.after(layer_share, self._to_decode, req, decision)

    # --- decode ----------------------------------------------------------------------------

    def _to_decode(self, req: SimRequest, decision: cd.Decision) -> None:
        assert decision.decode_instance is not None
        if self.cfg.policy == "baseline":
            inst = self.view.decode[decision.decode_instance]
            verdict = admission.decode_stage_check(
                self.view, inst, req.prompt, self.ccfg, self.costs
            )
            if not verdict.accept:
                req.wasted_prefill = True
                self._reject(req, "decode", str(verdict.reason))
                self.view.apply(cl.RequestDropped(req.rid), self.loop.now)
                return
        self.decode[decision.decode_instance].join(req)

    def _joined(self, req: SimRequest) -> None:
        if not req.preemptions:  # a rejoin: the view has kept it as decoding throughout
            self.view.apply(cl.DecodeStarted(req.rid), self.loop.now)

    def _done(self, req: SimRequest) -> None:
        self.view.apply(cl.DecodeFinished(req.rid, req.generated), self.loop.now)

    def _never_fits(self, req: SimRequest) -> None:
        """Its KV needs more pages than the decode instance has at all."""
        req.wasted_prefill = True
        self._reject(req, "decode", "kv_never_fits")
        self.view.apply(cl.RequestDropped(req.rid), self.loop.now)

    def load(self) -> tuple[float, float]:
        """(prefill load, decode load) now, as PAPER.md §5 measures them (SLO pressure)."""
        now = self.loop.now
        pre = [p.queue_s(now) / self.ccfg.ttft_slo_s for p in self.view.prefill_order]
        step = self.costs.decode.decode_step_s
        dec = [
            step(w.running.__len__(), w.context) / self.ccfg.tbt_slo_s if w.running else 0.0
            for w in self.decode.values()
        ]
        return sum(pre) / max(len(pre), 1), sum(dec) / max(len(dec), 1)
