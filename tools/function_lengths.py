"""The longest functions in src/, read from the AST: ``python tools/function_lengths.py [--top N]``.

Style asks that functions fit on a screen (issue 17: under 60 lines). Not counted: Triton kernels
(``_name_kernel`` by the kernel layering rule, or decorated with ``jit``), whose length follows the
math, and code generators whose body is mostly one source template (a string literal over half of
the lines). ``--all`` counts them too. Lengths run from the ``def`` line to the last line of the body.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    decorated = any("jit" in ast.unparse(d) for d in node.decorator_list)
    return decorated or (node.name.startswith("_") and node.name.endswith("_kernel"))


def _template_lines(node: ast.AST) -> int:
    """Lines taken by the largest string literal (or f-string) inside ``node``."""
    best = 0
    for n in ast.walk(node):
        if isinstance(n, (ast.JoinedStr, ast.Constant)) and (not isinstance(n, ast.Constant) or isinstance(n.value, str)):
            best = max(best, (n.end_lineno or n.lineno) - n.lineno + 1)
    return best


def functions(src: Path, include_all: bool = False) -> list[tuple[int, str, str]]:
    """(lines, qualified name, path:line) of every function under ``src``, longest first."""
    out = []
    for path in sorted(src.resolve().rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    stack.append((child, name + "."))
                    if isinstance(child, ast.ClassDef):
                        continue
                    n = (child.end_lineno or child.lineno) - child.lineno + 1
                    generated = _template_lines(child) * 2 > n
                    if include_all or not (_is_kernel(child) or generated):
                        out.append((n, name, f"{path.relative_to(ROOT)}:{child.lineno}"))
                else:
                    stack.append((child, prefix))
    return sorted(out, key=lambda t: (-t[0], t[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=10, help="how many to list")
    ap.add_argument("--all", action="store_true", help="count kernels and source templates too")
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="tree to read")
    args = ap.parse_args()
    for n, name, where in functions(args.src, args.all)[: args.top]:
        print(f"{n:5d}  {name:50s} {where}")


if __name__ == "__main__":
    main()
