"""The paper's baselines: N colocated vLLM-style instances, each doing prefill and decode
on the same GPUs, behind a least-loaded router.

One iteration at a time per instance (vLLM 0.5's scheduler):
- `vllm` / `vllm-prefix`: waiting prefills go first. A prefill iteration runs one whole
  prompt and the running batch waits (its next token is stalled by the prefill); with no
  waiting prompt (or no KV room) the iteration is one decode step of the batch.
- `vllm-chunked`: every iteration is one decode step of the batch plus a chunk of the head
  prompt, the chunk filling a token budget (`chunk_tokens` minus one token per running
  sequence); the iteration takes the sum of both (prefill compute-bound, decode
  memory-bound: assumed not to overlap).
- `vllm-prefix` keeps an LRU cache of the instance's blocks (in HBM: reusing costs no load).

Prefill work for tokens [s, e) of a prompt is `f(e) - f(s)`, f(n) = `prefill_s(n, 0)`: the
analytic model's FLOPs for the new tokens attending to all earlier ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mooncake.core.cost_model import Costs
from mooncake.sim.cache import LRUBlocks
from mooncake.sim.decode import emit_tokens
from mooncake.sim.loop import EventLoop
from mooncake.sim.request import SimRequest

MAX_SEQS = 256  # vLLM max_num_seqs


class ColocatedWorker:
    def __init__(
        self,
        iid: str,
        loop: EventLoop,
        costs: Costs,
        *,
        cache: LRUBlocks | None,
        chunk_tokens: int | None,
        kv_capacity_tokens: int | None,
        on_done: Callable[[SimRequest], None],
    ) -> None:
        self.id, self.loop, self.costs = iid, loop, costs
        self.cache, self.chunk, self.kv_cap = cache, chunk_tokens, kv_capacity_tokens
        self.on_done = on_done
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.context = 0
        self.busy = False
        self.head_done = -1  # tokens of the head prompt already prefilled; -1: not started
        self.pending_s = 0.0  # predicted prefill seconds waiting here (for the router)

    def work(self, tokens: int) -> float:
        return self.costs.prefill.prefill_s(tokens, 0)

    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.pending_s += self.work(req.prompt)
        if not self.busy:
            self._iterate()

    def _head_fits(self) -> bool:
        if not self.waiting or len(self.running) >= MAX_SEQS:
            return False
        if self.head_done >= 0 or self.kv_cap is None or not self.running:
            return True
        return self.context + self.waiting[0].prompt <= self.kv_cap

    def _start_head(self) -> None:
        req = self.waiting[0]
        cached = 0
        if self.cache is not None:
            cached = min(self.cache.prefix_blocks(req.keys) * 512, req.prompt - 1)
        req.reused_tokens = cached
        req.prefill_compute_s = self.work(req.prompt) - self.work(cached)
        self.head_done = cached

    def _iterate(self) -> None:
        prefill_to = -1
        if self._head_fits():
            if self.head_done < 0:
                self._start_head()
            head = self.waiting[0]
            budget = head.prompt if self.chunk is None else self.chunk - len(self.running)
            if budget > 0:
                prefill_to = min(head.prompt, self.head_done + budget)
        decode = bool(self.running) and (self.chunk is not None or prefill_to < 0)
        if prefill_to < 0 and not decode:
            self.busy = False
            return
        self.busy = True
        t = 0.0
        if decode:
            t += self.costs.decode.decode_step_s(len(self.running), self.context)
        if prefill_to >= 0:
            t += self.work(prefill_to) - self.work(self.head_done)
        self.loop.after(t, self._iterated, prefill_to, decode)

    def _iterated(self, prefill_to: int, decode: bool) -> None:
        now = self.loop.now
        if decode:
            self._decode_tokens(now)
        if prefill_to >= 0:
            self.head_done = prefill_to
            if prefill_to >= self.waiting[0].prompt:
                self._prefill_done(self.waiting.popleft(), now)
        self._iterate()

    def _decode_tokens(self, now: float) -> None:
        self.running, self.context = emit_tokens(self.running, self.context, now, self.on_done)

    def _prefill_done(self, req: SimRequest, now: float) -> None:
        self.head_done = -1
        self.pending_s -= self.work(req.prompt)
        if not self.waiting:
            self.pending_s = 0.0
        if self.cache is not None:
            self.cache.insert(req.keys)
        req.first_token(now)
        if req.generated >= req.output:
            req.finished_at = now
            self.on_done(req)
            return
        self.running.append(req)
        self.context += req.context


class ColocatedSystem:
    """N colocated instances; each arrival goes to the least-loaded one (least predicted
    prefill work waiting, then fewest running sequences, then lowest id)."""

    def __init__(
        self,
        loop: EventLoop,
        costs: Costs,
        *,
        instances: int,
        cache_blocks: int | None,
        prefix_cache: bool,
        chunk_tokens: int | None,
        kv_capacity_tokens: int | None,
    ) -> None:
        self.loop = loop
        self.workers = [
            ColocatedWorker(
                f"v{i:02d}",
                loop,
                costs,
                cache=LRUBlocks(cache_blocks) if prefix_cache else None,
                chunk_tokens=chunk_tokens,
                kv_capacity_tokens=kv_capacity_tokens,
                on_done=lambda _r: None,
            )
            for i in range(instances)
        ]
        self.rejections: dict[str, int] = {}
        self.took_remote = 0

    def arrive(self, req: SimRequest) -> None:
        best = min(self.workers, key=lambda w: (round(w.pending_s, 9), len(w.running)))
        best.submit(req)
