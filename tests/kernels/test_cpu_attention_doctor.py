"""``torchnitro doctor`` names what the padding-free encoders' attention runs as here, or why not."""

from __future__ import annotations

import pytest

from torchnitro.cli import main
from torchnitro.kernels import cpu_attention


def test_doctor_names_the_native_attention_kernel_or_why_not(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    why = cpu_attention.cpu_attention_reason()
    expected = cpu_attention.kernel_name("bf16") if why is None else "no: native attention unavailable"
    assert "native cpu attention" in out and expected in out


def test_doctor_says_why_when_no_compiler(capsys, monkeypatch):
    monkeypatch.setattr(cpu_attention, "COMPILER", "no-such-cc-torchnitro")
    monkeypatch.setenv("COLUMNS", "400")  # rich would cut the long cell at the test's 80 columns
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "no-such-cc-torchnitro" in out and "not on PATH" in out
    assert cpu_attention.cpu_attention_reason() is not None


@pytest.fixture(autouse=True)
def _restore_kernel_state():
    yield
    cpu_attention._state.clear()  # the next test builds (or reloads from the disk cache) under the real compiler
