"""One group of 2 and one of 4 real gloo ranks per test session run every scenario of ``common.py`` (strategies,
pipelines and the pipelines' counted collectives), so the suite pays for process start-up twice; test_parity.py,
test_pipeline.py and test_pp_comm.py read the results from the directory this fixture returns."""

from __future__ import annotations

import json

import pytest

from tests.distributed.common import COMM_FOUR, FOUR, PIPE_FOUR, PIPE_TWO, TWO
from tests.distributed.spawn import run_ranks


@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    run_ranks("parity.py", 2, str(out), json.dumps(list({**TWO, **PIPE_TWO}.items())))
    run_ranks("parity.py", 4, str(out), json.dumps(list({**FOUR, **PIPE_FOUR, **COMM_FOUR}.items())), timeout=150.0)
    return out
