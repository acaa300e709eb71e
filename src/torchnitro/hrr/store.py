"""A directory of safetensors + JSON files with a manifest of SHA-256 checksums, verified on load.

Layout::

    store/
      tensors.safetensors   the tensors (no pickle)
      labels.json           JSON side data (e.g. item labels)
      manifest.json         {"format", "version", "meta", "files": {name: {"bytes", "sha256"}}}

The manifest is written last (through a temporary file and an atomic rename), so an interrupted save
leaves no manifest and cannot be loaded. ``load_store`` checks every file's size and hash *before*
reading any of them: a tampered or truncated store raises ``ArtifactError`` and loads nothing.

``mmap=True`` maps the tensors from the file instead of reading them (safetensors' data section is
raw little-endian arrays at known offsets), so a codebook larger than RAM can be searched in chunks.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchnitro.checksum import sha256_file
from torchnitro.errors import ArtifactError, InputError

__all__ = ["save_store", "load_store", "STORE_VERSION"]

STORE_VERSION = 1
_TENSORS, _SIDE, _MANIFEST = "tensors.safetensors", "labels.json", "manifest.json"
_NP_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def save_store(
    directory: str | Path, tensors: dict[str, torch.Tensor], side: Any, *, format: str, meta: dict[str, Any]
) -> Path:
    """Write ``tensors`` (safetensors), ``side`` (JSON) and the manifest into ``directory``."""
    from safetensors.torch import save_file

    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise InputError(f"save: {str(d)!r} exists and is not a directory; pass a directory path")
    d.mkdir(parents=True, exist_ok=True)
    (d / _MANIFEST).unlink(missing_ok=True)  # a half-rewritten store must not look valid
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(d / _TENSORS))
    (d / _SIDE).write_text(json.dumps(side))
    files = {name: {"bytes": (d / name).stat().st_size, "sha256": sha256_file(d / name)} for name in (_TENSORS, _SIDE)}
    manifest = {"format": format, "version": STORE_VERSION, "meta": meta, "files": files}
    tmp = d / (_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, d / _MANIFEST)
    return d


def _read_manifest(d: Path, format: str) -> dict[str, Any]:
    mp = d / _MANIFEST
    if not mp.is_file():
        raise ArtifactError(f"load: {str(d)!r} has no {_MANIFEST}; expected a store written by save() "
                            "(an interrupted save leaves none). Save it again.")
    try:
        manifest = json.loads(mp.read_text())
    except ValueError as exc:
        raise ArtifactError(f"load: {str(mp)!r} is not valid JSON ({exc}); the store is damaged, save it again") from exc
    if manifest.get("format") != format or manifest.get("version") != STORE_VERSION:
        raise ArtifactError(f"load: {str(mp)!r} is format {manifest.get('format')!r} version "
                            f"{manifest.get('version')!r}; expected {format!r} version {STORE_VERSION}")
    return manifest


def _verify(d: Path, manifest: dict[str, Any]) -> None:
    files = manifest.get("files") or {}
    for name in (_TENSORS, _SIDE):
        entry, p = files.get(name), d / name
        if entry is None:
            raise ArtifactError(f"load: the manifest of {str(d)!r} lists no {name!r}; the store is damaged, save it again")
        if not p.is_file():
            raise ArtifactError(f"load: {str(p)!r} is missing; expected {entry['bytes']} bytes. Restore or re-save the store.")
        size = p.stat().st_size
        if size != entry["bytes"]:
            raise ArtifactError(f"load: {str(p)!r} has {size} bytes, the manifest says {entry['bytes']} "
                                "(truncated or modified); nothing was loaded. Restore or re-save the store.")
        digest = sha256_file(p)
        if digest != entry["sha256"]:
            raise ArtifactError(f"load: SHA-256 of {str(p)!r} is {digest[:16]}..., the manifest says "
                                f"{entry['sha256'][:16]}... (tampered or corrupted); nothing was loaded. "
                                "Restore or re-save the store.")


def _mmap_tensors(path: Path) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _NP_DTYPES:
            raise ArtifactError(f"load: tensor {name!r} has dtype {info['dtype']}, which mmap loading does not support")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            out[name] = torch.zeros(shape, dtype=getattr(torch, np.dtype(_NP_DTYPES[info["dtype"]]).name))
            continue
        arr = np.memmap(path, dtype=_NP_DTYPES[info["dtype"]], mode="r", offset=base + start, shape=shape)
        out[name] = torch.from_numpy(arr)  # read-only mapping: writes would raise; ops copy
    return out


def load_store(directory: str | Path, *, format: str, mmap: bool = False) -> tuple[dict[str, torch.Tensor], Any, dict]:
    """Verify every checksum, then return ``(tensors, side, meta)``."""
    import warnings

    from safetensors.torch import load_file

    d = Path(directory)
    if not d.is_dir():
        raise ArtifactError(f"load: {str(d)!r} is not a directory; expected a store written by save()")
    manifest = _read_manifest(d, format)
    _verify(d, manifest)
    if mmap:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we never write to it
            tensors = _mmap_tensors(d / _TENSORS)
    else:
        tensors = load_file(str(d / _TENSORS))
    side = json.loads((d / _SIDE).read_text())
    return tensors, side, manifest.get("meta", {})
