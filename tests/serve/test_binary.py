"""The binary tensor data extension: raw bytes built by hand, then tritonclient.http's defaults."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.serve import binary
from torchnitro.serve.binary import BinaryParser, encode_response, read_request
from torchnitro.serve.protocol import ModelSignature, TensorSpec, parse_infer_request

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool  # noqa: E402

SIG = ModelSignature("m", [TensorSpec("x", "FP32", (-1, 4)), TensorSpec("ids", "INT64", (-1, -1), value_range=(0, 9))],
                     [TensorSpec("y", "FP32", (-1, 4)), TensorSpec("n", "INT64", (-1,))])


def binary_body(header: dict, *blobs: bytes) -> tuple[bytes, str]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), str(len(head))


def x_ids(x: np.ndarray, ids: np.ndarray, **extra) -> tuple[bytes, str]:
    xb, ib = x.astype("<f4").tobytes(), ids.astype("<i8").tobytes()
    return binary_body({"inputs": [
        {"name": "x", "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": len(xb)}},
        {"name": "ids", "shape": list(ids.shape), "datatype": "INT64", "parameters": {"binary_data_size": len(ib)}},
    ], **extra}, xb, ib)


def test_binary_inputs_are_read_and_validated_like_json():
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
    ids = np.array([[1, 2, 3], [4, 5, 9]])
    body, n = x_ids(x, ids, id="r")
    item = parse_infer_request(read_request(body, n), SIG)
    assert torch.equal(item.tensors[0], torch.from_numpy(x)) and item.tensors[1].tolist() == ids.tolist()
    assert item.rows == 2 and item.length == 3 and item.id == "r"
    for bad_x, bad_ids, match in [
        (np.full((1, 4), np.nan), np.array([[1]]), "NaN"),
        (np.ones((1, 4)), np.array([[10]]), r"received values in \[10, 10\], this model takes \[0, 9\]"),
        (np.ones((1, 3)), np.array([[1]]), r"dimension 1 is 3, expected 4"),
    ]:
        body, n = x_ids(bad_x, bad_ids)
        with pytest.raises(InputError, match=match):
            parse_infer_request(read_request(body, n), SIG)


@pytest.mark.parametrize("mutate,match", [
    (lambda body, n: (body + b"\0", n), r"1 bytes after the last binary input"),
    (lambda body, n: (body[:-1], n), r"binary_data_size 24 does not fit the 23 bytes left"),
    (lambda body, n: (body, str(len(body) + 1)), r"Inference-Header-Content-Length: received '\d+' for a"),
    (lambda body, n: (body, str(int(n) - 1)), r"are not valid JSON"),
])
def test_malformed_binary_bodies_are_input_errors(mutate, match):
    body, n = x_ids(np.ones((1, 4)), np.array([[1, 2, 3]]))
    body, n = mutate(body, n)
    with pytest.raises(InputError, match=match):
        read_request(body, n)


def test_byte_count_that_is_not_whole_elements_is_refused():
    body, n = binary_body({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 15}}]}, b"\0" * 15)
    with pytest.raises(InputError, match="15 bytes of FP32 data, expected a multiple of 4"):
        read_request(body, n)


def test_outputs_binary_per_output_all_or_none():
    y, cnt = torch.arange(8.0).view(2, 4), torch.tensor([3, 7])
    body, n = x_ids(np.ones((2, 4)), np.ones((2, 3)),
                    outputs=[{"name": "n", "parameters": {"binary_data": True}}, {"name": "y"}])
    item = parse_infer_request(read_request(body, n), SIG)
    assert item.outputs == ("n", "y") and item.binary_outputs == {"n"}
    data, hlen = encode_response(SIG, [y, cnt], item)
    head = json.loads(data[:hlen])
    assert [o["name"] for o in head["outputs"]] == ["n", "y"]
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 16} and "data" not in head["outputs"][0]
    assert head["outputs"][1]["data"] == y.reshape(-1).tolist()
    assert np.frombuffer(data[hlen:], "<i8").tolist() == [3, 7]
    every = parse_infer_request(read_request(*x_ids(np.ones((2, 4)), np.ones((2, 3)),
                                                    parameters={"binary_data_output": True})), SIG)
    data, hlen = encode_response(SIG, [y, cnt], every)
    assert np.frombuffer(data[hlen:hlen + 32], "<f4").tolist() == y.reshape(-1).tolist()
    plain = parse_infer_request(read_request(*x_ids(np.ones((2, 4)), np.ones((2, 3)))), SIG)
    data, hlen = encode_response(SIG, [y, cnt], plain)
    assert hlen is None and json.loads(data)["outputs"][1]["data"] == [3, 7]
    with pytest.raises(InputError, match=r"unknown \['z'\]"):
        parse_infer_request(read_request(*x_ids(np.ones((2, 4)), np.ones((2, 3)), outputs=[{"name": "z"}])), SIG)


def test_a_repeated_header_is_parsed_once_and_every_body_still_checked(monkeypatch):
    """BinaryParser reuses what a header decided; each body's own bytes are still read and checked."""
    calls = []
    slow = binary.parse_infer_request
    monkeypatch.setattr(binary, "parse_infer_request", lambda req, sig: calls.append(1) or slow(req, sig))
    parser = BinaryParser()
    rng = np.random.default_rng(1)
    for k in range(4):  # same header bytes, different data every time
        x, ids = rng.standard_normal((2, 4)).astype(np.float32), rng.integers(0, 10, (2, 3))
        item = parser.parse(*x_ids(x, ids, parameters={"binary_data_output": True, "priority": 1}), SIG)
        assert torch.equal(item.tensors[0], torch.from_numpy(x)) and item.tensors[1].tolist() == ids.tolist()
        assert (item.rows, item.length, item.priority, item.binary_outputs) == (2, 3, 1, {"y", "n"})
        item.tensors[0].add_(1)  # the tensors are the request's own: writable, not views of the body
    assert len(calls) == 1
    params = {"binary_data_output": True, "priority": 1}
    for bad_x, bad_ids, match in [
        (np.full((2, 4), np.nan), np.ones((2, 3)), "NaN"),
        (np.ones((2, 4)), np.full((2, 3), 10), r"received values in \[10, 10\], this model takes \[0, 9\]"),
    ]:
        with pytest.raises(InputError, match=match):
            parser.parse(*x_ids(bad_x, bad_ids, parameters=params), SIG)
    body, n = x_ids(np.ones((2, 4)), np.ones((2, 3)), parameters=params)
    with pytest.raises(InputError, match="1 bytes after the last binary input"):
        parser.parse(body + b"\0", n, SIG)  # a known header with a body of another size: checked in full
    with pytest.raises(InputError, match="Inference-Header-Content-Length: received"):
        parser.parse(body, str(len(body) + 1), SIG)
    other = ModelSignature("m", SIG.inputs, SIG.outputs)  # another model of the same name: its own plan
    assert parser.parse(body, n, other).rows == 2 and len(calls) == 2


def test_headers_with_an_id_or_over_4_kb_are_not_kept():
    parser = BinaryParser()
    for rid in ("a", "b"):
        assert parser.parse(*x_ids(np.ones((1, 4)), np.ones((1, 3)), id=rid), SIG).id == rid
    long = x_ids(np.ones((1, 4)), np.ones((1, 3)), parameters={"note": "x" * 5000})
    assert parser.parse(*long, SIG).rows == 1
    assert parser._plans == {}


def test_repeated_answer_headers_follow_shapes_and_ids():
    y, cnt = torch.arange(8.0).view(2, 4), torch.tensor([3, 7])
    item = parse_infer_request(read_request(*x_ids(np.ones((2, 4)), np.ones((2, 3)),
                                                   parameters={"binary_data_output": True})), SIG)
    for rows in (2, 1, 2):  # a cached header for 2 rows must not answer the 1-row request
        data, hlen = encode_response(SIG, [y[:rows], cnt[:rows]], item)
        head = json.loads(data[:hlen])
        assert [o["shape"] for o in head["outputs"]] == [[rows, 4], [rows]] and "id" not in head
        assert [o["parameters"]["binary_data_size"] for o in head["outputs"]] == [16 * rows, 8 * rows]
        assert np.frombuffer(data[hlen:hlen + 16 * rows], "<f4").tolist() == y[:rows].reshape(-1).tolist()
        assert np.frombuffer(data[hlen + 16 * rows:], "<i8").tolist() == cnt[:rows].tolist()
    item.id = "r7"
    data, hlen = encode_response(SIG, [y, cnt], item)
    assert json.loads(data[:hlen])["id"] == "r7"


@contextlib.contextmanager
def affine_server():
    cfg = ServeConfig(port=0, workers=0)
    srv = InferenceServer([ModelEndpoint("affine", make_pool("torchnitro.serve.testing:affine", "affine", cfg))],
                          cfg).start_in_thread()
    try:
        yield f"127.0.0.1:{srv.port}"
    finally:
        srv.stop()


def test_http_binary_request_and_response_by_hand():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    xb = x.tobytes()
    body, n = binary_body({"id": "b1", "inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32",
                                                   "parameters": {"binary_data_size": len(xb)}}],
                           "parameters": {"binary_data_output": True}}, xb)
    with affine_server() as addr:
        r = httpx.post(f"http://{addr}/v2/models/affine/infer", content=body, timeout=10,
                       headers={"Inference-Header-Content-Length": n, "Content-Type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        hlen = int(r.headers["inference-header-content-length"])
        head = json.loads(r.content[:hlen])
        assert head["id"] == "b1" and head["outputs"][0]["shape"] == [3, 4]
        y = np.frombuffer(r.content[hlen:], "<f4").reshape(3, 4)
        np.testing.assert_array_equal(y, x * 2 + 1)
        bad = httpx.post(f"http://{addr}/v2/models/affine/infer", content=body[:-4], timeout=10,
                         headers={"Inference-Header-Content-Length": n})
        assert bad.status_code == 400 and "does not fit" in bad.json()["error"]
        assert "binary_tensor_data" in httpx.get(f"http://{addr}/v2", timeout=10).json()["extensions"]


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_defaults(binary):
    http = pytest.importorskip("tritonclient.http")
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    with affine_server() as addr:
        client = http.InferenceServerClient(addr)
        assert client.is_server_ready() and client.is_model_ready("affine")
        inp = http.InferInput("x", [2, 4], "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = http.InferRequestedOutput("y", binary_data=binary)
        res = client.infer("affine", [inp], outputs=[out])
        np.testing.assert_allclose(res.as_numpy("y"), x * 2 + 1, rtol=1e-6)
        res = client.infer("affine", [inp])  # no outputs named: tritonclient asks for all, binary
        np.testing.assert_allclose(res.as_numpy("y"), x * 2 + 1, rtol=1e-6)
        client.close()


@pytest.mark.parametrize("bad, refused", [(np.inf, True), (-np.inf, True), (np.nan, True), (3e38, False),
                                          (-3e38, False)])
def test_kept_header_refuses_nan_and_infinity_and_takes_huge_finite_values(bad, refused):
    """The kept-header path reads the body's bytes in place and still refuses NaN and infinity (and
    only them: values near the FP32 limit are data), with no warning beside the 400."""
    import warnings

    parser, params = BinaryParser(), {"binary_data_output": True}
    parser.parse(*x_ids(np.ones((2, 4)), np.ones((2, 3)), parameters=params), SIG)  # keeps the header
    x = np.full((2, 4), 3e38, np.float32)
    x[1, 2] = bad
    with warnings.catch_warnings(record=True) as seen:  # the refusal is the answer: nothing in the log beside it
        if refused:
            with pytest.raises(InputError, match="'x': contains NaN or infinity"):
                parser.parse(*x_ids(x, np.ones((2, 3)), parameters=params), SIG)
        else:
            item = parser.parse(*x_ids(x, np.ones((2, 3)), parameters=params), SIG)
            assert torch.equal(item.tensors[0], torch.from_numpy(x))
    assert [str(w.message) for w in seen] == []
    assert len(parser._plans) == 1  # a refused body leaves the kept header as it was


@pytest.mark.parametrize("outputs", [None, [{"name": "n"}, {"name": "y"}], [{"name": "y"}]])
def test_kept_answer_layouts_write_what_the_full_encoder_writes(outputs):
    """encode_response's kept layouts (header + each tensor's bytes) equal the full encoder's answer
    byte for byte, for views of a batch, outputs in another order, a dtype to convert, a bf16 output
    and tensors that need grad; a changed shape or dtype is a new layout."""
    extra = {"parameters": {"binary_data_output": True}}
    if outputs is not None:
        extra["outputs"] = [{**o, "parameters": {"binary_data": True}} for o in outputs]
    item = parse_infer_request(read_request(*x_ids(np.ones((2, 4)), np.ones((2, 3)), **extra)), SIG)
    batch_y, batch_n = torch.arange(24.0).view(6, 4), torch.arange(6)
    cases = [[batch_y[2:4], batch_n[2:4]], [batch_y[4:6], batch_n[4:6]],  # views of one batch: a kept layout
             [batch_y[:3], batch_n[:3]],  # another row count
             [batch_y[:2].double(), batch_n[:2].int()],  # dtypes the encoder converts
             [batch_y[:2].clone().requires_grad_(), batch_n[:2]], [batch_y[1:3], batch_n[1:3]]]
    for outs in cases:
        fast = encode_response(SIG, outs, item)
        assert fast == binary._encode(SIG, outs, item)
        assert encode_response(SIG, outs, item) == fast  # the second time from the kept layout
    bf = ModelSignature("b", SIG.inputs, [TensorSpec("y", "BF16", (-1, 4)), TensorSpec("n", "INT64", (-1,))])
    outs = [batch_y[:2].bfloat16(), batch_n[:2]]
    assert encode_response(bf, outs, item) == binary._encode(bf, outs, item) == encode_response(bf, outs, item)


def test_batched_binary_and_json_answers_equal_the_model_row_by_row():
    """mlp in the server process (--workers 0, its batches on the event loop once measured):
    48 concurrent requests, binary and JSON mixed into the same batches with different data, each
    answered with its own rows; binary answers equal JSON answers for the same input."""
    import asyncio

    from torchnitro.nn.zoo import get_builtin
    from torchnitro.serve.batcher import BatchingConfig

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1 + i % 3, 512)).astype(np.float32) for i in range(24)]
    model = get_builtin("mlp").build().eval()
    cfg = ServeConfig(port=0, workers=0, threads=1, inline_loop_ms=1000)  # on the loop once measured
    pool = make_pool("mlp", "mlp", cfg)
    srv = InferenceServer([ModelEndpoint("mlp", pool, BatchingConfig(max_batch_size=16, max_wait_ms=20))],
                          cfg).start_in_thread()

    async def one(client, x, binary_: bool):
        if binary_:
            xb = x.tobytes()
            body, n = binary_body({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                               "parameters": {"binary_data_size": len(xb)}}],
                                   "parameters": {"binary_data_output": True}}, xb)
            r = await client.post("/v2/models/mlp/infer", content=body, headers={"Inference-Header-Content-Length": n})
            assert r.status_code == 200, r.text
            hlen = int(r.headers["inference-header-content-length"])
            return np.frombuffer(r.content[hlen:], "<f4").reshape(x.shape)
        r = await client.post("/v2/models/mlp/infer", json={"inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]})
        assert r.status_code == 200, r.text
        return np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(x.shape)

    async def main():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", timeout=30) as client:
            await one(client, xs[0], True)  # first batch: measured on the pool's thread
            return await asyncio.gather(*(one(client, x, b) for b in (True, False) for x in xs))

    try:
        got = asyncio.run(main())
    finally:
        srv.stop()
    assert pool.on_loop >= 1  # later batches ran on the event loop
    with torch.inference_mode():
        for k, (b, j) in enumerate(zip(got[:24], got[24:])):
            want = model(torch.from_numpy(xs[k])).numpy()
            np.testing.assert_allclose(b, j, rtol=1e-5, atol=1e-6)  # in other batches: BLAS blocking differs
            np.testing.assert_allclose(b, want, rtol=1e-4, atol=1e-5)
