"""What Triton clients read besides inference: a model's configuration and its statistics.

``model_config`` describes a served model in Triton's ``ModelConfig`` JSON layout (what
``tritonclient.http.InferenceServerClient.get_model_config`` returns): inputs and outputs without
the batch dimension, ``max_batch_size``, and the batcher's policy as ``dynamic_batching`` (window in
microseconds, preferred sizes, priority levels, queue bound and default timeout). ``model_stats``
is Triton's statistics layout (``get_inference_statistics``) filled from the batcher's observer
(``metrics.ModelStats``): requests answered, time queued, batches computed and their compute time
per batch size. Fields Triton has and this server does not measure separately (``compute_input``,
``compute_output``: the worker's input/output copies are inside ``compute_infer``) are zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torchnitro.serve.metrics import ServeMetrics
    from torchnitro.serve.server import ModelEndpoint

__all__ = ["model_config", "model_stats"]


def _tensors(specs: Any) -> list[dict[str, Any]]:
    # Triton leaves the batch dimension out of dims when max_batch_size > 0
    return [{"name": s.name, "data_type": f"TYPE_{'STRING' if s.datatype == 'BYTES' else s.datatype}",
             "dims": list(s.shape[1:])} for s in specs]


def model_config(ep: "ModelEndpoint") -> dict[str, Any]:
    """``ep`` as Triton's model configuration (JSON form)."""
    sig, cfg = ep.signature, ep.batching
    kind = "KIND_GPU" if type(ep.pool).__name__ == "DevicePool" else "KIND_CPU"
    timeout_us = 0 if cfg.default_timeout_ms is None else int(cfg.default_timeout_ms * 1e3)
    return {
        "name": ep.name, "platform": sig.platform, "backend": "torchnitro", "max_batch_size": cfg.max_batch_size,
        "version_policy": {"latest": {"num_versions": 1}},
        "input": _tensors(sig.inputs), "output": _tensors(sig.outputs),
        "dynamic_batching": {
            "preferred_batch_size": list(cfg.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(cfg.max_wait_ms * 1e3),
            "priority_levels": cfg.priority_levels,
            "default_priority_level": cfg.default_priority + 1,  # Triton's levels start at 1
            "default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": timeout_us,
                                     "allow_timeout_override": True, "max_queue_size": cfg.max_queue_size},
        },
        "instance_group": [{"name": ep.name, "kind": kind, "count": ep.pool.size}],
    }


def model_stats(metrics: "ServeMetrics", endpoints: list["ModelEndpoint"]) -> dict[str, Any]:
    """Triton's ``{"model_stats": [...]}`` for ``endpoints``, from the batchers' observers."""
    from torchnitro.serve.metrics import ModelStats

    return {"model_stats": [metrics.stats.get(ep.name, ModelStats()).to_dict(ep.name, ep.signature.versions[0])
                            for ep in endpoints]}
