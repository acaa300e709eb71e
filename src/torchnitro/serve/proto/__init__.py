"""The KServe v2 gRPC protocol: ``grpc_predict_v2.proto`` and its checked-in Python messages."""

from __future__ import annotations

__all__: list[str] = []
