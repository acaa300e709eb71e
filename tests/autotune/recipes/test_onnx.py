from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")

from torchnitro.nn.zoo import get_builtin  # noqa: E402


@pytest.mark.parametrize("shape", [(2, 16), (5, 23)])
def test_onnxruntime_matches_eager_at_other_sizes(build, shape):
    b = get_builtin("encoder")
    model = b.build()
    r, built, work = build("onnxruntime", model, b.inputs(2, 8, 0), {0: [0, 1]})
    x = b.inputs(*shape, 1)
    torch.testing.assert_close(built.fn(*x), model(*x), rtol=1e-4, atol=1e-4)
    assert built.standalone and (work / "model.onnx").is_file()
    again = r.load(work, built.meta, None)
    torch.testing.assert_close(again(*x), built.fn(*x), rtol=0, atol=0)


def test_onnx_tuple_and_dict_outputs_keep_structure(build):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"logits": y, "probs": y.softmax(-1)}

    model = Two().eval()
    x = (torch.randn(3, 8),)
    _, built, _ = build("onnxruntime", model, x, {0: [0]})
    out = built.fn(*x)
    assert set(out) == {"logits", "probs"}
    torch.testing.assert_close(out["probs"], model(*x)["probs"], rtol=1e-5, atol=1e-5)


def test_onnxruntime_int8_is_close_and_smaller(build):
    b = get_builtin("mlp")
    model = b.build()
    x = b.inputs(8, 0, 0)
    r, built, work = build("onnxruntime-int8", model, x, {0: [0]})
    y, ref = built.fn(*x), model(*x)
    cos = torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99 and not torch.allclose(y, ref, atol=1e-5)  # really quantised, still close
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert (work / "model.onnx").stat().st_size < fp32_bytes / 2
