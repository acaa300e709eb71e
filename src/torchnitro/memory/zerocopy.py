"""Zero-copy weight loading and safe in-place inference transforms.

``load_weights(path, mmap=True)`` maps the file into memory instead of reading it: tensors are views
of one file-backed storage (``UntypedStorage.from_file``, a private copy-on-write mapping), so no
resident memory is added until a tensor's pages are touched, and writing to a tensor never changes
the file. ``.safetensors`` files are parsed here (8-byte header length, JSON header, raw data);
``.pt``/``.bin`` checkpoints go through ``torch.load(mmap=True, weights_only=True)``.

``load_into_(model, path)`` loads with ``assign=True`` so the model's parameters *are* the mapped
tensors (no second copy). ``resident_bytes()`` reads this process's RSS, which the tests use to show
the mapping costs ~nothing until touched.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchnitro.errors import InputError

__all__ = ["load_weights", "load_into_", "resident_bytes", "read_safetensors_header", "prepare_inference_"]

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20  # safetensors caps the header at 100 MB


def resident_bytes() -> int:
    """Resident set size of this process in bytes (psutil, else /proc/self/statm)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # pragma: no cover - psutil is a dependency
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """(header dict, byte offset where tensor data starts); raises InputError for non-safetensors."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"weights file {str(p)!r} does not exist; expected a .safetensors or .pt file")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n <= 0 or n > min(_MAX_HEADER, size - 8):
            raise InputError(f"{str(p)!r} is not a safetensors file (header length field reads {n}, file is "
                             f"{size} bytes); expected the safetensors layout. Save with safetensors.torch.save_file, "
                             "or pass a .pt/.bin checkpoint, which is loaded with torch.load(mmap=True).")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{str(p)!r} is not a safetensors file: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise InputError(f"{str(p)!r}: safetensors header is a {type(header).__name__}, expected an object")
    return header, 8 + n


def _load_safetensors(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    header, base = read_safetensors_header(path)
    size = path.stat().st_size
    if mmap:
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    else:
        storage = torch.UntypedStorage.from_buffer(path.read_bytes(), dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            start, end = (int(v) for v in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{str(path)!r}: bad safetensors entry for {name!r}: {info!r}") from exc
        if base + end > size or start > end:
            raise InputError(f"{str(path)!r}: tensor {name!r} spans bytes {start}..{end} past the file end; "
                             "the file is truncated")
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, base + start, (end - start,))
        item = torch.empty((), dtype=dtype).element_size()
        if (base + start) % item:
            if "align" not in _warned:
                _warned.add("align")
                warnings.warn(f"{path.name}: tensor {name!r} is not aligned to its dtype; copying it", stacklevel=3)
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape) if end > start else torch.empty(shape, dtype=dtype)
    return out


_warned: set[str] = set()


def load_weights(path: str | Path, *, mmap: bool = True, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a state dict; with ``mmap=True`` (default) tensors are lazily paged views of the file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"weights file {str(p)!r} does not exist; expected a .safetensors or .pt file")
    if p.suffix == ".safetensors":
        state = _load_safetensors(p, mmap)
    elif p.suffix in (".pt", ".pth", ".bin"):
        try:
            state = torch.load(p, mmap=mmap, weights_only=True, map_location="cpu")
        except Exception as exc:  # pickle/zip errors: name the file and what we expected
            raise InputError(f"{str(p)!r} could not be loaded with torch.load(weights_only=True): {exc}. "
                             "Expected a torch.save'd state dict of tensors.") from exc
        if not isinstance(state, dict):
            raise InputError(f"{str(p)!r} holds a {type(state).__name__}, expected a state dict of tensors")
    else:
        read_safetensors_header(p)  # a safetensors file with another suffix is fine; others raise
        state = _load_safetensors(p, mmap)
    dev = torch.device(device)
    if dev.type != "cpu":
        state = {k: v.to(dev, non_blocking=True) for k, v in state.items()}
    return state


def load_into_(model: nn.Module, path: str | Path, *, mmap: bool = True, strict: bool = True) -> nn.Module:
    """Load weights into ``model`` by assignment: parameters become the (mapped) loaded tensors."""
    state = load_weights(path, mmap=mmap)
    try:
        model.load_state_dict(state, strict=strict, assign=True)
    except RuntimeError as exc:
        raise InputError(f"{str(path)!r} does not match {type(model).__name__}: {exc}") from exc
    return model


def prepare_inference_(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """In-place inference setup: eval, no grads kept, optional dtype cast, in-place activations.

    ``ReLU``/``SiLU``/``Hardswish`` inside an ``nn.Sequential`` and right after another module run in
    place: inside a Sequential the previous output feeds only the next module, so overwriting it is
    safe. Other activation modules are left alone (their input may be reused, e.g. a residual).
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"prepare_inference_: received {type(model).__name__}, expected an nn.Module")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    if dtype is not None:
        if not dtype.is_floating_point:
            raise InputError(f"dtype: received {dtype}, expected a floating dtype such as torch.bfloat16")
        model.to(dtype)
    for seq in model.modules():
        if isinstance(seq, nn.Sequential):
            mods = list(seq)
            for i, m in enumerate(mods):
                if i > 0 and isinstance(m, (nn.ReLU, nn.SiLU, nn.Hardswish, nn.ReLU6)):
                    m.inplace = True
    return model
