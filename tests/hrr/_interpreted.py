"""Run a test script under the Triton interpreter in a fresh process.

Triton picks interpreted or compiled mode when it is imported, so interpreter tests cannot share the
pytest process with anything that imported Triton already.
"""

import os
import subprocess
import sys

import pytest


def run_interpreted(script: str, timeout: float = 300) -> None:
    """Run ``script`` with ``TRITON_INTERPRET=1``; it must print ``ok`` last and exit 0."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
