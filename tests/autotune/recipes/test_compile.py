from __future__ import annotations

import torch


def test_torch_compile_default_on_tiny_mlp(build):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    x = (torch.randn(4, 8),)
    _, built, _ = build("compile", model, x)
    torch.testing.assert_close(built.fn(*x), model(*x), rtol=1e-4, atol=1e-5)
