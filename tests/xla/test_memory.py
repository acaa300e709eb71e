"""Memory planning by compiling the step: host devices always, a TPU topology when libtpu is installed."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

from torchnitro.errors import BudgetError, ConfigError  # noqa: E402
from torchnitro.xla.memory import GIB, CompiledMemory, find_batch_size, find_lm_batch_size, plan_memory  # noqa: E402
import optax  # noqa: E402

from torchnitro.xla.estimate import MemoryEstimate, layer_residual_bytes, tpu_array_bytes  # noqa: E402
from torchnitro.xla.model import LMConfig, param_spec  # noqa: E402

CFG = LMConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=128)
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed: AOT TPU compiles need it (torchnitro[xla])")


@pytest.mark.parametrize("mesh,rules", [("1x8x1", "fsdp"), ("2x2x2", "fsdp_tp")])
def test_host_compile_arguments_equal_the_analytic_shards(mesh, rules):
    plan = plan_memory(CFG, 8, 64, mesh=mesh, rules=rules, remat="dots_saveable")
    # parameters + AdamW moments + batch, each as its per-device shard: exact on host devices
    assert plan.compiled.argument == plan.estimate.argument
    # the step donates parameters and optimizer state: every output but the loss reuses an input
    assert plan.compiled.alias == plan.estimate.params + plan.estimate.opt_state
    assert plan.compiled.temp > 0 and plan.hbm is None and plan.fits is None
    assert plan.flops and plan.flops > 0


def test_plan_rejects_batches_that_do_not_split():
    with pytest.raises(ConfigError, match="batch_size=6 does not divide over the 8 data-parallel devices"):
        plan_memory(CFG, 6, 64, mesh="1x8x1")


@pytest.fixture(scope="module")
def v5p_plans():
    """The LM's train step AOT-compiled for v5p under each remat policy (read, never changed, by two tests)."""
    return {r: plan_memory(CFG, 32, 128, mesh="1x8x1", rules="fsdp", remat=r, target="v5p:2x2x2")
            for r in ("none", "dots_saveable", "nothing_saveable")}


@needs_libtpu
@pytest.mark.slow  # three AOT TPU compiles: ~10 s of CPU
def test_tpu_compile_orders_remat_policies_and_reports_hbm(v5p_plans):
    temps = v5p_plans
    t = {r: p.compiled.temp for r, p in temps.items()}
    assert t["none"] > t["dots_saveable"] > t["nothing_saveable"], t
    plan = temps["none"]
    assert plan.hbm == 95 * GIB  # v5p: one device per chip (megacore), 95 GiB each
    assert plan.fits is True
    # TPU layouts tile the two minor dims (8, 128): the estimate counts the tiles, not the logical bytes
    assert plan.compiled.argument == pytest.approx(plan.estimate.argument, rel=0.01)
    logical = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        (param_spec(CFG), jax.eval_shape(optax.adamw(1e-3).init, param_spec(CFG))))) // 8
    assert plan.compiled.argument > 1.2 * logical


def test_tpu_temp_falls_back_to_the_buffer_assignment_only_when_memory_analysis_says_zero():
    from torchnitro.xla.memory import _tpu_temp

    assert _tpu_temp(5000, 3000, "v5p:2x2x2") == 5000  # v5p reports more than the HBM allocation: kept
    assert _tpu_temp(0, None, "v5e:2x2") == 0  # no dump: nothing better to report
    with pytest.warns(UserWarning, match="reports temp 0 but XLA's buffer assignment has"):
        assert _tpu_temp(0, 3 * 2**20, "v5e:2x2") == 3 * 2**20


@needs_libtpu
@pytest.mark.slow  # one AOT TPU compile of the tiny LM (and v5p's from the fixture): a few seconds
def test_v5e_temp_comes_from_the_buffer_assignment_where_memory_analysis_reports_zero(tmp_path, v5p_plans):
    # libtpu 0.0.42.1 reports memory_analysis temp 0 for this program on v5e (3.2 MiB of HBM temp in its dump)
    with pytest.warns(UserWarning, match="reports temp 0"):
        plan = plan_memory(CFG, 32, 128, mesh="1x4x1", rules="fsdp", target="v5e:2x2", dump_dir=str(tmp_path))
    assert plan.compiled.hbm_temp and plan.compiled.temp == plan.compiled.hbm_temp
    assert plan.compiled.peak > plan.compiled.argument + plan.compiled.output - plan.compiled.alias
    from torchnitro.xla.dump import read_buffer_dump

    assert read_buffer_dump(str(tmp_path)).temp_by_color[0] == plan.compiled.hbm_temp  # the dump was kept
    v5p = v5p_plans["none"]  # plan_memory's default remat
    assert v5p.compiled.temp > v5p.compiled.hbm_temp > 0  # v5p reports more than its HBM allocation


@pytest.mark.parametrize("shape,itemsize,want", [
    ((32, 4, 64), 4, 4 * 32 * 128 * 4),  # XLA tiles (32, 64): the 4-sized dim stays outermost
    ((2048, 32), 4, 2048 * 128 * 4 // 4),  # 2048 is the minor dim: (32 -> 32, 2048) rows of 128
    ((256,), 4, 256 * 4), ((100,), 4, 128 * 4), ((), 4, 4), ((5, 3), 2, 8 * 128 * 2)])
def test_tpu_array_bytes_counts_tiles_of_the_cheapest_minor_pair(shape, itemsize, want):
    assert tpu_array_bytes(shape, itemsize) == want


def test_saved_residuals_follow_the_remat_policy_and_flash_drops_the_scores():
    host = {p: layer_residual_bytes(CFG, p, 2, 128, tpu=False) for p in ("none", "dots_saveable", "nothing_saveable")}
    assert host["none"] > host["dots_saveable"] > host["nothing_saveable"] == 2 * 128 * 128 * 4  # the block input
    # plain attention keeps (B, H, T, T) probabilities; the flash kernel keeps q, k, v, o and a float per row
    flash = layer_residual_bytes(dataclasses.replace(CFG, attention="flash"), "dots_saveable", 2, 128, tpu=False)
    scores = 2 * CFG.n_heads * 128 * 128 * 4
    assert flash < host["dots_saveable"] - scores // 2
    # on a TPU, "none" counts as dots_saveable: XLA's fusion recomputes the elementwise residuals
    assert layer_residual_bytes(CFG, "none", 2, 128, tpu=True) == host["dots_saveable"]


def test_estimate_peak_is_arguments_plus_the_walks_temp():
    e = MemoryEstimate(params=1, opt_state=2, batch=3, temp=15, at_peak={"dots": 15})
    assert e.argument == 6 and e.peak == 21


def _fake_peak(calls):
    def peak(b):
        calls.append(b)
        return 1000 + 100 * b  # bytes; budget 5000 -> batch 40

    return peak


@pytest.mark.parametrize("multiple,want", [(1, 40), (8, 40), (16, 32)])
def test_find_batch_size_searches_the_largest_fitting_multiple(multiple, want):
    calls: list[int] = []
    assert find_batch_size(_fake_peak(calls), 5000, multiple=multiple) == want
    assert all(b % multiple == 0 for b in calls)
    assert len(calls) <= 12  # doubling then bisection, not a scan


def test_find_batch_size_errors_when_nothing_fits():
    with pytest.raises(BudgetError, match="even batch 8 needs"):
        find_batch_size(_fake_peak([]), 1500, multiple=8)
    with pytest.raises(ConfigError, match="budget=0"):
        find_batch_size(_fake_peak([]), 0)


@needs_libtpu
def test_lm_batch_search_uses_the_targets_hbm_and_the_data_parallel_multiple():
    probes: list[int] = []

    def fake_plan(cfg, b, seq, **kw):  # 1 GiB per sequence: on v5e (16 GiB/chip) 0.9 * 16 GiB fits 14 sequences
        probes.append(b)
        return type("P", (), {"compiled": CompiledMemory(argument=0, output=0, alias=0, temp=b * GIB, code=0)})()

    # v5e:2x2 is 4 chips, one device each; mesh 1x4x1 splits the batch 4 ways, so batches are multiples of 4
    assert find_lm_batch_size(CFG, 64, "v5e:2x2", mesh="1x4x1", plan=fake_plan) == 12
    assert probes and all(b % 4 == 0 for b in probes)
    with pytest.raises(ConfigError, match="needs a TPU target"):
        find_lm_batch_size(CFG, 64, "host")
