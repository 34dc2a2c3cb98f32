"""Prefill time under pruning vs the ideal FLOP saving (issue 4).

    python -m benchmarks.prefill                    # every registered selector at 64 and 128 tokens
    python -m benchmarks.prefill --selectors fastv cls_attn --budgets 64 --repeats 5
    python -m benchmarks.prefill --text-hidden 2048 --text-layers 16 --text-heads 16 --json-only
    python -m benchmarks.prefill --text-hidden 2048 --text-layers 16 --text-heads 16 --memory-only

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
overhead of the selector and of the pruning loop.

Peak memory: every (selector, budget) and the dense model run once more, each in a
fresh process that loads the saved model, answers once (warm-up), hands freed heap
memory back and resets the kernel's peak-RSS mark, then answers again. ``peak MiB`` is
that process's resident high-water mark (VmHWM: weights, inputs and the answer's
peak, all torch CPU allocations included; ``tracemalloc`` sees none of them, as torch
allocates outside Python's allocator), ``extra MiB`` the part above the resident
memory before the answer, and ``memory vs dense`` / ``extra vs dense`` their ratios to
the dense run's. ``--memory-only`` skips the timing. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.selectors import read_memory_kib, reset_peak_rss
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.build import build_clip
from prune_audit.models.llava import LlavaModel
from prune_audit.pruners import get_selector, list_selectors

REPOSITORY = Path(__file__).resolve().parents[1]

WORDS = "is there a an the cat dog car person in on of image picture this that red blue small large left right".split()
QUESTION = (
    "is there a small red cat on the left of the large blue car in this image , "
    "or is there a dog on the right of that person in the picture ?"
)

SIZES = {
    "vision_hidden_size": 192,
    "vision_intermediate_size": 768,
    "vision_layers": 4,
    "vision_heads": 4,
    "text_hidden_size": 256,
    "text_intermediate_size": 704,
    "text_layers": 32,
    "text_heads": 4,
}
MLP_RATIO = 11008 / 4096  # LLaVA-1.5-7B's intermediate / hidden


def text_sizes(hidden: int, layers: int, heads: int) -> dict[str, int]:
    """SIZES with the decoder at ``hidden`` x ``layers`` x ``heads`` (MLP width after LLaVA-1.5)."""
    return {
        **SIZES,
        "text_hidden_size": hidden,
        "text_intermediate_size": round(hidden * MLP_RATIO),
        "text_layers": layers,
        "text_heads": heads,
    }


def decoder_layer_flops(tokens: int, hidden: int, intermediate: int) -> float:
    """Multiply-adds x 2 of one Llama layer over ``tokens`` causal tokens (no GQA)."""
    projections = 4 * hidden * hidden + 3 * hidden * intermediate
    attention = hidden * tokens  # QK^T and AV, causal: about half of 2 * tokens^2 * hidden
    return 2 * tokens * (projections + attention)


def vision_flops(tokens: int, hidden: int, intermediate: int, layers: int) -> float:
    return layers * 2 * tokens * (4 * hidden * hidden + 2 * hidden * intermediate + 2 * hidden * tokens)


def ideal_flops(answer, text_tokens: int, num_visual: int, vocabulary: int, sizes: dict[str, int]) -> float:
    # the CLIP layers up to the feature layer (-2): the last one is not run
    vision = vision_flops(
        num_visual + 1, sizes["vision_hidden_size"], sizes["vision_intermediate_size"], sizes["vision_layers"] - 1
    )
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


def build_benchmark_model(folder: Path, sizes: dict[str, int]) -> None:
    """Save the random LLaVA-shaped model (``folder/llava``) and a CLIP text tower for CDPruner (``folder/clip``)."""
    # LLaVA-1.5's 4,096 positions: the 576 visual tokens and the prompt must fit (the run checks it)
    LlavaModel.build_tiny(
        folder / "llava", words=WORDS, image_size=336, patch_size=14, max_position_embeddings=4096, **sizes
    )
    build_clip(
        folder / "clip", words=WORDS, vision_hidden_size=sizes["vision_hidden_size"], image_size=336, context_length=77
    )


def load_benchmark_model(folder: Path):
    return load_vlm(folder / "llava", device="cpu", clip_text=folder / "clip")


def benchmark_prompt(vlm):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    return vlm.prepare(image, QUESTION)


def peak_memory(folder: Path, name: str, budget: int | None) -> dict[str, float]:
    """In this (fresh) process: peak and extra resident MiB of one answer after a warm-up one."""
    vlm = load_benchmark_model(folder)
    prepared = benchmark_prompt(vlm)
    selector = None if name == "dense" else get_selector(name)
    run_once(vlm, prepared, selector, budget)  # warm-up: lazily mapped weights and one-time buffers
    before = reset_peak_rss()
    run_once(vlm, prepared, selector, budget)
    peak = read_memory_kib()["VmHWM"]
    return {"peak_mib": peak / 1024, "extra_mib": (peak - before) / 1024}


def measure_memory(folder: Path, name: str, budget: int | None, threads: int) -> dict[str, float] | str:
    """:func:`peak_memory` of one selector (``"dense"``: none) in a fresh process, or its one-line error."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.prefill",
        "--memory-child",
        str(folder),
        "--selectors",
        name,
        "--threads",
        str(threads),
    ] + ([] if budget is None else ["--budgets", str(budget)])
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPOSITORY)
    if result.returncode:
        raise RuntimeError(f"memory run of {name}@{budget} failed:\n{result.stderr}")
    return json.loads(result.stdout.splitlines()[-1])


def measure(vlm, prepared, names, budgets, repeats):
    """(rows, dense_times): per (selector, budget) its stage and paired runs, or the error."""
    dense_times, rows = [], []
    for name in names:
        selector = get_selector(name)
        for budget in budgets:
            try:
                rows.append(
                    (name, selector.stage, budget, paired_runs(vlm, prepared, selector, budget, repeats, dense_times))
                )
            except PruneAuditError as error:
                rows.append((name, selector.stage, budget, str(error)))
    return rows, dense_times


def memory_rows(folder: Path, timed: list, threads: int, say) -> tuple[dict, list[dict]]:
    """Dense peak memory and one row per (selector, budget) that ran, each measured in a fresh process."""
    dense = measure_memory(folder, "dense", None, threads)
    say("\n| selector | stage | budget | peak MiB | extra MiB | memory vs dense | extra vs dense |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    say(f"| dense | | | {dense['peak_mib']:.1f} | {dense['extra_mib']:.1f} | 1.000 | 1.00 |")
    rows = []
    for name, stage, budget, result in timed:
        if isinstance(result, str):
            say(f"| {name} | {stage} | {budget} | not run: {result} | | | |")
            continue
        memory = measure_memory(folder, name, budget, threads)
        row = {
            "selector": name,
            "stage": stage,
            "budget": budget,
            **memory,
            "memory_vs_dense": memory["peak_mib"] / dense["peak_mib"],
            "extra_vs_dense": memory["extra_mib"] / dense["extra_mib"],
        }
        rows.append(row)
        say(
            f"| {name} | {stage} | {budget} | {row['peak_mib']:.1f} | {row['extra_mib']:.1f} | "
            f"{row['memory_vs_dense']:.3f} | {row['extra_vs_dense']:.2f} |"
        )
    return dense, rows


def check_runs(vlm, prepared, names, budgets) -> list:
    """(name, stage, budget, None or the error) per selector and budget, from one run each (``--memory-only``)."""
    checked = []
    for name in names:
        selector = get_selector(name)
        for budget in budgets:
            try:
                run_once(vlm, prepared, selector, budget)
                checked.append((name, selector.stage, budget, None))
            except PruneAuditError as error:
                checked.append((name, selector.stage, budget, str(error)))
    return checked


def time_table(measured, dense_ms, text_tokens, num_visual, vocabulary, sizes, dense_flops, say) -> list[dict]:
    """Print the timing table; one JSON row per (selector, budget) that ran."""
    say("| selector | stage | budget | realised avg | pruned ms | measured | pair median | ideal | measured / ideal |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for name, stage, budget, result in measured:
        if isinstance(result, str):
            say(f"| {name} | {stage} | {budget} | not run: {result} | | | | | |")
            continue
        times, pair_median, answer = result
        ms = min(times)
        ratio, ideal = ms / dense_ms, ideal_flops(answer, text_tokens, num_visual, vocabulary, sizes) / dense_flops
        rows.append(
            {
                "selector": name,
                "stage": stage,
                "budget": budget,
                "realised_avg": answer.visual_tokens_avg,
                "ms": ms,
                "measured": ratio,
                "pair_median": pair_median,
                "ideal": ideal,
            }
        )
        say(
            f"| {name} | {stage} | {budget} | {answer.visual_tokens_avg:.1f} | {ms:.1f} | {ratio:.3f} | "
            f"{pair_median:.3f} | {ideal:.3f} | {ratio / ideal:.2f} |"
        )
    return rows


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
    parser.add_argument("--memory-only", action="store_true", help="measure peak memory only, no timing")
    parser.add_argument("--memory-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.text_hidden, args.text_layers, args.text_heads) < 1 or args.text_hidden % args.text_heads:
        parser.error("--text-hidden, --text-layers and --text-heads must be positive, the width divisible by the heads")
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(peak_memory(args.memory_child, args.selectors[0], args.budgets[0] if args.budgets else None)))
        return
    sizes = text_sizes(args.text_hidden, args.text_layers, args.text_heads)
    say = (lambda *_: None) if args.json_only else print
    names = args.selectors or list_selectors()
    with tempfile.TemporaryDirectory() as folder:
        build_benchmark_model(Path(folder), sizes)
        vlm = load_benchmark_model(Path(folder))
        prepared = benchmark_prompt(vlm)
        report = {"sizes": sizes, "threads": args.threads}
        if args.memory_only:
            timed = check_runs(vlm, prepared, names, args.budgets)
        else:
            report.update(time_prefill(vlm, prepared, names, args, sizes, say))
            timed = report.pop("measured")
        del vlm  # the memory runs load their own copy
        dense, memory = memory_rows(Path(folder), timed, args.threads, say)
    report["dense_peak_mib"], report["dense_extra_mib"] = dense["peak_mib"], dense["extra_mib"]
    by_key = {(row["selector"], row["budget"]): row for row in report.get("rows", [])}
    for row in memory:
        by_key.setdefault((row["selector"], row["budget"]), {}).update(row)
    report["rows"] = list(by_key.values())
    print(json.dumps(report))


def time_prefill(vlm, prepared, names, args, sizes, say) -> dict:
    """Timing of dense and every (selector, budget): ``dense_ms``, JSON ``rows`` and the raw ``measured`` runs."""
    num_visual, vocabulary = prepared.num_visual, len(vlm.tokenizer)
    text_tokens = prepared.input_ids.numel() - num_visual
    dense_flops = ideal_flops(run_once(vlm, prepared, None, None)[1], text_tokens, num_visual, vocabulary, sizes)
    measured, dense_times = measure(vlm, prepared, names, args.budgets, args.repeats)
    dense_ms = min(dense_times)
    kind = "thread CPU time" if args.threads == 1 else "wall time"
    say(
        f"{num_visual} visual + {text_tokens} text tokens, {vlm.num_layers} decoder layers, "
        f"{args.threads} thread(s), {kind}. Dense: {dense_ms:.1f} ms, minimum of all {len(dense_times)} dense "
        f"runs; pruned: minimum of {args.repeats} runs, each right after a dense run. measured = pruned min / "
        f"dense min; pair median = median of pruned / dense over adjacent runs"
    )
    rows = time_table(measured, dense_ms, text_tokens, num_visual, vocabulary, sizes, dense_flops, say)
    return {"dense_ms": dense_ms, "rows": rows, "measured": measured}


if __name__ == "__main__":
    main()
