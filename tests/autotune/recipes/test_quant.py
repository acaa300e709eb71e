from __future__ import annotations

import torch

from torchnitro.nn.zoo import get_builtin


def test_dynamic_int8_quantises_linears(build):
    b = get_builtin("mlp")
    model = b.build()
    x = b.inputs(8, 0, 0)
    r, built, _ = build("dynamic-int8", model, x)
    assert "3 Linear layers int8" == built.notes
    y, ref = built.fn(*x), model(*x)
    assert torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), dim=0) > 0.99
    assert r.inapplicable_reason(torch.nn.Conv2d(3, 3, 3), x) == "no nn.Linear layers"
    torch.testing.assert_close(r.load(None, {}, model)(*x), y, rtol=0, atol=0)
