"""Our padding-free encoder paths against OpenVINO on all-MiniLM-L6-v2 as a user wraps it (CPU).

Every variant is built in this process by its recipe class from the same user-wrapped model
(``AutoModel`` in a script-defined class, ``forward(ids, mask) -> last_hidden_state``) and timed
interleaved with eager (``bench.compare``), ``--rounds`` times; the table gives the median ratio and
its range, and the worst token-row and mean-pooled cosine against eager on held-out text at real
positions. ``--text long``: every position real (150-200-word sentences), where padding-free gives
nothing; ``--text short``: 3-20-word sentences. Writes results/encoder_paths_cpu_<text>.{json,md}.

    python benchmarks/encoder_paths_cpu.py --text long --threads 1 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch
from torch import nn

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.bench import ResultTable, TimingConfig, compare, results_dir
from torchnitro.bench.timing import speedups
from torchnitro.hardware import hardware_info

VARIANTS = ("bert-unpad", "bert-unpad-bf16", "bert-unpad-int8", "openvino", "openvino-bf16", "openvino-int8")


class UserWrapper(nn.Module):
    """What a user writes around ``AutoModel``."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, attention_mask=mask).last_hidden_state


def _cosines(ref: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    real = mask.bool()
    rows = torch.nn.functional.cosine_similarity(ref[real].double(), out[real].double(), dim=1)
    m = mask.unsqueeze(-1).double()
    pooled = torch.nn.functional.cosine_similarity((ref * m).sum(1), (out * m).sum(1), dim=1)
    return float(rows.min()), float(pooled.min())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", choices=("short", "long"), default="long")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch and OpenVINO threads")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    from torchnitro.hf import _auto_model, minilm_path, sample_sentences, tokenize

    torch.set_num_threads(args.threads)
    words = {"short": (3, 20), "long": (150, 200)}[args.text]
    text = lambda seed: tokenize(sample_sentences(args.batch, seed, min_words=words[0], max_words=words[1]),  # noqa: E731
                                 "minilm", 128)
    model = UserWrapper(_auto_model(minilm_path())).eval()
    x, held = text(0), text(501)
    fns, notes = {"eager": model}, {"eager": ""}
    for name in args.variants.split(","):
        ctx = BuildContext(model=copy.deepcopy(model), example_inputs=x, hardware=hardware_info(),
                           device=torch.device("cpu"), workdir=Path(tempfile.mkdtemp()),
                           dynamic_dims={0: [0, 1], 1: [0, 1]}, config=OptimizeConfig(threads=args.threads, cache=False))
        recipe = get_recipe(name)
        why = recipe.unavailable_reason(ctx.hardware)
        if why is not None:
            print(f"{name}: skipped ({why})")
            continue
        built = recipe.build(ctx)
        fns[name], notes[name] = built.fn, built.notes
    table = ResultTable(f"all-MiniLM-L6-v2 in a user wrapper, {args.text} text, {args.batch}x128, "
                        f"{args.threads} thread(s): interleaved with eager",
                        ("variant", "speedup median", "speedup min", "speedup max", "token-row cos", "pooled cos",
                         "notes"))
    runs = []
    with torch.inference_mode():
        ref = model(*held)
        cos = {n: _cosines(ref, f(*held).float(), held[1]) for n, f in fns.items()}
        for r in range(args.rounds):
            t = compare({n: (lambda f=f: f(*x)) for n, f in fns.items()}, TimingConfig(min_iters=10, min_time_s=1.0),
                        baseline="eager")
            runs.append(speedups(t, "eager"))
            print(f"round {r}: " + ", ".join(f"{n} {runs[-1][n]:.2f}x" for n in fns), flush=True)
    for n in fns:
        v = sorted(s[n] for s in runs)
        table.add(variant=n, **{"speedup median": round(v[len(v) // 2], 3), "speedup min": round(v[0], 3),
                                "speedup max": round(v[-1], 3), "token-row cos": round(cos[n][0], 5),
                                "pooled cos": round(cos[n][1], 5), "notes": notes[n]})
    d = results_dir()
    stem = f"encoder_paths_cpu_{args.text}"
    (d / f"{stem}.md").write_text(table.to_markdown())
    (d / f"{stem}.json").write_text(json.dumps(table.to_json(), indent=2, default=str))
    print(table.to_markdown())


if __name__ == "__main__":
    main()
