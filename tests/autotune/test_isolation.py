"""No user class crosses a process boundary; failure reasons are one clean line; the budget is honest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torchnitro
from torchnitro.autotune.failure import Failure, clean_line, last_stderr_line
from torchnitro.autotune.recipe import register_recipe, unregister_recipe
from torchnitro.autotune.report import Status

HERE = Path(__file__).parent
ORT = pytest.importorskip("onnxruntime", reason="the isolated recipe these tests run is ONNX Runtime")


@pytest.fixture
def iso_recipes():
    import isolation_recipes as ir

    classes = [ir.DirtyRaise, ir.DiesUnderProgressBar, ir.SlowStart]
    for c in classes:
        register_recipe(c)
    yield ir
    for c in classes:
        unregister_recipe(c.name)


def _ort_ran(opt) -> None:
    c = opt.report.get("onnxruntime")
    assert c.isolated and c.status in (Status.CHOSEN, Status.VERIFIED), (c.status, c.reason, opt.report.notes)
    assert "built from the onnx program" in c.notes


def test_script_without_main_guard_is_never_rerun(tmp_path):
    """The child builds from the ONNX export: the user's script (no main guard) runs exactly once."""
    marker = tmp_path / "marker.txt"
    script = tmp_path / "user_script.py"
    script.write_text(
        "import time, torch, torchnitro\n"
        "from pathlib import Path\n"
        "from fake_recipes import fast_config\n"
        f"with open({str(marker)!r}, 'a') as f:\n"
        "    f.write('ran\\n')\n"
        "time.sleep(0.5)  # the expensive part of a user's script (loading weights, ...)\n"
        "class MyNet(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(8, 4)\n"
        "    def forward(self, x):\n"
        "        return torch.relu(self.lin(x))\n"
        "cfg = fast_config(Path(__file__).parent, recipes=['onnxruntime'], finalists=0)\n"
        "opt = torchnitro.optimize(MyNet().eval(), (torch.randn(4, 8),), cfg)\n"
        "c = opt.report.get('onnxruntime')\n"
        "print('RESULT', c.status, c.isolated, c.reason)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert marker.read_text().splitlines() == ["ran"]  # the child never re-ran the script
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(line) == 1, out.stderr[-2000:]
    assert line[0].split()[1:3] in (["chosen", "True"], ["verified", "True"]), line[0]


class _WithLambda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        scale = 0.5
        self.act = lambda x: torch.tanh(x) * scale  # a closure: pickle refuses it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def test_unpicklable_model_runs_isolated(fast_cfg):
    torch.manual_seed(0)
    model = _WithLambda().eval()
    opt = torchnitro.optimize(model, (torch.randn(4, 8),), fast_cfg(recipes=["onnxruntime"], finalists=0))
    _ort_ran(opt)


def test_notebook_model_runs_isolated(fast_cfg):
    """A class defined by ``exec`` in a notebook-like ``__main__`` namespace (no file to import)."""
    ns: dict = {"__name__": "__main__"}
    exec("import torch\n"
         "class NotebookNet(torch.nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.lin = torch.nn.Linear(8, 4)\n"
         "    def forward(self, x):\n"
         "        return self.lin(x).sigmoid()\n", ns)
    model = ns["NotebookNet"]().eval()
    assert type(model).__module__ == "__main__"
    opt = torchnitro.optimize(model, (torch.randn(4, 8),), fast_cfg(recipes=["onnxruntime"], finalists=0))
    _ort_ran(opt)


def _assert_clean(reason: str) -> None:
    assert reason.startswith("ValueError: cache output is not a tensor: got tensor(...) of type DynamicCache"), reason
    assert "\x1b" not in reason and "\n" not in reason and "%|" not in reason and "11." not in reason


@pytest.mark.parametrize("isolate_all", [False, True])
def test_failure_reason_is_one_clean_line(iso_recipes, fast_cfg, isolate_all):
    from fake_recipes import tiny_inputs, tiny_model

    opt = torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(recipes=["test-dirty-raise"],
                                                                      isolate_all=isolate_all))
    c = opt.report.get("test-dirty-raise")
    assert c.status == Status.FAILED and c.isolated == isolate_all
    _assert_clean(c.reason)
    assert "isolation_recipes.py" in c.notes and "in build" in c.notes  # the frame that matters, in the notes


def test_child_dead_without_result_shows_last_real_stderr_line(iso_recipes, fast_cfg):
    from fake_recipes import tiny_inputs, tiny_model

    opt = torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(recipes=["test-dies-under-bar"]))
    c = opt.report.get("test-dies-under-bar")
    assert c.status == Status.FAILED
    assert c.reason == "process exited with code 1: RuntimeError: the real cause", c.reason


def test_candidate_that_cannot_start_in_the_budget_is_skipped(iso_recipes, fast_cfg, monkeypatch):
    """The child's start-up (here: importing the recipe's module, 60 s) is charged to the budget."""
    from fake_recipes import tiny_inputs, tiny_model

    monkeypatch.setenv("TORCHNITRO_TEST_SLOW_IMPORT_S", "60")  # the parent imported the module already
    opt = torchnitro.optimize(tiny_model(), tiny_inputs(),
                              fast_cfg(recipes=["test-slow-start", "torchscript"], budget_s=6.0,
                                       candidate_timeout_s=30.0))
    slow, after = opt.report.get("test-slow-start"), opt.report.get("torchscript")
    assert slow.status == Status.SKIPPED and slow.reason.startswith("budget"), slow.reason
    assert after.status == Status.SKIPPED and after.reason.startswith("budget"), after.reason
    assert opt.recipe == "eager"


def test_exported_program_is_prepared_once_and_shared(tmp_path, monkeypatch):
    import torchnitro.autotune.program as program

    calls = []
    real = program.prepare_program
    monkeypatch.setattr(program, "prepare_program", lambda kind, *a: calls.append(kind) or real(kind, *a))
    progs = program.Programs(nn.Linear(8, 4).eval(), (torch.randn(4, 8),), {0: [0]}, tmp_path)
    first, _ = progs.get("exported", 60.0, 60.0)
    second, _ = progs.get("exported", 60.0, 60.0)
    assert first is second and calls == ["exported"] and first.kind == "exported"
    loaded = program.load_program(first)
    x = torch.randn(2, 8)  # a batch size the example did not have: the batch dim is dynamic
    torch.testing.assert_close(loaded(x), progs.model(x))


def test_recipe_needing_the_model_object_runs_in_process_under_isolate_all(fast_cfg):
    from fake_recipes import tiny_inputs, tiny_model

    opt = torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(recipes=["dynamic-int8"], isolate_all=True,
                                                                      min_speedup=0.0))
    c = opt.report.get("dynamic-int8")
    assert not c.isolated and c.status in (Status.CHOSEN, Status.VERIFIED), (c.status, c.reason)
    assert any("isolated_input='model'" in n and "ran in this process" in n for n in opt.report.notes)


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsBox(nn.Module):
    """Returns an unregistered Python object: neither torch.export nor TorchScript can take it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Box:
        return _Box(self.lin(x))


def test_unexportable_model_is_the_reason_in_one_line(tmp_path):
    import torchnitro.autotune.program as program

    progs = program.Programs(_ReturnsBox().eval(), (torch.randn(2, 4),), {0: [0]}, tmp_path)
    out, _ = progs.get("exported", 60.0, 60.0)
    assert isinstance(out, Failure) and not out.budget
    assert out.reason.startswith("RecipeError: the model could not be exported for the isolated process (torch.export: ")
    assert "; TorchScript: " in out.reason and "\n" not in out.reason, out.reason
    assert progs.get("exported", 60.0, 60.0)[0] is out  # shared: the next recipe gets the same reason at no cost


def test_clean_line_and_stderr_helpers():
    text = f"\x1b[33mwarn\x1b[0m {torch.ones(2, requires_grad=True) * 2!r}\n  10%|#   | 1/10 [00:00<?, ?it/s]\nend"
    assert clean_line(text) == "warn tensor(...) end"
    assert last_stderr_line("cause\n\x1b[2K━━━━━━━━━━ 100% 0:00:01\n") == "cause"
    assert clean_line("x" * 500).endswith("...") and len(clean_line("x" * 500)) == 300
    f = Failure.from_dict(Failure("KeyError", "'a'", ["d/f.py:3 in g"]).to_dict())
    assert f.reason == "KeyError: 'a'" and f.notes == "at d/f.py:3 in g"


class _Pair(dict):
    """An output class the child process has never heard of (as an HF ModelOutput is to a child that has
    not imported transformers): registered as a pytree node here only."""


torch.utils._pytree.register_pytree_node(
    _Pair, lambda d: (list(d.values()), list(d.keys())), lambda values, keys: _Pair(zip(keys, values)))


class _PairModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        h = self.lin(x)
        return _Pair(hidden=h, pooled=h.mean(dim=1))


def test_exported_program_with_a_custom_output_class_loads_in_a_fresh_process(tmp_path):
    """The saved program returns flat tensors; the child rebuilds eager's structure by name. Before, the
    program named the output class and a child without it registered could not deserialize it."""
    from torchnitro.autotune.program import prepare_program

    torch.manual_seed(0)
    model, x = _PairModel().eval(), torch.randn(3, 6)
    program = prepare_program("exported", model, (x,), {0: [0]}, tmp_path)
    torch.save({"x": x}, tmp_path / "x.pt")
    code = ("import sys, torch\n"
            "from torchnitro.autotune.recipe import Program\n"
            "from torchnitro.autotune.program import load_program\n"
            "p = Program(sys.argv[1], __import__('pathlib').Path(sys.argv[2]), __import__('json').loads(sys.argv[3]))\n"
            "out = load_program(p)(torch.load(sys.argv[4])['x'])\n"
            "torch.save({k: out[k] for k in ('hidden', 'pooled')}, sys.argv[5])\n")
    import json

    proc = subprocess.run([sys.executable, "-c", code, program.kind, str(program.path), json.dumps(program.meta),
                           str(tmp_path / "x.pt"), str(tmp_path / "out.pt")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(got["hidden"], want["hidden"])
    torch.testing.assert_close(got["pooled"], want["pooled"])
