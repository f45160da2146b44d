"""A deterministic discrete-event simulator that drives the same core/ code as the workers.

`run_simulation(trace, SimConfig(...))` replays a Mooncake trace through one system:
`mooncake` (prefill and decode pools, a global KVCache pool, the Conductor's Algorithm 1
and an admission policy) or one of the paper's colocated baselines (`vllm`, `vllm-prefix`,
`vllm-chunked`). `mooncake.sim.paper` regenerates the paper's experiments.
"""

from mooncake.sim.runner import SYSTEMS, SimConfig, SimResult, run_simulation

__all__ = ["SYSTEMS", "SimConfig", "SimResult", "run_simulation"]
