"""Every Triton kernel compiles for a real GPU target (sm_90), on a machine without one.

The interpreter runs kernels as numpy and accepts code that the compiler rejects (loop-carried type
changes, runtime branches on constexprs, bad dot shapes). Compiling ahead of time down to a cubin
with Triton's bundled ptxas catches those without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib  # noqa: E402

from torchnitro.kernels._triton import jit  # noqa: E402  (injects `tl` into the kernel's module)


def _mod(name: str):
    # the package re-exports functions named like their modules (kernels.gelu is the function)
    return importlib.import_module(f"torchnitro.kernels.{name}")


cross_entropy, flash_attention, fp8, gelu, layer_norm, linear_gelu, rms_norm, rope, softmax, swiglu, _partials = map(
    _mod, ["cross_entropy", "flash_attention", "fp8", "gelu", "layer_norm", "linear_gelu", "rms_norm", "rope",
           "softmax", "swiglu", "_partials"])

P16, P32, I32, F32, C = "*fp16", "*fp32", "i32", "fp32", "constexpr"

FA_FWD = dict(q_ptr=P16, k_ptr=P16, v_ptr=P16, o_ptr=P16, lse_ptr=P32, sm_scale=F32, H=I32, G=I32, Tq=I32, Tk=I32,
              D=I32, WINDOW=I32, sqb=I32, sqh=I32, sqt=I32, skb=I32, skh=I32, skt=I32, svb=I32, svh=I32, svt=I32,
              sob=I32, soh=I32, sot=I32)
FA_BWD = dict(q_ptr=P16, k_ptr=P16, v_ptr=P16, do_ptr=P16, lse_ptr=P32, delta_ptr=P32)
FA_TAIL = dict(sm_scale=F32, H=I32, G=I32, Tq=I32, Tk=I32, D=I32, WINDOW=I32, sqb=I32, sqh=I32, sqt=I32, skb=I32,
               skh=I32, skt=I32, svb=I32, svh=I32, svt=I32)
FA_CONST = dict(CAUSAL=True, HAS_WINDOW=True, PREC="tf32", BLOCK_M=64, BLOCK_N=64, BLOCK_D=128)

CASES = {
    "gelu_fwd": (gelu._gelu_fwd_kernel, dict(x_ptr=P16, y_ptr=P16, n=I32), dict(APPROX=True, BLOCK=1024)),
    "gelu_bwd": (gelu._gelu_bwd_kernel, dict(dy_ptr=P16, x_ptr=P16, dx_ptr=P16, n=I32), dict(APPROX=False, BLOCK=1024)),
    "glu_fwd": (swiglu._glu_fwd_kernel, dict(g_ptr=P16, u_ptr=P16, y_ptr=P16, n=I32), dict(ACT=0, BLOCK=1024)),
    "glu_bwd": (swiglu._glu_bwd_kernel, dict(dy_ptr=P16, g_ptr=P16, u_ptr=P16, dg_ptr=P16, du_ptr=P16, n=I32),
                dict(ACT=2, BLOCK=1024)),
    "rms_fwd": (rms_norm._rms_fwd_kernel, dict(x_ptr=P16, r_ptr=P16, h_ptr=P16, w_ptr=P16, y_ptr=P16, rstd_ptr=P32,
                                               N=I32, C=I32, eps=F32), dict(HAS_RES=True, HAS_W=True, BLOCK=4096, ROWS=2)),
    "rms_bwd": (rms_norm._rms_bwd_kernel, dict(dy_ptr=P16, dh_ptr=P16, h_ptr=P16, w_ptr=P16, rstd_ptr=P32,
                                               dx_ptr=P16, dw_ptr=P32, n_rows=I32, C=I32),
                dict(HAS_DH=True, HAS_W=True, BLOCK=4096, ROWS=2)),
    "ln_fwd": (layer_norm._ln_fwd_kernel, dict(x_ptr=P16, w_ptr=P16, b_ptr=P16, y_ptr=P16, mean_ptr=P32,
                                               rstd_ptr=P32, N=I32, C=I32, eps=F32),
               dict(HAS_W=True, HAS_B=True, BLOCK=4096, ROWS=4)),
    "ln_bwd": (layer_norm._ln_bwd_kernel, dict(dy_ptr=P16, x_ptr=P16, w_ptr=P16, mean_ptr=P32, rstd_ptr=P32,
                                               dx_ptr=P16, dw_ptr=P32, db_ptr=P32, n_rows=I32, C=I32),
               dict(HAS_W=True, BLOCK=4096, ROWS=2)),
    "ln_bwd_prefetch": (layer_norm._ln_bwd_prefetch_kernel, dict(dy_ptr="*bf16", x_ptr="*bf16", w_ptr="*bf16",
                                                                 mean_ptr=P32, rstd_ptr=P32, dx_ptr="*bf16",
                                                                 dw_ptr=P32, db_ptr=P32, n_rows=I32, C=I32),
                        dict(HAS_W=True, BLOCK=4096)),
    "rms_bwd_prefetch": (rms_norm._rms_bwd_prefetch_kernel, dict(dy_ptr="*bf16", dh_ptr="*bf16", h_ptr="*bf16",
                                                                 w_ptr="*bf16", rstd_ptr=P32, dx_ptr="*bf16",
                                                                 dw_ptr=P32, n_rows=I32, C=I32),
                         dict(HAS_DH=True, HAS_W=True, BLOCK=4096)),
    "col_sum": (_partials._col_sum_kernel, dict(a_ptr=P32, b_ptr=P32, oa_ptr="*bf16", ob_ptr=P16, P=I32, C=I32),
                dict(HAS_B=True, BLOCK_P=32, BLOCK_C=64)),
    "softmax_fwd": (softmax._softmax_fwd_kernel, dict(x_ptr=P16, y_ptr=P16, C=I32), dict(BLOCK=8192)),
    "softmax_bwd": (softmax._softmax_bwd_kernel, dict(dy_ptr=P16, y_ptr=P16, dx_ptr=P16, C=I32), dict(BLOCK=8192)),
    "rope": (rope._rope_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", qo_ptr="*bf16", ko_ptr="*bf16", cos_ptr=P32,
                                     sin_ptr=P32, T=I32, HQ=I32, HK=I32, NQG=I32, sqb=I32, sqh=I32, sqt=I32,
                                     skb=I32, skh=I32, skt=I32, scb=I32, sct=I32, HALF=I32),
             dict(SIGN=-1, HEADS=4, BLOCK_T=16, BLOCK=64)),
    "ce_fwd": (cross_entropy._ce_fwd_kernel, dict(z_ptr=P16, stride=I32, t_ptr="*i64", loss_ptr=P32, lse_ptr=P32,
                                                  V=I32, ignore_index=I32, eps=F32), dict(BLOCK=4096)),
    "ce_bwd": (cross_entropy._ce_bwd_kernel, dict(z_ptr=P16, stride=I32, dz_ptr=P16, dz_stride=I32, t_ptr="*i64",
                                                  lse_ptr=P32, dloss_ptr=P32, dloss_stride=I32, V=I32,
                                                  ignore_index=I32, eps=F32), dict(BLOCK=4096)),
    "fa_fwd": (flash_attention._fa_fwd_kernel, FA_FWD, FA_CONST),
    "fa_fwd_fp32": (flash_attention._fa_fwd_kernel, {k: ("*fp32" if v == P16 else v) for k, v in FA_FWD.items()},
                    {**FA_CONST, "PREC": "ieee", "CAUSAL": False, "HAS_WINDOW": False, "BLOCK_D": 64}),
    "fa_fwd_bf16": (flash_attention._fa_fwd_kernel, {k: ("*bf16" if v == P16 else v) for k, v in FA_FWD.items()},
                    {**FA_CONST, "HAS_WINDOW": False, "BLOCK_M": 128}),
    "fa_bwd_pre": (flash_attention._fa_bwd_pre_kernel, dict(o_ptr=P16, do_ptr=P16, delta_ptr=P32, Tq=I32, D=I32),
                   dict(BLOCK_M=64, BLOCK_D=128)),
    "fa_bwd_dkdv": (flash_attention._fa_bwd_dkdv_kernel, {**FA_BWD, "dk_ptr": P16, "dv_ptr": P16, **FA_TAIL},
                    {**FA_CONST, "BLOCK_M": 32}),
    "fa_bwd_dq": (flash_attention._fa_bwd_dq_kernel, {**FA_BWD, "dq_ptr": P16, **FA_TAIL}, {**FA_CONST, "BLOCK_N": 32}),
    "linear_gelu": (linear_gelu._linear_gelu_kernel, dict(x_ptr=P16, w_ptr=P16, b_ptr=P16, y_ptr=P16, z_ptr=P16, M=I32,
                                                          N=I32, K=I32, sxm=I32, sxk=I32, swn=I32, swk=I32, sym=I32),
                    dict(HAS_BIAS=True, APPROX=False, STORE_Z=True, PREC="tf32", BLOCK_M=128, BLOCK_N=128,
                         BLOCK_K=64, GROUP_M=8)),
    "fp8_amax": (fp8._amax_kernel, dict(x_ptr=P16, amax_ptr=P32, n=I32), dict(BLOCK=1024)),
    "fp8_cast": (fp8._scale_cast_kernel, dict(x_ptr=P16, amax_ptr=P32, q_ptr="*fp8e4nv", s_ptr=P32, n=I32),
                 dict(FMAX=448.0, BLOCK=1024)),
    "fp8_recipe_cast": (fp8._recipe_cast_kernel, dict(x_ptr=P16, amax_ptr=P32, prev_ptr=P32, q_ptr="*fp8e5",
                                                      s_ptr=P32, inv_ptr=P32, n=I32),
                        dict(FMAX=57344.0, MARGIN_DIV=1.0, BLOCK=1024)),
    "fp8_row": (fp8._row_quant_kernel, dict(x_ptr=P16, q_ptr="*fp8e5", s_ptr=P32, C=I32), dict(FMAX=57344.0, BLOCK=1024)),
    "fp8_dequant": (fp8._dequant_kernel, dict(q_ptr="*fp8e4nv", s_ptr=P32, y_ptr=P16, n=I32, C=I32),
                    dict(PER_ROW=True, BLOCK=1024)),
}


def _compile_all(claims: str) -> dict[str, str | None]:
    """Compile every case no other process has claimed (an empty file per case in ``claims``, created exclusively):
    the processes share the cases as they go, however long each takes; name -> None on success, else the error (run
    in a fresh process)."""
    out: dict[str, str | None] = {}
    for name, (fn, sig, consts) in sorted(CASES.items()):
        try:
            os.close(os.open(os.path.join(claims, name), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue  # another process compiles it
        try:
            src = ASTSource(jit(fn), signature={**sig, **{k: C for k in consts}}, constexprs=consts)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            out[name] = None if k.asm.get("cubin") else "no cubin produced"
        except Exception as e:  # noqa: BLE001 - reported per kernel
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    # Fresh interpreters: Triton's interpreter patches triton.language while it runs, so compiling in
    # a process that already interpreted kernels is not a faithful check. Compiling is single-threaded:
    # one process per core, each with its own cache, all running at once, each taking the next case no other has
    # (a fixed split of the sorted cases left one process with about twice the work of the other).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1")
    parts = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    claims = tmp_path_factory.mktemp("claims")
    procs = [subprocess.Popen([sys.executable, __file__, str(claims)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp(f"triton-cache-{i}"))})
             for i in range(parts)]
    result: dict[str, str | None] = {}
    try:
        for i, proc in enumerate(procs):
            try:
                stdout, stderr = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                pytest.fail(f"compile subprocess {i} of {parts} ran past 300 s")
            if proc.returncode != 0:
                pytest.fail(f"compile subprocess {i} of {parts} failed:\n{stderr[-3000:]}")
            result.update(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:  # those still running after a failure above
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert sorted(result) == sorted(CASES)  # every case compiled, each in one of the subprocesses
    if all(err and "ptxas" in err and shutil.which("ptxas") is None and "not found" in err
           for err in result.values()):
        pytest.skip("Triton's bundled ptxas is unavailable here")
    return result


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_compiles_for_sm90(compiled, name):
    assert compiled[name] is None, compiled[name]


if __name__ == "__main__":
    print(json.dumps(_compile_all(sys.argv[1])))
