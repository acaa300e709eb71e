from __future__ import annotations

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

from jax.sharding import PartitionSpec as P  # noqa: E402

from torchnitro.errors import ConfigError, ShapeError  # noqa: E402
from torchnitro.xla import rules  # noqa: E402
from torchnitro.xla.mesh import MeshConfig, make_mesh, parse_target  # noqa: E402


@pytest.mark.parametrize("spec,expected", [("2x2x2", (2, 2, 2)), ("-1x2x1", (4, 2, 1)), ("1x-1x4", (1, 2, 4)),
                                           ("8x1x1", (8, 1, 1))])
def test_make_mesh_over_eight_host_devices(spec, expected):
    mesh = make_mesh(spec, axes=("data", "fsdp", "tensor"))
    assert tuple(mesh.shape.values()) == expected
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert mesh.devices.size == 8


@pytest.mark.parametrize("spec,axes,match", [
    ("2x2x4", ("data", "fsdp", "tensor"), "needs 16 devices but 8"),
    ("3x-1x1", ("data", "fsdp", "tensor"), "multiply to 3, which does not divide the 8"),
    ("2x4", ("data", "fsdp", "tensor"), "has 2 sizes but axes"),
    ("2x4", ("data", "expert"), "unknown mesh axis 'expert'"),
    ("-1x-1x2", ("data", "fsdp", "tensor"), "at most one -1"),
    ("2by4", ("data", "fsdp"), "not sizes joined by 'x'"),
])
def test_mesh_errors_name_what_was_received(spec, axes, match):
    with pytest.raises(ConfigError, match=match):
        make_mesh(spec, axes=axes)


def test_mesh_config_dataclass_is_the_same_as_the_string():
    assert MeshConfig((2, -1, 2)).resolve(8) == (2, 2, 2)


@pytest.mark.parametrize("target,match", [("v9:2x2", "generation one of"), ("v5p", "expected '<generation>"),
                                          ("v5e:2xx", "not chip counts")])
def test_unknown_tpu_targets_raise(target, match):
    with pytest.raises(ConfigError, match=match):
        parse_target(target)


def test_maxtext_style_resolution_skips_used_and_missing_axes():
    mesh = make_mesh("2x2x2")
    # the embedding table: vocab over tensor, width over fsdp
    assert rules.logical_to_spec(("vocab", "embed"), rules.fsdp_tp, mesh, (64, 32)) == P("tensor", "fsdp")
    assert rules.logical_to_spec(("vocab", "embed"), rules.data_parallel, mesh) == P(None, None)
    # the batch takes both data-like axes; a second dim asking for fsdp again gets nothing
    assert rules.logical_to_spec(("activation_batch", "embed"), rules.fsdp, mesh) == P(("data", "fsdp"), None)
    # a mesh without a tensor axis leaves tensor-rule dims replicated
    dp_mesh = make_mesh("4x2", axes=("data", "fsdp"))
    assert rules.logical_to_spec(("embed", "heads", "head_dim"), rules.fsdp_tp, dp_mesh) == P("fsdp", None, None)


def test_indivisible_dim_names_the_array_dim_and_split():
    mesh = make_mesh("1x1x8")
    with pytest.raises(ShapeError, match=r"wq: dim 1 \('heads'\) has size 4, not divisible by the 8-way"):
        rules.logical_to_spec(("embed", "heads", "head_dim"), rules.tensor_parallel, mesh, (32, 4, 8), what="wq")
    with pytest.raises(ShapeError, match="has 2 dims but logical axes"):
        rules.logical_to_spec(("embed",), rules.fsdp, mesh, (4, 4))


def test_unknown_rule_set_lists_the_known_ones():
    with pytest.raises(ConfigError, match="known: data_parallel, fsdp, tensor_parallel, fsdp_tp"):
        rules.get_rules("zero3")


@pytest.mark.skipif(__import__("importlib").util.find_spec("libtpu") is None,
                    reason="libtpu is not installed: TPU topology descriptions need it (torchnitro[xla])")
@pytest.mark.parametrize("target,devices", [("v4:2x2x1", 8), ("v4:2x2x2", 16), ("v5p:2x2x2", 8)])
def test_tpu_target_meshes_cover_every_described_device(target, devices):
    # libtpu describes a v4 chip as two devices (no megacore): they share the chip's coords, which
    # create_device_mesh refuses; the mesh then takes the devices in id order
    mesh = make_mesh("1x-1x1", target=target)
    assert mesh.devices.size == devices and mesh.shape["fsdp"] == devices
