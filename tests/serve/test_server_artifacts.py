"""A Python ``InferenceServer`` on an artifact directory it cannot load alone: the same clear error as the CLI's,
raised where the pool is made, before any worker process starts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("uvicorn")

from .test_cli_artifacts import _int8_artifact  # noqa: E402


@pytest.mark.parametrize("workers", [1, 0])
def test_make_pool_refuses_an_artifact_that_needs_the_model_object(tmp_path, monkeypatch, workers):
    """With process workers it returned a pool whose workers each died at start-up with a lifespan traceback."""
    from torchnitro.errors import InputError
    from torchnitro.serve import workers as workers_mod
    from torchnitro.serve.server import ServeConfig, make_pool

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker pool was made for an artifact serve cannot load")

    monkeypatch.setattr(workers_mod, "ProcessPool", no_workers)
    monkeypatch.setattr(workers_mod, "DevicePool", no_workers)
    monkeypatch.setattr(workers_mod, "InlinePool", no_workers)
    art = _int8_artifact(tmp_path / "int8")
    with pytest.raises(InputError) as info:
        make_pool(str(art), "int8", ServeConfig(workers=workers, device="cpu"))
    msg = str(info.value)
    for part in ["dynamic-int8", "no factory reference", "artifact_model(", "torchnitro serve yourmodule:make"]:
        assert part in msg, (part, msg)


def test_make_pool_takes_an_artifact_that_names_its_factory(tmp_path, monkeypatch):
    from torchnitro.serve import workers as workers_mod
    from torchnitro.serve.server import ServeConfig, make_pool

    made = []
    monkeypatch.setattr(workers_mod, "ProcessPool", lambda spec, name, n, **kw: made.append((spec, n)) or "pool")
    art = _int8_artifact(tmp_path / "named", ref={"spec": "mlp"})
    assert make_pool(str(art), "int8", ServeConfig(workers=2, device="cpu")) == "pool"
    assert made == [(str(art), 2)]


def test_check_servable_passes_what_is_not_an_artifact_directory(tmp_path):
    from torchnitro.serve.models import check_servable

    for spec in ["mlp", "torchnitro.serve.testing:affine", str(tmp_path), torch.nn.Linear(2, 2)]:
        assert check_servable(spec) is None  # none raises: each is resolved (or refused) by resolve_model as before
    (tmp_path / "manifest.json").write_text("{not json")
    check_servable(str(tmp_path))  # a damaged manifest is left to the load, which names the damage
