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


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


os.environ.setdefault("TORCHNITRO_CACHE_DIR", os.path.join(os.getcwd(), ".torchnitro", "test-cache"))
