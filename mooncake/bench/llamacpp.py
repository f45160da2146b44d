"""llama.cpp on the same GGUF, the anchor `bench engine` times beside the engine (the
optional `anchors` extra, llama-cpp-python). It runs in a child process (`bench.child`):
nothing here imports torch, and `runner` is what the child builds."""

from __future__ import annotations

import time
from typing import Any

NOT_INSTALLED = "llama-cpp-python is not installed (pip install '.[anchors]')"


class Runner:
    """The two timed calls, each returning its seconds: a prompt's prefill, and greedy
    decode after a prompt (the prompt's prefill outside the clock)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - start

    def decode(self, prompt: list[int], steps: int) -> float:
        """Seconds of `steps` greedy tokens (argmax of the last logits, then eval of it)."""
        import numpy as np

        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(steps):
            # The last position's logits as llama.cpp left them (llama-cpp-python keeps
            # `scores` only with logits_all).
            last = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
            llm.eval([int(np.argmax(last))])
        return time.perf_counter() - start


def runner(model_path: str, threads: int, context: int) -> Runner:
    """llama.cpp with `threads` threads over the GGUF at `model_path` (in the child)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model_path, n_ctx=context, n_batch=512, n_threads=threads,
        n_threads_batch=threads, logits_all=False, verbose=False,
    )  # fmt: skip
    return Runner(llm)
