from __future__ import annotations

import importlib.metadata
import subprocess

import pytest

from torchnitro.bench.provenance import git_commit, package_versions, provenance


def test_header_names_command_machine_and_versions():
    import torch

    p = provenance("benchmarks/kernels.py", ["--quick", "--name", "a b"])
    assert p["command"] == "python benchmarks/kernels.py --quick --name 'a b'"  # quoted: it can be pasted back
    assert "cores" in p["machine"]
    assert f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})" in p["versions"]
    assert p["torch threads"] == str(torch.get_num_threads())
    assert p["commit"] and p["started"]


def test_versions_come_from_metadata_and_missing_packages_are_named():
    s = package_versions(["numpy", "surely-not-a-real-package-xyz"])
    assert s.startswith("python ")
    assert f"numpy {importlib.metadata.version('numpy')}" in s
    assert "surely-not-a-real-package-xyz not installed" in s


def test_git_commit_outside_a_checkout(tmp_path):
    assert git_commit(tmp_path).startswith("unknown")


def test_git_commit_marks_modified_files(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    try:
        git("init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not installed")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    clean = git_commit(tmp_path)
    assert len(clean) >= 7 and not clean.endswith("+dirty")
    (tmp_path / "f").write_text("2")
    assert git_commit(tmp_path) == clean + "+dirty"
