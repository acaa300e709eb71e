"""README and docs against results/: every cited results file exists, every ``git show <commit>:results/...``
citation resolves, and the optimize tables carry the numbers of the results file they name (issue 14: every
README number traced to a results file).

The optimize checks parse two README tables and the two tables of ``results/optimize_cpu.md`` they come from;
a README number matches when it is the results value rounded to the README's own digits (half a unit of its
last digit)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OPTIMIZE_RESULTS = ROOT / "results" / "optimize_cpu.md"

# README optimize table: first cell -> the workload key in results/optimize_cpu.md
WORKLOADS = {
    "MiniLM, batch 32 x seq 128": "minilm-b32",
    "MiniLM, batch 1 x seq 16": "minilm-b1",
    "`encoder` (default workload), 8 x 128": "encoder",
    "`lm`, 4 x 128": "lm",
    "`cnn`, 16 x 3 x 64 x 64": "cnn",
    "`mlp`, 64 x 512": "mlp",
}
# README side-by-side table: variant cell -> the results file's variant cell ({chosen} is the chosen recipe)
VARIANTS = {
    "eager fp32": "eager",
    "`{chosen}` (chosen)": "chosen ({chosen})",
    "`bert-unpad` (exact)": "bert-unpad",
    "model cast to bf16": "bf16",
}
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks (their ``results/...`` paths are examples, not citations)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _table(text: str, first_header: str) -> list[dict[str, str]]:
    """Rows of the first markdown table whose header row starts with ``| first_header |``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"| {first_header} |"):
            head = [c.strip() for c in line.strip().strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(head, (c.strip() for c in row.strip().strip("|").split("|")))))
            return rows
    raise AssertionError(f"no table with first column {first_header!r} found; expected one")


def _section(text: str, heading: str) -> str:
    """The text from the heading line that starts with ``heading`` to the next heading of the same level."""
    m = re.search(rf"^({re.escape(heading)}.*)$", text, flags=re.M)
    assert m, f"no heading starting with {heading!r}; expected one"
    level = len(heading) - len(heading.lstrip("#"))
    rest = text[m.end():]
    nxt = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[:nxt.start()] if nxt else rest


def _matches(readme_cell: str, value: float) -> bool:
    """True when the first number in ``readme_cell`` is ``value`` rounded to that number's own digits."""
    m = _NUM.search(readme_cell.replace(",", ""))
    assert m, f"no number in README cell {readme_cell!r}; expected one"
    shown = m.group()
    unit = 10.0 ** -len(shown.split(".")[1]) if "." in shown else 1.0
    return abs(float(shown) - value) <= unit / 2 + 1e-9


def _value(cell: str) -> float:
    m = _NUM.search(cell.replace(",", ""))
    assert m, f"no number in results cell {cell!r}; expected one"
    return float(m.group())


def cited_results_paths(text: str) -> set[str]:
    """``results/<file>`` paths cited in prose (placeholders with ``<``, ``*`` or ``{`` left out)."""
    found = re.findall(r"(?<![\w/:])results/[\w./-]+\.(?:md|json|png)\b", _prose(text))
    return {p for p in found if not re.search(r"[<*{]", p)}


def git_show_citations(text: str) -> set[str]:
    """``<commit>[^]:<path>`` of every ``git show <commit>:<path>`` in the text."""
    return set(re.findall(r"git show ([0-9a-f]{7,40}\^?:[\w./-]*\w)", text))


def optimize_table_mismatches(readme: str, results: str) -> list[str]:
    """README's optimize table against the summary table of results/optimize_cpu.md."""
    summary = {r["workload"]: r for r in _table(results, "workload")}
    out = []
    rows = _table(_section(readme, "### optimize"), "workload")
    assert rows, "the README's optimize table has no rows"
    for row in rows:
        key = WORKLOADS.get(row["workload"])
        if key is None:
            out.append(f"README optimize row {row['workload']!r}: not in WORKLOADS {sorted(WORKLOADS)}; add it")
            continue
        res = summary.get(key)
        if res is None:
            out.append(f"{key}: in README, not in {OPTIMIZE_RESULTS.name}'s summary table")
            continue
        chosen = row["chosen recipe"].strip("`")
        if chosen != res["chosen"]:
            out.append(f"{key}: README chose {chosen!r}, results {res['chosen']!r}")
        for col, rcol in (("speedup vs eager", "chosen_speedup"), ("full search", "full_search_s"),
                          ("cached re-run", "cached_rerun_s")):
            if not _matches(row[col], _value(res[rcol])):
                out.append(f"{key}: README {col} {row[col]!r}, results {rcol} {res[rcol]}")
    return out


def side_by_side_mismatches(readme: str, results: str) -> list[str]:
    """README's MiniLM b32 side-by-side table against the variants table of results/optimize_cpu.md."""
    summary = {r["workload"]: r for r in _table(results, "workload")}
    chosen = summary["minilm-b32"]["chosen"]
    res = {(r["inputs"], r["variant"]): r for r in _table(results, "inputs")}
    out = []
    rows = _table(_section(readme, "### optimize"), "inputs")
    assert rows, "the README's MiniLM side-by-side table has no rows"
    for row in rows:
        inputs = next((k for k in ("realistic sentences", "full-length text") if row["inputs"].startswith(k)), None)
        variant = next((v.format(chosen=chosen) for k, v in VARIANTS.items()
                        if row["variant"] == k.format(chosen=chosen)), None)
        if inputs is None or variant is None:
            out.append(f"README side-by-side row {row['inputs']!r} / {row['variant']!r}: unknown inputs or variant "
                       f"(known variants: {[k.format(chosen=chosen) for k in VARIANTS]})")
            continue
        r = res.get((inputs, variant))
        if r is None:
            out.append(f"{inputs} / {variant}: in README, not in {OPTIMIZE_RESULTS.name}'s variants table")
            continue
        for col, rcol in (("median ms", "median ms"), ("speedup", "speedup"), ("min cosine", "min cosine (held-out)")):
            if not _matches(row[col], _value(r[rcol])):
                out.append(f"{inputs} / {variant}: README {col} {row[col]!r}, results {r[rcol]}")
    return out


def test_every_results_file_cited_in_readme_and_docs_exists():
    missing = [f"{doc.relative_to(ROOT)}: {p}" for doc in _docs()
               for p in sorted(cited_results_paths(doc.read_text())) if not (ROOT / p).exists()]
    assert not missing, f"cited results files that do not exist: {missing}"


def test_every_git_show_citation_resolves():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: git show citations cannot be resolved here")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.stdout.strip() == "true":
        pytest.skip("shallow clone: the cited commits may be absent")
    cited = {(doc.relative_to(ROOT), spec) for doc in _docs() for spec in git_show_citations(doc.read_text())}
    assert cited, "expected README/docs to cite earlier runs by commit"
    bad = [f"{doc}: git show {spec}" for doc, spec in sorted(cited)
           if subprocess.run(["git", "cat-file", "-e", spec], cwd=ROOT, capture_output=True).returncode != 0]
    assert not bad, f"git show citations that name no file at that commit: {bad}"


def test_readme_optimize_table_is_the_results_file():
    bad = optimize_table_mismatches(README.read_text(), OPTIMIZE_RESULTS.read_text())
    assert not bad, "README's optimize table differs from results/optimize_cpu.md:\n" + "\n".join(bad)


def test_readme_minilm_side_by_side_is_the_results_file():
    bad = side_by_side_mismatches(README.read_text(), OPTIMIZE_RESULTS.read_text())
    assert not bad, "README's MiniLM side-by-side table differs from results/optimize_cpu.md:\n" + "\n".join(bad)


def test_checks_catch_a_number_or_a_recipe_that_differs():
    readme, results = README.read_text(), OPTIMIZE_RESULTS.read_text()
    row = next(r for r in _table(_section(readme, "### optimize"), "workload") if r["workload"].startswith("`mlp`"))
    wrong = readme.replace(f"| {row['speedup vs eager']} |", "| 9.99x |", 1)
    assert any("mlp: README speedup" in m for m in optimize_table_mismatches(wrong, results))
    wrong = readme.replace(f"| {row['chosen recipe']} |", "| `eager` |", 1)
    assert any("mlp: README chose" in m for m in optimize_table_mismatches(wrong, results))
    first = _table(_section(readme, "### optimize"), "inputs")[0]
    wrong = readme.replace(f"| {first['variant']} | {first['median ms']} |", f"| {first['variant']} | 1 |", 1)
    assert any("README median ms" in m for m in side_by_side_mismatches(wrong, results))


def test_placeholders_and_code_examples_are_not_citations():
    text = "see `results/x_*.md` and results/<name>.json\n```\ntorchnitro bench compare results/new.json\n```\n" \
           "(`results/optimize_cpu.md`, 06:26)"
    assert cited_results_paths(text) == {"results/optimize_cpu.md"}
    cited = git_show_citations("`git show bcfd875^:results/timing_fairness.md`)")
    assert cited == {"bcfd875^:results/timing_fairness.md"}
