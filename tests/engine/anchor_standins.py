"""Stand-ins for llama.cpp that `bench.child` builds in a child process (a module of its
own: the child imports only this, not the tests and torch)."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

import numpy as np

from mooncake.bench.llamacpp import Runner


class FakeContext:
    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def get_logits_ith(self, i: int) -> object:
        assert i == -1
        return self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class FakeLlama:
    """Records what it is asked to evaluate; its last logits favour token (n_tokens * 7) % V."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.n_tokens, self.evals = vocab, 0, []
        self.last = np.zeros(vocab, dtype=np.float32)
        self._ctx = FakeContext(self.last)

    def n_vocab(self) -> int:
        return self.vocab

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        self.evals.append(list(tokens))
        time.sleep(0.005)  # a time that does not round to nothing against the engine's
        self.n_tokens += len(tokens)
        self.last[:] = 0
        self.last[(self.n_tokens * 7) % self.vocab] = 1


def fake_runner(vocab: int) -> Runner:
    """The child's factory: the stand-in, in the child process."""
    return Runner(FakeLlama(vocab))


class Dies:
    def __init__(self, how: str) -> None:
        self.how = how

    def prefill(self, prompt: list[int]) -> float:
        if self.how == "sigill":
            os.kill(os.getpid(), signal.SIGILL)
        if self.how == "hang":
            time.sleep(60)
        os._exit(3)


def dying(how: str) -> Dies:
    return Dies(how)


def not_installed() -> Any:
    import llama_cpp_not_here  # noqa: F401
