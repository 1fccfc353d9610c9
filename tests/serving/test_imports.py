"""The front's stub loads no torch (about 2 s and 200 MB a stub): it only validates, admits
and relays. Checked in a fresh interpreter where importing torch fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys, types
pb = types.ModuleType("triton_python_backend_utils")
pb.__getattr__ = lambda name: type(name, (), {})  # the stub's module, as far as imports go
sys.modules["triton_python_backend_utils"] = pb
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
import MODULE
"""


def test_front_model_imports_without_torch() -> None:
    for module in ("python_backends.serving.front", "python_backends.front.validation",
                   "python_backends.wire"):
        run = subprocess.run([sys.executable, "-c", PROBE.replace("MODULE", module)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]
