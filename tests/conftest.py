from __future__ import annotations

import os

import pytest
import torch


# test files whose tests share a session fixture: pytest-xdist's --dist loadfile keeps each group on one worker, so the
# fixture is built once (tests/distributed/conftest.py's ranks: two groups of real gloo ranks)
_SHARED_SESSION = {f"tests/distributed/{f}.py": "tests/distributed gloo ranks"
                   for f in ("test_parity", "test_pipeline", "test_pp_comm")}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N --dist loadfile``: one unit per test file, the files of ``_SHARED_SESSION`` one unit together
    (xdist's own ``xdist_group`` mark does not group under pytest 9: it renames ``item._nodeid``, which pytest 9
    no longer reads)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _SharedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _SHARED_SESSION.get(path, path)

    return _SharedFiles(config, log)


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
