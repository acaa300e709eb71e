from __future__ import annotations

import torch

from torchnitro.nn.zoo import get_builtin


def test_torchscript_frozen_and_reloadable(build):
    b = get_builtin("encoder")
    model = b.build()
    r, built, work = build("torchscript", model, b.inputs(2, 8, 0))
    x = b.inputs(3, 12, 1)
    torch.testing.assert_close(built.fn(*x), model(*x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r.load(work, {}, None)(*x), built.fn(*x), rtol=0, atol=0)
