"""An artifact's meta rewritten for another intra-op thread count (``meta_with_threads``).

A leaf module (nothing of the autotune package imported): ``artifact.load_artifact`` rewrites a meta for
``torchnitro.load(dir, threads=N)`` with it, and ``fair_threads`` for the thread trial's processes and the count it
records.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["meta_with_threads"]


def meta_with_threads(meta: dict[str, Any], threads: int) -> dict[str, Any]:
    """A copy of an artifact's meta that runs with ``threads`` intra-op threads: torch's (``torch_threads``) and
    the runtime's own where the meta holds one (ONNX Runtime ``threads``, OpenVINO ``INFERENCE_NUM_THREADS``)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        from torchnitro.errors import InputError

        raise InputError(f"threads: received {threads!r}; expected an integer >= 1")
    out = copy.deepcopy(meta)
    if "threads" in out:
        out["threads"] = threads
    ov = out.get("ov_config")
    if isinstance(ov, dict) and "INFERENCE_NUM_THREADS" in ov:
        ov["INFERENCE_NUM_THREADS"] = threads
    out["torch_threads"] = threads
    return out
