from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_settle_pause(monkeypatch):
    """A final comparison whose eager drifted is redone after ``fair.SETTLE_S`` (2 s) for a burst of foreign load to
    pass. Tests time tiny models for milliseconds, which a busy machine disturbs often: the redo still runs, at once
    (no test measures the pause; tests/autotune/test_final_check.py checks the redo itself)."""
    import torchnitro.autotune.fair as fair

    monkeypatch.setattr(fair, "SETTLE_S", 0.0)


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


os.environ.setdefault("TORCHNITRO_CACHE_DIR", os.path.join(os.getcwd(), ".torchnitro", "test-cache"))
