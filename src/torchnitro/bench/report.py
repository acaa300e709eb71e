"""Result tables for benchmark scripts: rich in the terminal, JSON + Markdown on disk, PNG plots."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["ResultTable", "results_dir", "save_plot", "format_value"]


def results_dir() -> Path:
    """Where benchmark outputs go: $TORCHNITRO_RESULTS or ./results."""
    d = Path(os.environ.get("TORCHNITRO_RESULTS", "results"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def format_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 100:
            return f"{v:.0f}"
        if a >= 1:
            return f"{v:.2f}"
        if a >= 1e-3:
            return f"{v:.4f}"
        return f"{v:.2e}"
    return str(v)


@dataclass
class ResultTable:
    """Rows of results with fixed columns, plus metadata (machine, command, notes)."""

    title: str
    columns: Sequence[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, **row: Any) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"row has columns {sorted(unknown)} not in the table's {list(self.columns)}")
        self.rows.append(row)

    def to_markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        sep = "| " + " | ".join("---" for _ in self.columns) + " |"
        body = ["| " + " | ".join(format_value(r.get(c)) for c in self.columns) + " |" for r in self.rows]
        lines = [f"### {self.title}", ""]
        for k, v in self.meta.items():
            lines.append(f"- {k}: {v}")
        if self.meta:
            lines.append("")
        return "\n".join(lines + [head, sep, *body]) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": list(self.columns), "rows": self.rows, "meta": self.meta}

    def rich(self):  # -> rich.table.Table
        from rich.table import Table

        t = Table(title=self.title)
        for c in self.columns:
            t.add_column(c)
        for r in self.rows:
            t.add_row(*(format_value(r.get(c)) for c in self.columns))
        return t

    def print(self) -> None:
        from rich.console import Console

        Console().print(self.rich())

    def save(self, name: str, directory: str | Path | None = None) -> tuple[Path, Path]:
        """Write ``<dir>/<name>.json`` and ``<dir>/<name>.md``; returns both paths."""
        d = Path(directory) if directory is not None else results_dir()
        d.mkdir(parents=True, exist_ok=True)
        self.meta.setdefault("written", time.strftime("%Y-%m-%d %H:%M:%S"))
        jp, mp = d / f"{name}.json", d / f"{name}.md"
        jp.write_text(json.dumps(self.to_json(), indent=2, default=str))
        mp.write_text(self.to_markdown())
        return jp, mp


def save_plot(fig: Any, name: str, directory: str | Path | None = None) -> Path:
    """Save a matplotlib figure as ``<dir>/<name>.png`` and close it."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    d = Path(directory) if directory is not None else results_dir()
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.png"
    fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return p
