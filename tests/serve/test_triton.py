"""Triton's parameter meanings and its config/statistics endpoints, through tritonclient itself."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytest.importorskip("httpx")
tc_http = pytest.importorskip("tritonclient.http")
tc_grpc = pytest.importorskip("tritonclient.grpc")

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.serve.batcher import BatchingConfig  # noqa: E402
from torchnitro.serve.protocol import priority_level  # noqa: E402
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool  # noqa: E402

AFFINE = "torchnitro.serve.testing:affine"


@contextlib.contextmanager
def serving(batching: BatchingConfig):
    cfg = ServeConfig(port=0, grpc_port=0, workers=0)
    srv = InferenceServer([ModelEndpoint("affine", make_pool(AFFINE, "affine", cfg), batching)], cfg)
    srv.start_in_thread()
    try:
        yield srv
    finally:
        srv.stop()


def _inputs(mod, rows: int = 1):
    x = np.arange(4 * rows, dtype=np.float32).reshape(rows, 4)
    inp = mod.InferInput("x", [rows, 4], "FP32")
    inp.set_data_from_numpy(x)
    return x, [inp]


def test_priority_levels_as_triton():
    # 3 levels: Triton's 1 is the most urgent (our level 0), 3 the least; 0 and beyond-range -> default
    assert [priority_level(p, 3, 2) for p in (1, 2, 3)] == [0, 1, 2]
    assert priority_level(0, 3, 2) == 2 and priority_level(4, 3, 2) == 2 and priority_level(0, 3, 0) == 0
    with pytest.raises(ConfigError, match=r"default_priority: received 3, expected a level in \[0, 2\]"):
        BatchingConfig(priority_levels=3, default_priority=3)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_triton_timeout_is_microseconds(transport):
    """A lone request waits out a 10 s batch window; Triton's timeout=100_000 (us) = 0.1 s ends it
    with a deadline error long before (read as ms it would be 100 s, and the window would answer)."""
    with serving(BatchingConfig(max_batch_size=8, max_wait_ms=10_000)) as srv:
        if transport == "http":
            client = tc_http.InferenceServerClient(f"127.0.0.1:{srv.port}", network_timeout=8.0)
        else:
            client = tc_grpc.InferenceServerClient(f"127.0.0.1:{srv.grpc.port}")
        mod = tc_http if transport == "http" else tc_grpc
        _, inputs = _inputs(mod)
        with pytest.raises(Exception, match="deadline passed"):
            client.infer("affine", inputs, timeout=100_000, **({} if transport == "http" else {"client_timeout": 8}))
        assert srv.metrics.stats["affine"].execution_count == 0  # never computed
        assert srv.metrics.stats["affine"].fail.count == 1


def test_model_config_and_statistics_through_tritonclient_http():
    cfg = BatchingConfig(max_batch_size=8, max_wait_ms=2.5, preferred_batch_sizes=(4,), priority_levels=2,
                         default_timeout_ms=750)
    with serving(cfg) as srv:
        client = tc_http.InferenceServerClient(f"127.0.0.1:{srv.port}", network_timeout=30.0)
        conf = client.get_model_config("affine")
        assert conf["max_batch_size"] == 8 and conf["name"] == "affine"
        assert conf["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
        db = conf["dynamic_batching"]
        assert db["max_queue_delay_microseconds"] == 2500 and db["preferred_batch_size"] == [4]
        assert db["priority_levels"] == 2 and db["default_priority_level"] == 1
        assert db["default_queue_policy"]["default_timeout_microseconds"] == 750_000
        assert conf["instance_group"][0]["count"] == 1

        empty = client.get_inference_statistics("affine")["model_stats"][0]
        assert (empty["inference_count"], empty["execution_count"]) == (0, 0)
        for rows in (1, 3, 3):
            x, inputs = _inputs(tc_http, rows)
            np.testing.assert_array_equal(client.infer("affine", inputs, priority=2).as_numpy("y"), 2 * x + 1)
        stats = client.get_inference_statistics("affine")["model_stats"][0]
        assert stats["inference_count"] == 7 and stats["execution_count"] == 3  # each request alone: c=1
        inf = stats["inference_stats"]
        assert inf["success"]["count"] == 3 and inf["fail"]["count"] == 0 and inf["queue"]["count"] == 3
        assert inf["compute_infer"]["count"] == 3  # its ns may read 0: uvloop's clock ticks in ms
        assert inf["success"]["ns"] >= inf["queue"]["ns"] > 0
        assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(1, 1), (3, 2)]
        assert stats["last_inference"] > 0
        everyone = client.get_inference_statistics()["model_stats"]
        assert [m["name"] for m in everyone] == ["affine"] and everyone[0]["inference_count"] == 7
        with pytest.raises(Exception, match="unknown model 'nope'"):
            client.get_model_config("nope")


def test_model_config_and_statistics_through_tritonclient_grpc():
    with serving(BatchingConfig(max_batch_size=8, max_wait_ms=2.5, priority_levels=3, default_priority=2)) as srv:
        client = tc_grpc.InferenceServerClient(f"127.0.0.1:{srv.grpc.port}")
        conf = client.get_model_config("affine").config
        assert (conf.name, conf.max_batch_size, conf.backend) == ("affine", 8, "torchnitro")
        assert [(i.name, i.data_type, list(i.dims)) for i in conf.input] == [("x", tc_grpc.model_config_pb2.TYPE_FP32,
                                                                               [4])]
        db = conf.dynamic_batching
        assert (db.max_queue_delay_microseconds, db.priority_levels, db.default_priority_level) == (2500, 3, 3)
        assert conf.instance_group[0].kind == tc_grpc.model_config_pb2.ModelInstanceGroup.KIND_CPU
        for rows in (2, 2):
            x, inputs = _inputs(tc_grpc, rows)
            np.testing.assert_array_equal(client.infer("affine", inputs).as_numpy("y"), 2 * x + 1)
        stats = client.get_inference_statistics("affine").model_stats[0]
        assert (stats.inference_count, stats.execution_count) == (4, 2)
        assert stats.inference_stats.success.count == 2 and stats.inference_stats.compute_infer.count == 2
        assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(2, 2)]
        assert [m.name for m in client.get_inference_statistics().model_stats] == ["affine"]
