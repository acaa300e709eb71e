"""Why a candidate failed, as one clean line for the report and a few frames for its notes.

A failure reason is the exception's type and message on one line: tensor reprs are elided to
``tensor(...)``, terminal colour codes stripped, progress-bar lines (tqdm, rich) dropped. The frames
that matter (the last ones outside the search harness, outside installed packages where there are
any) go to the candidate's notes, not into the reason.

A child process writes its failure as ``Failure.to_dict()`` to its result file, so the parent never
has to guess the cause from raw stderr; only a child that died without writing one is described by
its exit status and the last non-progress-bar stderr line (``last_stderr_line``).
"""

from __future__ import annotations

import re
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Failure", "clean_line", "elide_tensors", "last_stderr_line"]

REASON_CHARS = 300  # a reason longer than this is cut: the report's 'why' column is one line
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_PROGRESS = re.compile(r"\d+%\|.*\|"  # tqdm: ' 40%|####      | 2/5 [00:01<00:02, 1.9it/s]'
                       r"|[━╸╺─]{4,}"  # rich bars
                       r"|\d+(\.\d+)?\s*(it|s)/(s|it)\b")
_TENSOR_START = re.compile(r"(Parameter containing:\s*)?\btensor\(")
_HARNESS = ("torchnitro/autotune/evaluate.py", "torchnitro/autotune/search.py")


def elide_tensors(text: str) -> str:
    """``tensor([[0.1, ...]], grad_fn=...)`` -> ``tensor(...)`` (nested parentheses respected)."""
    out, pos = [], 0
    for m in _TENSOR_START.finditer(text):
        if m.start() < pos:
            continue  # inside a tensor already elided
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        out.append(text[pos:m.start()] + "tensor(...)")
        pos = i
    return "".join(out) + text[pos:]


def _is_progress(line: str) -> bool:
    return bool(_PROGRESS.search(line))


def _visible_lines(text: str) -> list[str]:
    """Lines without colour codes, carriage-return redraws or progress bars, stripped, non-empty."""
    lines = []
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.split("\r")[-1].strip()  # a redrawn line shows its last state
        if line and not _is_progress(line):
            lines.append(line)
    return lines


def clean_line(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` as one clean line (see the module docstring), cut to ``limit`` characters."""
    line = re.sub(r"\s+", " ", " ".join(_visible_lines(elide_tensors(text)))).strip()
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


def last_stderr_line(text: str) -> str:
    """The last line of a child's stderr that is not a progress bar (cleaned), or ''."""
    lines = _visible_lines(text)
    return clean_line(lines[-1]) if lines else ""


def _installed(filename: str) -> bool:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    return "site-packages" in filename or any(filename.startswith(p) for p in paths)


def _frames(tb: Any, keep: int = 3) -> list[str]:
    """The last ``keep`` frames that matter, innermost last: the search harness is dropped; code
    outside installed packages (the recipe, the user's model) is preferred; the raising frame is kept."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.replace("\\", "/").endswith(_HARNESS)]
    if not frames:
        return []
    mine = [f for f in frames if not _installed(f.filename)]
    chosen = (mine or frames)[-keep:]
    if frames[-1] not in chosen:
        chosen = chosen[-(keep - 1):] + [frames[-1]] if keep > 1 else [frames[-1]]
    return [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} in {f.name}" for f in chosen]


@dataclass
class Failure:
    """A candidate's failure: what the report shows (``reason``) and what goes to its notes (``frames``)."""

    type: str  # exception class name; '' for a failure that is not an exception (crash, timeout)
    message: str
    frames: list[str] = field(default_factory=list)  # 'dir/file.py:LINE in func', innermost last
    budget: bool = False  # it could not start within the search's remaining budget: 'skipped', not 'failed'

    @classmethod
    def from_exception(cls, exc: BaseException) -> "Failure":
        return cls(type(exc).__name__, str(exc), _frames(exc.__traceback__))

    @property
    def reason(self) -> str:
        return clean_line(f"{self.type}: {self.message}" if self.type else self.message)

    @property
    def notes(self) -> str:
        return ("at " + " <- ".join(reversed(self.frames))) if self.frames else ""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message[:4000], "frames": list(self.frames)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Failure":
        return cls(str(d.get("type", "")), str(d.get("message", "")), [str(f) for f in d.get("frames", [])])
