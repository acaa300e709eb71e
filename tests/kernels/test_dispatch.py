from __future__ import annotations

import os
import warnings

import pytest
import torch

from torchnitro.errors import BackendUnavailableError, ConfigError
from torchnitro.kernels import dispatch, rms_norm


def test_auto_on_cpu_uses_reference_silently(monkeypatch):
    monkeypatch.delenv("TORCHNITRO_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.select_backend(torch.randn(2)) == "reference"


def test_explicit_triton_on_cpu_raises(monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="rms_norm: TORCHNITRO_KERNELS=triton.*CUDA"):
        rms_norm(torch.randn(2, 8), torch.ones(8))


def test_explicit_reference_wins_over_interpreter(monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNELS", "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.select_backend(torch.randn(2)) == "reference"


def test_interpreter_enables_triton_on_cpu(triton_cpu):
    assert dispatch.select_backend(torch.randn(2)) == "triton"


def test_unknown_backend_names_the_known_ones(monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNELS", "cuda")
    with pytest.raises(ConfigError, match="'auto', 'reference', 'triton'"):
        dispatch.select_backend(torch.randn(2))


def test_auto_falls_back_with_one_warning_when_triton_missing(monkeypatch):
    monkeypatch.delenv("TORCHNITRO_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "triton_importable", lambda: False)
    monkeypatch.setattr(dispatch, "_warned", set())
    fake_cuda = torch.empty(0, device="meta")  # stands in for a CUDA tensor: only .device.type is read
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")), raising=False)
    with pytest.warns(UserWarning, match="falling back"):
        assert dispatch.select_backend(fake_cuda) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.select_backend(fake_cuda) == "reference"


def test_rows_longer_than_the_row_kernel_use_reference(triton_cpu, monkeypatch):
    from torchnitro.kernels import softmax

    monkeypatch.setattr(dispatch, "MAX_ROW_COLS", 16)
    with pytest.raises(BackendUnavailableError, match="exceed the row kernel"):
        softmax(torch.randn(2, 40))  # explicit TORCHNITRO_KERNELS=triton: refuse
    monkeypatch.setenv("TORCHNITRO_KERNELS", "auto")
    monkeypatch.setattr(dispatch, "_warned", set())
    with pytest.warns(UserWarning, match="using the PyTorch reference"):
        y = softmax(torch.randn(2, 40))
    torch.testing.assert_close(y.sum(-1), torch.ones(2))


_HELPERS_CHECK = """
import os
import torch
os.environ["TRITON_INTERPRET"] = "1"
os.environ["TORCHNITRO_KERNELS"] = "triton"
from torchnitro.kernels import softmax
from torchnitro.kernels._triton import _import_language
tl = _import_language()  # the first triton import of this process, as in a user's program
from triton.runtime.jit import JITFunction
assert isinstance(tl.sum, JITFunction), "triton.language was imported interpreted despite _import_language"
y = softmax(torch.randn(2, 9))  # tl.sum/tl.max are swapped for interpreted twins only during the launch
assert isinstance(tl.sum, JITFunction) and isinstance(tl.max, JITFunction), (tl.sum, tl.max)
torch.testing.assert_close(y.sum(-1), torch.ones(2))
"""


def test_interpreted_launches_leave_triton_compiled_helpers_in_place(triton_cpu):
    """Never skipped, whatever ran before: if another test already imported triton.language in
    interpreted mode in this process, the check runs in a fresh interpreter instead."""
    import subprocess
    import sys

    from torchnitro.kernels._triton import _import_language

    tl = _import_language()
    from triton.runtime.jit import JITFunction

    if isinstance(tl.sum, JITFunction):
        exec(_HELPERS_CHECK, {})  # noqa: S102 - the same check as in the subprocess, in this process
        return
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORCHNITRO_KERNELS")}
    r = subprocess.run([sys.executable, "-c", _HELPERS_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
