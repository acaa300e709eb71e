"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def triton_cpu(monkeypatch):
    """Force the Triton path and interpret it on CPU tensors."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    yield
