from __future__ import annotations

import json

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.serve.protocol import (
    ModelSignature,
    TensorSpec,
    assemble,
    encode_infer_response,
    parse_infer_request,
    split_outputs,
)

SIG = ModelSignature("m", [TensorSpec("ids", "INT64", (-1, -1)), TensorSpec("mask", "INT64", (-1, -1))],
                     [TensorSpec("hidden", "FP32", (-1, -1, 3)), TensorSpec("pooled", "FP32", (-1, 3))])
FSIG = ModelSignature("f", [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1, 4))])


def body(rows: int, seq: int, **extra):
    ids = list(range(1, rows * seq + 1))
    return {"inputs": [{"name": "ids", "shape": [rows, seq], "datatype": "INT64", "data": ids},
                       {"name": "mask", "shape": [rows, seq], "datatype": "INT64", "data": [1] * rows * seq}],
            **extra}


def test_parse_valid_request_with_parameters():
    item = parse_infer_request(json.dumps(body(2, 3, id="r1", parameters={"priority": 1, "timeout": 50_000})), SIG)
    assert item.rows == 2 and item.length == 3 and item.id == "r1"
    assert item.priority == 1 and item.timeout_ms == 50.0  # timeout in microseconds, as in Triton
    assert item.tensors[0].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_nested_data_is_accepted():
    req = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [[1, 2, 3, 4], [5, 6, 7, 8]]}]}
    item = parse_infer_request(req, FSIG)
    assert item.tensors[0].dtype == torch.float32
    assert item.tensors[0].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]  # rows kept in order, not just the shape


@pytest.mark.parametrize("mutate,match", [
    (lambda b: b["inputs"][0].update(datatype="FP32"), r"datatype 'FP32' received, expected 'INT64'"),
    (lambda b: b["inputs"][0].update(shape=[2]), r"rank 1.*expected rank 2"),
    (lambda b: b["inputs"][0].update(data=[1, 2]), r"has 2 elements, shape \[2, 3\] needs 6"),
    (lambda b: b["inputs"].pop(), r"missing \['mask'\]"),
    (lambda b: b["inputs"].append({"name": "zzz"}), r"unknown \['zzz'\]"),
    (lambda b: b["inputs"][0].update(data=["a"] * 6), r"received strings \(e.g. 'a'\), expected INT64"),
    (lambda b: b["inputs"][0].update(data=["1"] * 6), r"received strings \(e.g. '1'\), expected INT64"),
    (lambda b: b["inputs"][0].update(data=[1, 2, 3, 4, 5, 101.7]), r"received 101.7 for INT64, expected whole"),
    (lambda b: b["inputs"][0].update(data=[1, 2, 3, 4, 5, 2**63]), r"could not be read as INT64|INT64 holds"),
    (lambda b: b["inputs"][0].update(data=[1, 2, [3], 4, 5, 6]), r"could not be read as INT64"),
    (lambda b: b["inputs"][0].update(shape=[2, 0], data=[]), r"received shape \[2, 0\] with an empty dim"),
    (lambda b: b["inputs"][1].update(shape=[2, 2], data=[1] * 4), r"disagree on dimension 1"),
    (lambda b: b.update(parameters={"priority": "high"}), r"parameters.priority: received 'high'"),
    (lambda b: b.update(parameters={"timeout": -5}), r"parameters.timeout: received -5"),
])
def test_bad_requests_say_what_and_expected(mutate, match):
    b = body(2, 3)
    mutate(b)
    with pytest.raises(InputError, match=match):
        parse_infer_request(json.dumps(b), SIG)


def test_malformed_json_nan_and_fixed_dims():
    with pytest.raises(InputError, match="not valid JSON"):
        parse_infer_request(b"{nope", SIG)
    with pytest.raises(InputError, match="'inputs' list"):
        parse_infer_request(b"[1, 2]", SIG)
    nan = '{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, NaN, 3, 4]}]}'
    with pytest.raises(InputError, match="NaN"):
        parse_infer_request(nan, FSIG)
    wrong = {"inputs": [{"name": "x", "shape": [1, 5], "datatype": "FP32", "data": [1] * 5}]}
    with pytest.raises(InputError, match=r"dimension 1 is 5, expected 4"):
        parse_infer_request(wrong, FSIG)


@pytest.mark.parametrize("data,match", [
    (["1.5", "2", "3", "4"], r"received strings \(e.g. '1.5'\), expected FP32 values as JSON numbers"),
    (["true", 1, 2, 3], r"received strings"),
    ([True, False, True, True], r"received booleans \(e.g. True\), expected FP32"),
])
def test_float_inputs_take_numbers_only(data, match):
    req = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": data}]}
    with pytest.raises(InputError, match=match):
        parse_infer_request(json.dumps(req), FSIG)


def test_integral_floats_become_ints_and_small_types_keep_their_range():
    item = parse_infer_request(json.dumps(body(1, 2) | {"inputs": [
        {"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [101.0, 7]},
        {"name": "mask", "shape": [1, 2], "datatype": "INT64", "data": [1, 1]}]}), SIG)
    assert item.tensors[0].tolist() == [[101, 7]] and item.tensors[0].dtype == torch.int64
    usig = ModelSignature("u", [TensorSpec("b", "UINT8", (-1, 2))], [TensorSpec("y", "FP32", (-1, 2))])
    with pytest.raises(InputError, match=r"received values in \[3, 300\], UINT8 holds \[0, 255\]"):
        parse_infer_request({"inputs": [{"name": "b", "shape": [1, 2], "datatype": "UINT8", "data": [3, 300]}]},
                            usig)


def test_model_limits_value_range_and_length():
    sig = ModelSignature("tok", [TensorSpec("ids", "INT64", (-1, -1), value_range=(0, 99), max_length=8)],
                         [TensorSpec("y", "FP32", (-1, 4))])

    def ids(data, shape=None):
        return {"inputs": [{"name": "ids", "shape": shape or [1, len(data)], "datatype": "INT64", "data": data}]}

    assert parse_infer_request(ids([0, 99, 5]), sig).tensors[0].tolist() == [[0, 99, 5]]
    with pytest.raises(InputError, match=r"'ids': received values in \[3, 100\], this model takes \[0, 99\]"):
        parse_infer_request(ids([3, 100]), sig)
    with pytest.raises(InputError, match=r"received values in \[-5, 4\]"):
        parse_infer_request(ids([-5, 4]), sig)
    with pytest.raises(InputError, match=r"dimension 1 \(length\) is 9, this model takes at most 8"):
        parse_infer_request(ids(list(range(9))), sig)


def test_deeply_nested_json_is_a_clear_input_error():
    deep = ('{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": '
            + "[" * 10_000 + "]" * 10_000 + "}]}")
    with pytest.raises(InputError, match="nests JSON too deeply"):
        parse_infer_request(deep, FSIG)
    mid = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": json.loads("[" * 500 + "]" * 500)}]}
    with pytest.raises(InputError, match="could not be read as FP32"):
        parse_infer_request(json.dumps(mid), FSIG)


@pytest.mark.parametrize("lengths", [(3, 5, 1), (7, 7)])
def test_assemble_pads_and_split_unpads(lengths):
    items = [parse_infer_request(body(1 + i % 2, n), SIG) for i, n in enumerate(lengths)]
    buffers = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
    batch, padded = assemble(items, SIG, buffers)
    assert padded == max(lengths)
    assert batch[0].shape == (sum(it.rows for it in items), max(lengths))
    assert int(batch[1].sum()) == sum(it.rows * it.length for it in items)  # padding is mask 0
    # a fake model: hidden = ids broadcast to 3 channels, pooled = masked mean
    hidden = batch[0].float().unsqueeze(-1).expand(-1, -1, 3)
    pooled = (hidden * batch[1].unsqueeze(-1)).sum(1) / batch[1].sum(1, keepdim=True)
    per = split_outputs([hidden, pooled], items, SIG, padded)
    for it, (h, p) in zip(items, per):
        assert h.shape == (it.rows, it.length, 3)
        assert torch.equal(h[..., 0], it.tensors[0].float())
        assert torch.allclose(p[:, 0], it.tensors[0].float().mean(1))
    again, _ = assemble(items[:1], SIG, buffers)  # reused: same storage, no new allocation
    assert again[0].data_ptr() == buffers[0].data_ptr()


def test_encode_response_round_trip():
    out = encode_infer_response(FSIG, [torch.arange(8.0).view(2, 4)], "abc")
    d = json.loads(out)
    assert d["id"] == "abc" and d["outputs"][0]["shape"] == [2, 4]
    assert d["outputs"][0]["data"] == list(range(8))


def test_out_of_range_float_is_rejected_without_warnings():
    import warnings

    req = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 1e40, 3, 4]}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match="NaN or infinity"):
            parse_infer_request(req, FSIG)


def _assemble_reference(items, sig):
    """Per-request copy with padding: the plain version the one-copy fast path must equal."""
    padded = max((it.length for it in items if it.length is not None), default=None)
    out = []
    for k, spec in enumerate(sig.inputs):
        parts = []
        for it in items:
            t = it.tensors[k]
            if spec.ragged and t.shape[1] != padded:
                t = torch.nn.functional.pad(t, (0, padded - t.shape[1]), value=spec.pad_value)
            parts.append(t)
        out.append(torch.cat(parts))
    return out


@pytest.mark.parametrize("lengths", [(5, 5, 5), (3, 7, 7, 1), (1,)])
def test_assemble_fast_path_equals_per_request_copy(lengths):
    items = [parse_infer_request(body(1 + i % 3, n), SIG) for i, n in enumerate(lengths)]
    buffers = [torch.full((3,), -7, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]  # stale contents
    batch, _ = assemble(items, SIG, buffers)
    for got, want in zip(batch, _assemble_reference(items, SIG)):
        assert torch.equal(got, want)


def test_split_outputs_returns_each_request_its_rows():
    items = [parse_infer_request(body(r, 4), SIG) for r in (2, 1, 3)]
    hidden = torch.arange(6 * 4 * 3, dtype=torch.float32).view(6, 4, 3)
    pooled = torch.arange(18, dtype=torch.float32).view(6, 3)
    per = split_outputs([hidden, pooled], items, SIG, 4)
    starts = [0, 2, 3]
    for (h, p), it, s in zip(per, items, starts):
        assert torch.equal(h, hidden[s:s + it.rows]) and torch.equal(p, pooled[s:s + it.rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_encode_response_non_contiguous_and_low_precision(dtype):
    t = torch.arange(12).view(3, 4).t().to(dtype)  # (4, 3), not contiguous
    sig = ModelSignature("f", [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1, 3))])
    d = json.loads(encode_infer_response(sig, [t], None))
    assert d["outputs"][0]["shape"] == [4, 3]
    assert d["outputs"][0]["data"] == t.float().reshape(-1).tolist()


def test_element_count_and_nan_checks_name_the_input():
    short = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1.0] * 7}]}
    with pytest.raises(InputError, match=r"'x': 'data' has 7 elements, shape \[2, 4\] needs 8"):
        parse_infer_request(short, FSIG)
    nested = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [[1.0, 2.0, float("nan"), 4.0]]}]}
    with pytest.raises(InputError, match="'x': contains NaN"):
        parse_infer_request(nested, FSIG)
    ok = parse_infer_request({"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                                          "data": [[1, 2, 3, 4], [5, 6, 7, 8]]}]}, FSIG)
    assert ok.tensors[0].dtype == torch.float32 and ok.tensors[0].shape == (2, 4)
