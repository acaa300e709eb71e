"""benchmarks/memory.py --only-zerocopy: measures the zero-copy section and adds it to saved results,
leaving the other sections as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _bench import load_benchmark


def test_zerocopy_only_adds_its_section_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_RESULTS", str(tmp_path))
    assert hasattr(load_benchmark("memory", module_name="memory_benchmark"), "add_zerocopy_only")
    old = {"title": "planner vs tracker", "columns": ["config", "error"], "rows": [{"config": "a", "error": 0.01}],
           "meta": {"machine": "m"}}
    stale = {"title": "zero-copy loading (an older run)", "columns": ["load"], "rows": [{"load": "x"}], "meta": {}}
    (tmp_path / "memory_x.json").write_text(json.dumps({"meta": {"command": "full run"}, "sections": [old, stale]}))
    # Each run in a fresh interpreter, as the script runs: in a long-lived process glibc's dynamic mmap
    # threshold (raised by earlier frees, up to 32 MiB) can serve the 16 MB read from heap pages that are
    # already resident, and the 'read' rows would then add nothing.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from _bench import load_benchmark; "
            "load_benchmark('memory', module_name='m').add_zerocopy_only('memory_x', size_mb=16)")
    env = {**os.environ, "TORCHNITRO_RESULTS": str(tmp_path)}
    # the run replaces the older zero-copy section instead of adding another
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[1])], env=env, check=True,
                   capture_output=True, timeout=300)
    data = json.loads((tmp_path / "memory_x.json").read_text())
    assert data["meta"] == {"command": "full run"}
    assert [s["title"][:18] for s in data["sections"]] == ["planner vs tracker", "zero-copy loading "]
    assert data["sections"][0] == old
    zc = data["sections"][1]
    assert zc["title"] != stale["title"]
    assert "memory.py" in zc["meta"]["command"] and "torch" in zc["meta"]["versions"]
    added = {(r["load"], r["after"]): r["resident MiB added"] for r in zc["rows"]}
    assert len(added) == 6
    mapped, read = "load_weights(mmap=True)", "load_weights(mmap=False)"
    # 16 MB = 15.3 MiB: mapping pages nothing in until the tensor is read; reading the file copies it at once
    assert added[(mapped, "loading")] < 4 < 12 < added[(mapped, "reading all")]
    assert added[(read, "loading")] > 12
    md = (tmp_path / "memory_x.md").read_text()
    assert "### planner vs tracker" in md and md.count("### zero-copy loading") == 1
