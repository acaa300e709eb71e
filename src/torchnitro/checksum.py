"""File checksums shared by every on-disk format that verifies itself (artifacts, hrr stores)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["sha256_file"]


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, streamed in 4 MiB chunks (works for files larger than RAM)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
