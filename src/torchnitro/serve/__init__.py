"""torchnitro.serve: dynamic batching (no HTTP needed) and a KServe v2 HTTP server.

``DynamicBatcher`` / ``BatchingConfig`` work in any asyncio program. The HTTP side
(``torchnitro.serve.server``, ``metrics``, ``loadtest``) needs the ``serve`` extra and is imported
only when used.
"""

from __future__ import annotations

from torchnitro.serve.adaptive import AdaptivePolicy, LatencyCurve
from torchnitro.serve.batcher import BatchingConfig, DynamicBatcher
from torchnitro.serve.models import ServedModel, resolve_model, signature_from_example
from torchnitro.serve.protocol import ModelSignature, TensorSpec

__all__ = ["AdaptivePolicy", "BatchingConfig", "DynamicBatcher", "LatencyCurve", "ModelSignature", "ServedModel",
           "TensorSpec", "resolve_model", "signature_from_example"]
