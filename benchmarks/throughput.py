"""Questions per second by batch size, dense vs pruned, next to the FLOP ratio (issue 18, item 2).

    python -m benchmarks.throughput                              # random at 64/128/192, batch 1/8/32
    python -m benchmarks.throughput --selectors random fastv --batches 1 8 --repeats 3 --text-hidden 512

Same random LLaVA-shaped model and prompt as ``benchmarks.prefill`` (576 visual tokens), one
thread, thread CPU time. A batch is B copies of the question through ``answer()`` (one
forward: ``pack`` left-pads the rows to the longest, so with equal budgets a pruned batch
costs its kept tokens). ``speedup`` = pruned questions/s over dense questions/s at the
same batch; ``flop ratio`` = dense FLOPs / pruned FLOPs (``benchmarks.prefill.ideal_flops``),
the speedup an overhead-free loop would reach. The calibration study measured 5.0x at
64 vs 576 tokens, batch 32, on an H200. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from PIL import Image

from benchmarks.prefill import QUESTION, SIZES, benchmark_model, clock, ideal_flops, text_sizes
from prune_audit.errors import PruneAuditError
from prune_audit.pruners import get_selector, list_selectors


def timed(vlm, prepared, selector, budget, batch: int, repeats: int):
    """(median ms per forward over ``repeats`` after a warm-up, the first row's answer)."""
    questions = [prepared] * batch

    def run():
        start = clock()
        answers = vlm.answer(questions, selector, budget, generator=torch.Generator().manual_seed(0))
        return (clock() - start) * 1000, answers[0]

    run()
    results = [run() for _ in range(repeats)]
    return statistics.median(ms for ms, _ in results), results[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selectors", nargs="*", default=["random"])
    parser.add_argument("--budgets", nargs="*", type=int, default=[64, 128, 192])
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text-hidden", type=int, default=SIZES["text_hidden_size"])
    parser.add_argument("--text-layers", type=int, default=SIZES["text_layers"])
    parser.add_argument("--text-heads", type=int, default=SIZES["text_heads"])
    args = parser.parse_args()
    unknown = sorted(set(args.selectors) - set(list_selectors()))
    if unknown or min(args.budgets + args.batches + [args.repeats]) < 1:
        parser.error(f"unknown selectors {unknown}" if unknown else "budgets, batches and repeats must be >= 1")
    torch.set_num_threads(1)
    sizes = text_sizes(args.text_hidden, args.text_layers, args.text_heads)
    vlm = benchmark_model(sizes)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    prepared = vlm.prepare(image, QUESTION)
    text_tokens, vocabulary = prepared.input_ids.numel() - prepared.num_visual, len(vlm.tokenizer)

    def flops(answer) -> float:
        return ideal_flops(answer, text_tokens, prepared.num_visual, vocabulary, sizes)

    rows = []
    print(f"width {args.text_hidden}, {args.text_layers} layers, 1 thread, thread CPU time, median of {args.repeats}")
    print("| selector | budget | batch | ms / forward | questions/s | speedup | flop ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in args.batches:
        dense_ms, dense_answer = timed(vlm, prepared, None, None, batch, args.repeats)
        print(f"| dense | 576 | {batch} | {dense_ms:.1f} | {batch * 1000 / dense_ms:.2f} | 1.00 | 1.00 |")
        rows.append({"selector": "dense", "budget": None, "batch": batch, "ms": dense_ms})
        for name in args.selectors:
            for budget in args.budgets:
                try:
                    ms, answer = timed(vlm, prepared, get_selector(name), budget, batch, args.repeats)
                except PruneAuditError as error:
                    print(f"| {name} | {budget} | {batch} | not run: {error} | | | |")
                    continue
                speedup, flop_ratio = dense_ms / ms, flops(dense_answer) / flops(answer)
                rows.append(
                    {
                        "selector": name,
                        "budget": budget,
                        "batch": batch,
                        "ms": ms,
                        "speedup": speedup,
                        "flop_ratio": flop_ratio,
                    }
                )
                print(
                    f"| {name} | {budget} | {batch} | {ms:.1f} | {batch * 1000 / ms:.2f} | {speedup:.2f} | "
                    f"{flop_ratio:.2f} |"
                )
    print(json.dumps({"sizes": sizes, "rows": rows}))


if __name__ == "__main__":
    main()
