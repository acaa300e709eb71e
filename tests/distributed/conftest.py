"""One group of 2 and one of 4 real gloo ranks per test session run every scenario of ``common.py`` (strategies
and pipelines), so the suite pays for process start-up twice; test_parity.py and test_pipeline.py read the
results from the directory this fixture returns."""

from __future__ import annotations

import json

import pytest

from tests.distributed.common import FOUR, PIPE_FOUR, PIPE_TWO, TWO
from tests.distributed.spawn import run_ranks


@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    run_ranks("parity.py", 2, str(out), json.dumps(list({**TWO, **PIPE_TWO}.items())))
    run_ranks("parity.py", 4, str(out), json.dumps(list({**FOUR, **PIPE_FOUR}.items())))
    return out
