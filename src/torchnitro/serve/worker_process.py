"""What runs inside a ``workers.ProcessPool`` worker process, and the tensor encoding of its pipe.

The worker is started with the ``spawn`` method: it imports this module (not the pool's asyncio machinery),
loads the model from its spec string, and answers batches over its pipe until told to stop.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Sequence

import torch
from torch import Tensor

from torchnitro.serve.models import ServedModel, resolve_model

__all__ = ["worker_main", "run_model", "encode", "decode"]


def encode(t: Tensor) -> tuple[str, Any]:
    """``t`` as it crosses the pipe: a numpy array (bf16 as its int16 bits, which numpy lacks)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return "bf16", t.view(torch.int16).numpy()
    return "np", t.numpy()


def decode(obj: tuple[str, Any]) -> Tensor:
    """The tensor ``encode`` sent."""
    kind, arr = obj
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if kind == "bf16" else t


def run_model(model: ServedModel, inputs: Sequence[Tensor]) -> list[Tensor]:
    """One batch through ``model``, no autograd (every replica, in a worker or in the server process)."""
    with torch.inference_mode():
        return model(*inputs)


def worker_main(spec: Any, name: str, conn: Any, arena: Tensor, threads: int, trust_code: bool = False,
                 session_threads: int | None = None) -> None:
    """A worker's life: load ``spec`` with ``threads`` torch threads, say "ready" (or "fail" and why), then answer
    each batch on ``conn`` (inputs in ``arena`` at the layout given, or inline when they did not fit) until "stop"
    or the parent's end of the pipe closes."""
    # Ctrl-C, `docker stop`, systemd and Kubernetes signal the whole process group: the parent
    # drains (finishes in-flight batches on these workers) and then stops them over the pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    try:
        model = resolve_model(spec, name, trust_code=trust_code, threads=session_threads)
    except BaseException as exc:  # noqa: BLE001 - report why loading failed, then exit
        conn.send(("fail", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", model.signature, os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _, bid, layout, inline = msg
        try:
            if inline is not None:
                inputs = [decode(x) for x in inline]
            else:
                inputs = [arena[off:off + nbytes].view(dtype).view(shape) for off, nbytes, dtype, shape in layout]
            outs = run_model(model, inputs)
            conn.send(("ok", bid, [encode(o) for o in outs]))
        except Exception as exc:  # noqa: BLE001 - a bad batch is reported, the worker lives on
            conn.send(("err", bid, f"{type(exc).__name__}: {exc}"))
