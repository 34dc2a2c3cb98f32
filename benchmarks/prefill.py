"""Prefill time under pruning vs the ideal FLOP saving (issue 4).

    python -m benchmarks.prefill                    # every registered selector at 64 and 128 tokens
    python -m benchmarks.prefill --selectors fastv cls_attn --budgets 64 --repeats 5
    python -m benchmarks.prefill --text-hidden 2048 --text-layers 16 --text-heads 16 --json-only

(``-m`` from the repository root: run as a script, ``benchmarks/selectors.py`` would
shadow the standard library module of that name.)

Builds a random LLaVA-shaped model offline (CLIP 336 px / 14 px patches = 576 visual
tokens, Llama decoder) plus a CLIP text tower for CDPruner, prepares one prompt of
about 40 text tokens, and times ``answer()`` (vision tower, selection, pruned
language-model prefill) for the dense model and for each selector, a dense run before
every pruned run. ``measured`` is the minimum pruned time over the minimum of all dense
runs: on a shared machine the minima are the runs least slowed by other jobs (with one
thread the clock is the thread's CPU time, which excludes waiting for a core). The
median of pruned / dense over adjacent pairs is printed as a second estimate.

``ideal`` is the FLOP ratio pruned / dense from the realised tokens per decoder
layer: vision tower (unchanged) + every decoder layer's projections, MLP and
attention at its token count + the LM head on the last position. Selection work
(probes, similarity, DPP) is not in ``ideal``, so ``measured / ideal`` shows the
overhead of the selector and of the pruning loop. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.build import build_clip, build_llava
from prune_audit.pruners import get_selector, list_selectors

WORDS = "is there a an the cat dog car person in on of image picture this that red blue small large left right".split()
QUESTION = (
    "is there a small red cat on the left of the large blue car in this image , "
    "or is there a dog on the right of that person in the picture ?"
)

SIZES = {
    "vision_hidden_size": 192, "vision_intermediate_size": 768, "vision_layers": 4, "vision_heads": 4,
    "text_hidden_size": 256, "text_intermediate_size": 704, "text_layers": 32, "text_heads": 4,
}
MLP_RATIO = 11008 / 4096  # LLaVA-1.5-7B's intermediate / hidden


def text_sizes(hidden: int, layers: int, heads: int) -> dict[str, int]:
    """SIZES with the decoder at ``hidden`` x ``layers`` x ``heads`` (MLP width after LLaVA-1.5)."""
    return {**SIZES, "text_hidden_size": hidden, "text_intermediate_size": round(hidden * MLP_RATIO),
            "text_layers": layers, "text_heads": heads}


def decoder_layer_flops(tokens: int, hidden: int, intermediate: int) -> float:
    """Multiply-adds x 2 of one Llama layer over ``tokens`` causal tokens (no GQA)."""
    projections = 4 * hidden * hidden + 3 * hidden * intermediate
    attention = hidden * tokens  # QK^T and AV, causal: about half of 2 * tokens^2 * hidden
    return 2 * tokens * (projections + attention)


def vision_flops(tokens: int, hidden: int, intermediate: int, layers: int) -> float:
    return layers * 2 * tokens * (4 * hidden * hidden + 2 * hidden * intermediate + 2 * hidden * tokens)


def ideal_flops(answer, text_tokens: int, num_visual: int, vocabulary: int, sizes: dict[str, int]) -> float:
    # the CLIP layers up to the feature layer (-2): the last one is not run
    vision = vision_flops(num_visual + 1, sizes["vision_hidden_size"], sizes["vision_intermediate_size"],
                          sizes["vision_layers"] - 1)
    hidden = sizes["text_hidden_size"]
    language = sum(
        decoder_layer_flops(text_tokens + visual, hidden, sizes["text_intermediate_size"])
        for visual in answer.tokens_per_layer
    )
    return vision + language + 2 * hidden * vocabulary


def clock() -> float:
    """CPU time of this thread when torch computes in it (1 thread), else wall time.

    On a shared machine, thread CPU time does not count the time spent waiting for a
    core, so single-threaded ratios stay stable under load.
    """
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def run_once(vlm, prepared, selector, budget):
    start = clock()
    [answer] = vlm.answer([prepared], selector, budget, generator=torch.Generator().manual_seed(0))
    return (clock() - start) * 1000, answer


def paired_runs(vlm, prepared, selector, budget, repeats: int, dense_times: list[float]):
    """(pruned run times, median pruned / dense over adjacent pairs, answer); dense times join ``dense_times``."""
    run_once(vlm, prepared, selector, budget)  # warm-up
    pruned_times, ratios = [], []
    for _ in range(repeats):
        dense_times.append(run_once(vlm, prepared, None, None)[0])
        ms, answer = run_once(vlm, prepared, selector, budget)
        pruned_times.append(ms)
        ratios.append(ms / dense_times[-1])
    return pruned_times, float(np.median(ratios)), answer


def benchmark_model(sizes: dict[str, int]):
    """The random LLaVA-shaped model (with a CLIP text tower for CDPruner), loaded on CPU."""
    with tempfile.TemporaryDirectory() as folder:
        model = build_llava(Path(folder) / "llava", words=WORDS, image_size=336, patch_size=14, **sizes)
        clip = build_clip(Path(folder) / "clip", words=WORDS, vision_hidden_size=sizes["vision_hidden_size"],
                          image_size=336, context_length=77)
        return load_vlm(model, device="cpu", clip_text=clip)


def measure(vlm, prepared, names, budgets, repeats):
    """(rows, dense_times): per (selector, budget) its stage and paired runs, or the error."""
    dense_times, rows = [], []
    for name in names:
        selector = get_selector(name)
        for budget in budgets:
            try:
                rows.append((name, selector.stage, budget, paired_runs(vlm, prepared, selector, budget, repeats,
                                                                       dense_times)))
            except PruneAuditError as error:
                rows.append((name, selector.stage, budget, str(error)))
    return rows, dense_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selectors", nargs="*", default=None, help="default: every registered selector")
    parser.add_argument("--budgets", nargs="*", type=int, default=[64, 128])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="1 (default) times thread CPU time")
    parser.add_argument("--text-hidden", type=int, default=SIZES["text_hidden_size"], help="decoder width")
    parser.add_argument("--text-layers", type=int, default=SIZES["text_layers"], help="decoder layers")
    parser.add_argument("--text-heads", type=int, default=SIZES["text_heads"], help="decoder attention heads")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if min(args.text_hidden, args.text_layers, args.text_heads) < 1 or args.text_hidden % args.text_heads:
        parser.error("--text-hidden, --text-layers and --text-heads must be positive, the width divisible by the heads")
    sizes = text_sizes(args.text_hidden, args.text_layers, args.text_heads)
    torch.set_num_threads(args.threads)
    vlm = benchmark_model(sizes)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    prepared = vlm.prepare(image, QUESTION)
    num_visual, vocabulary = prepared.num_visual, len(vlm.tokenizer)
    text_tokens = prepared.input_ids.numel() - num_visual
    dense_flops = ideal_flops(run_once(vlm, prepared, None, None)[1], text_tokens, num_visual, vocabulary, sizes)
    measured, dense_times = measure(vlm, prepared, args.selectors or list_selectors(), args.budgets, args.repeats)
    dense_ms = min(dense_times)
    say = (lambda *_: None) if args.json_only else print
    kind = "thread CPU time" if args.threads == 1 else "wall time"
    say(f"{num_visual} visual + {text_tokens} text tokens, {vlm.num_layers} decoder layers, "
        f"{args.threads} thread(s), {kind}. Dense: {dense_ms:.1f} ms, minimum of all {len(dense_times)} dense "
        f"runs; pruned: minimum of {args.repeats} runs, each right after a dense run. measured = pruned min / "
        f"dense min; pair median = median of pruned / dense over adjacent runs")
    say("| selector | stage | budget | realised avg | pruned ms | measured | pair median | ideal | "
        "measured / ideal |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for name, stage, budget, result in measured:
        if isinstance(result, str):
            say(f"| {name} | {stage} | {budget} | not run: {result} | | | | | |")
            continue
        times, pair_median, answer = result
        ms = min(times)
        ratio, ideal = ms / dense_ms, ideal_flops(answer, text_tokens, num_visual, vocabulary, sizes) / dense_flops
        rows.append({"selector": name, "stage": stage, "budget": budget, "realised_avg": answer.visual_tokens_avg,
                     "ms": ms, "measured": ratio, "pair_median": pair_median, "ideal": ideal})
        say(f"| {name} | {stage} | {budget} | {answer.visual_tokens_avg:.1f} | {ms:.1f} | {ratio:.3f} | "
            f"{pair_median:.3f} | {ideal:.3f} | {ratio / ideal:.2f} |")
    print(json.dumps({"dense_ms": dense_ms, "sizes": sizes, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
