"""``st.encode`` through ``OptimizedModel.install`` against the original, on the real all-MiniLM-L6-v2 (CPU).

The ``SentenceTransformer`` is optimized as it is (its feature dict of ``--example`` sentences), the
result installed on the same object, and ``st.encode`` of ``--sentences`` held-out sentences of mixed
length (``--min-words``..``--max-words``; sentence-transformers sorts, batches, truncates at 256 tokens
and pools) is timed with the variant installed and without it, interleaved, ``--rounds`` times, in CPU
time of this process (``time.process_time``) at ``--threads`` threads; wall time beside it. The table
gives the median CPU-time speedup and its range per batch size, the worst per-sentence cosine against the
original's embeddings, and how many batches ran the variant and how many fell back. Writes
results/install_encode.{json,md,png}.

    python benchmarks/install_encode.py --threads 1 --rounds 3 --budget 240
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from torchnitro.bench import ResultTable, results_dir
from torchnitro.bench.report import save_plot


def _timed(fn) -> tuple[float, float, object]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--min-words", type=int, default=2)
    ap.add_argument("--max-words", type=int, default=80)
    ap.add_argument("--batch-sizes", default="32,8", help="encode batch sizes, comma-separated")
    ap.add_argument("--example", type=int, default=32, help="sentences in the example optimize sees")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=240.0, help="optimize's budget_s")
    ap.add_argument("--recipes", default="", help="comma-separated recipe names (default: every default recipe)")
    ap.add_argument("--min-speedup", type=float, default=None,
                    help="optimize's min_speedup (0: take the fastest listed recipe even where a loaded machine's "
                         "noise keeps eager; the table then says which recipe ran)")
    ap.add_argument("--out", default="install_encode")
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    import torchnitro
    from torchnitro.hf import minilm_path, sample_sentences

    torch.set_num_threads(args.threads)
    st = SentenceTransformer(str(minilm_path()), device="cpu").eval()
    example = st.preprocess(sample_sentences(args.example, 0, min_words=args.min_words, max_words=args.max_words))
    cfg = torchnitro.OptimizeConfig(budget_s=args.budget, threads=args.threads, cache=False,
                                    recipes=[r for r in args.recipes.split(",") if r] or None,
                                    **({} if args.min_speedup is None else {"min_speedup": args.min_speedup}))
    t0 = time.perf_counter()
    om = torchnitro.optimize(st, example, cfg)
    search_s = time.perf_counter() - t0
    print(om.report, flush=True)
    sents = sample_sentences(args.sentences, 77, min_words=args.min_words, max_words=args.max_words)
    load = [os.getloadavg()[0]]
    table = ResultTable(f"st.encode of {args.sentences} sentences ({args.min_words}-{args.max_words} words), "
                        f"all-MiniLM-L6-v2, {args.threads} thread(s): installed '{om.recipe}' vs the original",
                        ("batch size", "original cpu s", "installed cpu s", "speedup median", "speedup min",
                         "speedup max", "original wall s", "installed wall s", "min cosine", "batches optimized",
                         "batches original"))
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        cpu = {"original": [], "installed": []}
        wall = {"original": [], "installed": []}
        for r in range(args.rounds):  # interleaved: drift on the machine hits both
            c, w, ref = _timed(lambda: st.encode(sents, batch_size=bs, convert_to_tensor=True))
            cpu["original"].append(c)
            wall["original"].append(w)
            with om.install(st) as inst:
                c, w, got = _timed(lambda: st.encode(sents, batch_size=bs, convert_to_tensor=True))
            cpu["installed"].append(c)
            wall["installed"].append(w)
            print(f"batch {bs} round {r}: original {cpu['original'][-1]:.2f} s, installed {c:.2f} s CPU", flush=True)
        ratios = sorted(o / i for o, i in zip(cpu["original"], cpu["installed"]))
        cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=1)
        table.add(**{"batch size": bs, "original cpu s": round(statistics.median(cpu["original"]), 3),
                     "installed cpu s": round(statistics.median(cpu["installed"]), 3),
                     "speedup median": round(statistics.median(ratios), 3), "speedup min": round(ratios[0], 3),
                     "speedup max": round(ratios[-1], 3),
                     "original wall s": round(statistics.median(wall["original"]), 3),
                     "installed wall s": round(statistics.median(wall["installed"]), 3),
                     "min cosine": round(float(cos.min()), 6), "batches optimized": inst.calls["optimized"],
                     "batches original": inst.calls["original"]})
        load.append(os.getloadavg()[0])
    table.meta.update({"recipe": om.recipe, "search_s": round(search_s, 1), "optimize config": {
        "budget_s": args.budget, "threads": args.threads, "recipes": cfg.recipes, "min_speedup": cfg.min_speedup,
        "example": f"{args.example} sentences"},
        "load average (1 min) during the run": [round(x, 2) for x in load],
        "command": "python benchmarks/install_encode.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in ("", None))})
    table.save(args.out)
    _plot(table, args.out)
    print(table.to_markdown())
    print(f"wrote {results_dir() / args.out}.{{json,md,png}}")


def _plot(table: ResultTable, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"batch {r['batch size']}" for r in table.rows]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [r["original cpu s"] for r in table.rows], width=0.4, label="original")
    ax.bar([i + 0.2 for i in x], [r["installed cpu s"] for r in table.rows], width=0.4,
           label=f"installed ({table.meta.get('recipe')})")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("CPU seconds (median)")
    ax.set_title("st.encode, all-MiniLM-L6-v2")
    ax.legend()
    save_plot(fig, name)


if __name__ == "__main__":
    main()
