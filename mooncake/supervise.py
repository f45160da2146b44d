"""What `mooncake up` does while it runs, one pass at a time: a worker that exited is started
again. `mooncake up` calls it every half second; `mooncake bench memory` too, and counts
the exits by SIGKILL (what the kernel's OOM killer sends) among what it returns."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake.stack import Stack

# Popen's returncode for a child killed by SIGKILL.
KILLED = -signal.SIGKILL


@dataclass(frozen=True, slots=True)
class Exit:
    name: str  # the role instance, e.g. decode-1
    role: str
    returncode: int | None
    at: float  # time.monotonic() when it was found

    @property
    def killed(self) -> bool:
        return self.returncode == KILLED


def restart_exited(stack: Stack) -> list[Exit]:
    """Restart every worker of `stack` that is not running; what each exit was."""
    exits = []
    for w in list(stack.workers):
        if w.running:
            continue
        code = w.proc.returncode if w.proc is not None else None
        exits.append(Exit(w.name, w.role, code, time.monotonic()))
        stack.restart(w)
    return exits
