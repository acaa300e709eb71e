"""``optimize`` in a real Jupyter kernel, as a user runs it (issue 15, item 1).

The notebook's model class lives in the kernel's ``__main__`` (no file, no main guard) and holds a closure
chosen by a lambda, so pickle refuses it. The isolated recipe (ONNX Runtime) and the final comparison's
fresh processes (``final_alone=True``: eager and the candidate each timed alone) must get programs built in
the kernel, and nothing of the notebook may run again: cell 1 appends a line to a marker file each time it
runs. The kernel is started from this interpreter with its own kernelspec in a temporary folder, so the test
does not depend on a user-level Jupyter installation. Results come back as JSON printed by the last cell.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="building the notebook needs nbformat (the test extra)")
nbclient = pytest.importorskip("nbclient", reason="running the notebook needs nbclient (the test extra)")
pytest.importorskip("ipykernel", reason="the notebook's kernel needs ipykernel (the test extra)")
pytest.importorskip("onnx", reason="the isolated recipe the notebook runs is ONNX Runtime (needs onnx)")
pytest.importorskip("onnxruntime", reason="the isolated recipe the notebook runs is ONNX Runtime")

_MARK = "NOTEBOOK_RESULT "

_CELL_MODEL = '''\
import torch
from torch import nn

with open(MARK, "a") as f:  # a side effect: it must happen once, however the model is optimized
    f.write("cell 1 ran\\n")

def make_act(kind):
    scale = 0.5
    return {"tanh": lambda t: torch.tanh(t) * scale, "relu": lambda t: torch.relu(t) * scale}[kind]

class NotebookNet(nn.Module):
    def __init__(self, act="tanh"):
        super().__init__()
        self.fc1 = nn.Linear(256, 1024)
        self.act = make_act(act)  # a closure chosen by a lambda
        self.fc2 = nn.Linear(1024, 64)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

torch.manual_seed(0)
model = NotebookNet().eval()
x = torch.randn(64, 256)  # big enough that a call costs more than a program's overhead
'''

_CELL_OPTIMIZE = '''\
import pickle
import torchnitro
from torchnitro import OptimizeConfig

try:
    pickle.dumps(model)
    picklable = True
except Exception:
    picklable = False

cfg = OptimizeConfig(recipes=["onnxruntime"], final_alone=True, finalists=1, threads=1, tune_allocator=False,
                     timing_min_iters=2, timing_min_time_s=0.01, final_min_iters=3, final_min_time_s=0.02,
                     held_out=2, candidate_timeout_s=60.0, budget_s=120.0, progress=False, cache_dir=CACHE)
opt = torchnitro.optimize(model, x, cfg)
'''

_CELL_CHECK = '''\
import json
import sys

with torch.no_grad():
    ref = model(x)
y = opt(x)
opt.save(ART)
loaded = torchnitro.load(ART)
y_loaded = loaded(x)
x2 = torch.randn(64, 256)
with torch.no_grad():
    ref2 = model(x2)

def row(name):
    c = opt.report.get(name)
    return {"status": c.status, "reason": c.reason, "isolated": c.isolated, "alone": c.alone,
            "interleaved": c.interleaved, "notes": c.notes}

print(MARK_OUT + json.dumps({
    "module": type(model).__module__,
    "main_file": getattr(sys.modules["__main__"], "__file__", None),
    "picklable": picklable,
    "chosen": opt.recipe,
    "loaded_recipe": loaded.recipe,
    "ort": row("onnxruntime"),
    "eager": row("eager"),
    "err": float((y - ref).abs().max()),
    "err_loaded": float((y_loaded - ref).abs().max()),
    "err_loaded_new_input": float((loaded(x2) - ref2).abs().max()),
    "marker": open(MARK).read().splitlines(),
    "notes": opt.report.notes,
}))
'''


def _kernel_manager(tmp_path: Path):
    """A kernel manager that starts ipykernel from this interpreter (a kernelspec of our own, not the user's)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = tmp_path / "kernels" / "this-python"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "this interpreter", "language": "python"}))
    return KernelManager(kernel_name="this-python",
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]))


def _run_notebook(tmp_path: Path, marker: Path, art: Path) -> dict:
    from nbformat.v4 import new_code_cell, new_notebook

    params = (f"MARK = {str(marker)!r}\nART = {str(art)!r}\nCACHE = {str(tmp_path / 'cache')!r}\n"
              f"MARK_OUT = {_MARK!r}\n")
    nb = new_notebook(cells=[new_code_cell(params), new_code_cell(_CELL_MODEL), new_code_cell(_CELL_OPTIMIZE),
                             new_code_cell(_CELL_CHECK)])
    client = nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path), timeout=300, startup_timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # a cell that raises raises CellExecutionError here, with the kernel's traceback
    texts = [o.get("text", "") for o in nb.cells[-1].outputs if o.get("name") == "stdout"]
    lines = [ln for t in texts for ln in t.splitlines() if ln.startswith(_MARK)]
    assert len(lines) == 1, texts
    return json.loads(lines[0][len(_MARK):])


@pytest.mark.slow
def test_notebook_model_with_closure_optimizes_isolated_in_a_real_kernel(tmp_path, monkeypatch):
    # the kernel's connection file and IPython profile in this test's folder: no user-level Jupyter state
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    marker, art = tmp_path / "cell1_ran.txt", tmp_path / "artifact"
    res = _run_notebook(tmp_path, marker, art)

    # it is a notebook's model: the kernel's __main__, no file behind it, pickle refuses it
    assert res["module"] == "__main__" and res["main_file"] is None and not res["picklable"], res
    assert res["marker"] == ["cell 1 ran"] and marker.read_text().splitlines() == ["cell 1 ran"]  # never re-run

    ort, eager = res["ort"], res["eager"]
    assert ort["isolated"], ort
    if ort["status"] in ("chosen", "verified"):
        assert "built from the onnx program" in ort["notes"], ort["notes"]
        assert ort["alone"] and ort["interleaved"], ort  # the final comparison timed it alone, from its artifact
        # eager's fresh process ran the torch.export program built in the kernel; it times eager alone unless
        # that program measured slower than eager itself (fair.check_eager's band; the row says so)
        assert eager["interleaved"] and "eager's torch.export program alone" in (eager["notes"] + str(res["notes"]))
        assert eager["alone"] == ("so the program is not eager's speed" not in eager["notes"]), eager
    else:  # a rejection or failure must name its cause in one clean line
        reason = ort["reason"]
        assert reason and "\n" not in reason and "\x1b" not in reason and "%|" not in reason, reason
        pytest.fail(f"onnxruntime did not verify on a notebook model: {ort['status']}: {reason}")

    assert res["err"] <= 1e-4, res  # the chosen variant computes what the notebook's model does
    assert res["loaded_recipe"] == res["chosen"]
    assert res["err_loaded"] <= 1e-4 and res["err_loaded_new_input"] <= 1e-4, res
    assert (art / "report.json").is_file()
