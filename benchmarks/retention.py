"""Time object-area retention for POPE-sized workloads (issue 3: 9,000 questions, 576 tokens, < 5 s).

    python benchmarks/retention.py                       # 9000 questions, LLaVA pad geometry (576 tokens)
    python benchmarks/retention.py --mode qwen_smart_resize --questions 27000

Workload: POPE question sets are built from tiny_coco (../shared/data) with POPE's rules
(every eligible image, seed 0, three splits) and replicated until there are
``--questions`` questions. Each replica counts as new images, so its masks are decoded
again: with 9,000 questions that is about 1,500 (image, category) pairs with instances,
as in the real POPE files (1,500 distinct "yes" pairs). Every question gets a random
kept set of ``--keep`` tokens.

Timed, end to end: per-(image, category) mask decoding (pycocotools) and reduction to
per-token areas (``ObjectAreaCache``), then ``retention_by_stage`` over all questions: the
same cache and function ``prune-audit run`` computes its records with (``runner/build.py``).
The median of ``--repeats`` runs is reported; the last line is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import clip_geometry, qwen_geometry
from prune_audit.data.pope_build import build_pope
from prune_audit.data.retention import ObjectAreaCache, retention_by_stage

DEFAULT_ANNOTATIONS = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "data"
    / "coco"
    / "tiny_coco_val2017"
    / "instances_val2017.json"
)


def geometry_function(mode: str):
    if mode == "qwen_smart_resize":
        return lambda size: qwen_geometry(size)
    return lambda size: clip_geometry(size, mode=mode)


def run_once(coco: CocoInstances, questions: list, count: int, mode: str, keep: int, seed: int) -> dict[str, float]:
    """One end-to-end pass over ``count`` questions (the set replicated); seconds per phase and counts."""
    geometry_for = geometry_function(mode)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    caches = [ObjectAreaCache(coco, geometry_for) for _ in range(math.ceil(count / len(questions)))]
    areas = [
        caches[i // len(questions)].get(coco.image_id(q.image), q.object)
        for i, q in zip(range(count), itertools.cycle(questions))
    ]
    decoded = time.perf_counter()
    kept = [
        rng.choice(len(area.area_per_token), size=min(keep, len(area.area_per_token)), replace=False) for area in areas
    ]
    drawn = time.perf_counter()
    retention_by_stage(areas, [[k] for k in kept])
    done = time.perf_counter()
    return {
        "questions": len(areas),
        "pairs_decoded": sum(len(cache) for cache in caches),
        "pairs_with_mask": len({id(area) for area in areas if area.has_mask}),
        "decode_s": decoded - start,
        "retention_s": done - drawn,
        "total_s": (decoded - start) + (done - drawn),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--annotations", type=Path, default=DEFAULT_ANNOTATIONS)
    parser.add_argument("--questions", type=int, default=9000)
    parser.add_argument("--mode", default="llava_pad", choices=["llava_pad", "hf_crop", "hf_pad", "qwen_smart_resize"])
    parser.add_argument("--keep", type=int, default=64, help="kept tokens per question")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    coco = CocoInstances.load(args.annotations)
    sets = build_pope(coco, sample_images=None, seed=0)
    questions = [q for split in sets.values() for q in split]
    runs = [run_once(coco, questions, args.questions, args.mode, args.keep, seed) for seed in range(args.repeats)]
    summary = {key: runs[0][key] for key in ("questions", "pairs_decoded", "pairs_with_mask")}
    for key in ("decode_s", "retention_s", "total_s"):
        summary[key] = statistics.median(run[key] for run in runs)
    summary.update(mode=args.mode, keep=args.keep, repeats=args.repeats)
    print(
        f"{summary['questions']} questions ({args.mode}, keep {args.keep}): "
        f"decode+areas {summary['decode_s']:.2f} s for {summary['pairs_decoded']} pairs "
        f"({summary['pairs_with_mask']} with a mask), retention {summary['retention_s'] * 1000:.1f} ms, "
        f"total {summary['total_s']:.2f} s (median of {args.repeats})"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
