"""Logical-axis sharding rules: name each array dimension once, map names to mesh axes per rule set.

The model annotates every parameter and activation dimension with a *logical* name ("vocab",
"embed", "heads", "mlp", "activation_batch", ...). A rule set maps each logical name to a tuple of
*mesh* axes ("data", "fsdp", "tensor"). Resolution follows MaxText / flax ``logical_to_mesh_axes``:
for each dimension take the rule's mesh axes that exist in the mesh and that no earlier dimension of
the same array already uses; what is left of a rule may be empty (the dimension is replicated).
A dimension whose size is not divisible by the product of its mesh axes raises ``ShapeError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchnitro.errors import ConfigError, ShapeError

__all__ = ["Rules", "RULE_SETS", "data_parallel", "fsdp", "tensor_parallel", "fsdp_tp", "get_rules", "is_axes",
           "logical_to_spec", "tree_shardings", "shard_tree",
           "activation_constraint"]

Axes = tuple  # a tuple of logical names (str) or None, one per array dimension


@dataclass(frozen=True)
class Rules:
    """An ordered mapping logical name -> mesh axes; names without a rule are replicated."""

    name: str  # shown in errors and reports
    rules: tuple[tuple[str, tuple[str, ...]], ...]  # (logical name, mesh axes in priority order)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        for name, axes in self.rules:
            if name == logical:
                return axes
        return ()


_BATCH = (("activation_batch", ("data", "fsdp")),)  # the batch is split over every data-like axis
_TENSOR = (
    ("heads", ("tensor",)), ("kv_heads", ("tensor",)), ("mlp", ("tensor",)), ("vocab", ("tensor",)),
    ("activation_heads", ("tensor",)), ("activation_kv_heads", ("tensor",)), ("activation_mlp", ("tensor",)),
    ("activation_vocab", ("tensor",)),
)
_FSDP = (("embed", ("fsdp",)),)  # ZeRO-3 style: every weight is split along its model-width dimension

data_parallel = Rules("data_parallel", _BATCH)
fsdp = Rules("fsdp", _BATCH + _FSDP)
tensor_parallel = Rules("tensor_parallel", _BATCH + _TENSOR)
fsdp_tp = Rules("fsdp_tp", _BATCH + _FSDP + _TENSOR)

RULE_SETS: dict[str, Rules] = {r.name: r for r in (data_parallel, fsdp, tensor_parallel, fsdp_tp)}


def get_rules(rules: str | Rules) -> Rules:
    """A rule set by name (or passed through); unknown names raise ConfigError listing the known ones."""
    if isinstance(rules, Rules):
        return rules
    if rules not in RULE_SETS:
        raise ConfigError(f"unknown sharding rule set {rules!r}; known: {', '.join(RULE_SETS)}")
    return RULE_SETS[rules]


def is_axes(x: Any) -> bool:
    """True for a leaf of a logical-axes tree: a tuple of str/None (``()`` for a scalar)."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def logical_to_spec(axes: Sequence[str | None], rules: str | Rules, mesh: Mesh,
                    shape: Sequence[int] | None = None, what: str = "array") -> PartitionSpec:
    """PartitionSpec for one array; with ``shape`` also checks every sharded dim divides evenly."""
    r = get_rules(rules)
    if shape is not None and len(shape) != len(axes):
        raise ShapeError(f"{what}: shape {tuple(shape)} has {len(shape)} dims but logical axes {tuple(axes)} "
                         f"name {len(axes)}; give one logical name per dimension")
    used: set[str] = set()
    spec: list[Any] = []
    for i, logical in enumerate(axes):
        chosen = tuple(a for a in r.mesh_axes(logical) if a in mesh.shape and a not in used)
        used.update(chosen)
        if shape is not None and chosen:
            ways = math.prod(mesh.shape[a] for a in chosen)
            if shape[i] % ways:
                raise ShapeError(f"{what}: dim {i} ({logical!r}) has size {shape[i]}, not divisible by the "
                                 f"{ways}-way split over mesh axes {chosen} of rule set {r.name!r}; pad it "
                                 f"(torchnitro.xla.layout) or change the mesh")
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*spec)


def tree_shardings(logical: Any, shapes: Any, rules: str | Rules, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of ``shapes`` (arrays or ShapeDtypeStructs), from the matching logical tree."""
    def one(path: Any, ax: Axes, leaf: Any) -> NamedSharding:
        spec = logical_to_spec(ax, rules, mesh, leaf.shape, what=jax.tree_util.keystr(path))
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, logical, shapes, is_leaf=is_axes)


def shard_tree(tree: Any, logical: Any, rules: str | Rules, mesh: Mesh) -> Any:
    """``device_put`` every leaf of ``tree`` with the sharding its logical axes resolve to."""
    return jax.device_put(tree, tree_shardings(logical, tree, rules, mesh))


def activation_constraint(rules: str | Rules, mesh: Mesh) -> Callable[[jax.Array, tuple], jax.Array]:
    """``constrain(x, logical_axes)`` for the model: ``with_sharding_constraint`` to the resolved spec."""
    r = get_rules(rules)

    def constrain(x: jax.Array, axes: tuple) -> jax.Array:
        spec = logical_to_spec(axes, r, mesh, x.shape, what=f"activation {axes}")
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain
