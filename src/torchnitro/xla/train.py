"""A sharded training step: ``jax.jit`` with explicit input/output shardings from logical-axis rules.

Parameters, optimizer state and the batch get the shardings their logical axes resolve to under
the rule set on the mesh (data parallel, FSDP, tensor parallel or a mix); XLA's SPMD partitioner
inserts the collectives. The same step on a 1-device mesh is the reference the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchnitro.xla.rules import Rules, get_rules, tree_shardings

__all__ = ["BATCH_AXES", "TrainStep", "sharded_train_step", "opt_state_shardings"]

# logical axes of each batch entry: (B, T) token ids, batch split over the data-like axes
BATCH_AXES: dict[str, tuple[str, ...]] = {"tokens": ("activation_batch", "activation_length"),
                                          "targets": ("activation_batch", "activation_length")}


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any, param_shardings: Any,
                        mesh: Mesh) -> Any:
    """Optimizer-state shardings: moments follow their parameter, scalars (step counts) are replicated."""
    state_shapes = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(optimizer, lambda _, s: s, state_shapes, param_shardings,
                                 transform_non_params=lambda _: replicated)


@dataclass
class TrainStep:
    """A compiled-on-first-call step ``(params, opt_state, batch) -> (params, opt_state, loss)``."""

    fn: Callable  # the jitted step
    mesh: Mesh  # where it runs
    rules: Rules  # how parameters and the batch are split
    param_shardings: Any  # a NamedSharding per parameter leaf
    opt_shardings: Any  # a NamedSharding per optimizer-state leaf
    batch_shardings: Any  # a NamedSharding per batch entry
    optimizer: optax.GradientTransformation  # for init()

    def __call__(self, params: Any, opt_state: Any, batch: Mapping[str, jax.Array]) -> tuple[Any, Any, jax.Array]:
        return self.fn(params, opt_state, batch)

    def init(self, params: Any) -> tuple[Any, Any]:
        """Place a copy of ``params`` on the mesh (the step donates it) and build the optimizer state there."""
        params = jax.device_put(params, self.param_shardings, may_alias=False)
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(params)
        return params, opt_state

    def place_batch(self, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return jax.device_put(dict(batch), self.batch_shardings)

    def lower(self, params: Any, opt_state: Any, batch: Any) -> Any:
        """``jax.stages.Lowered`` for arrays or ShapeDtypeStructs (AOT: nothing is allocated)."""
        return self.fn.trace(params, opt_state, batch).lower()


def sharded_train_step(loss: Callable[[Any, Any], jax.Array], optimizer: optax.GradientTransformation,
                       mesh: Mesh, rules: str | Rules, param_logical: Any, params_like: Any,
                       batch_like: Mapping[str, Any], batch_logical: Mapping[str, tuple] | None = None,
                       donate: bool = True) -> TrainStep:
    """Build the step for ``loss(params, batch)``; ``*_like`` are arrays or ShapeDtypeStructs giving shapes.

    ``param_logical`` is the parameter tree with a tuple of logical names per leaf
    (``torchnitro.xla.model.logical_axes``); the rule set resolves them against ``mesh``.
    """
    r = get_rules(rules)
    ps = tree_shardings(param_logical, params_like, r, mesh)
    os_ = opt_state_shardings(optimizer, params_like, ps, mesh)
    bl = dict(batch_logical or {k: BATCH_AXES[k] for k in batch_like})
    bs = tree_shardings(bl, dict(batch_like), r, mesh)
    scalar = NamedSharding(mesh, PartitionSpec())

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    fn = jax.jit(step, in_shardings=(ps, os_, bs), out_shardings=(ps, os_, scalar),
                 donate_argnums=(0, 1) if donate else ())
    return TrainStep(fn, mesh, r, ps, os_, bs, optimizer)
