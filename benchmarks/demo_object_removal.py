"""Does the shipped demo model look at the queried object? (issue 6)

    python benchmarks/demo_object_removal.py                   # shipped model, demo question set
    python benchmarks/demo_object_removal.py --max-pairs 300 --model DIR

Over the positive (image, object) pairs of the demo question set, the LLM input keeps
the image's patch tokens minus: nothing (full); every token touching the queried
object (k tokens); k random tokens not touching it; k random tokens touching no object.
The last three keep the same number of tokens, so only the first drop should hurt if
the model reads the object's own tokens. Reported: yes-accuracy, mean confidence
(full-vocabulary probability of the chosen answer), mean confidence of the wrong
answers and their share above 0.9. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

# benchmarks/selectors.py would shadow the standard library's selectors module (torch imports it)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from prune_audit.demo import DEMO_MODEL_DIR  # noqa: E402
from prune_audit.demo.evaluate import load_demo  # noqa: E402
from prune_audit.demo.questions import demo_question_set  # noqa: E402
from prune_audit.demo.removal import object_removal  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="demo checkpoint folder")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the demo question set is cached")
    parser.add_argument("--max-pairs", type=int, default=None, help="first N positive pairs only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random drops")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    vlm = load_demo(args.model)
    results = object_removal(vlm, demo_question_set(args.cache_dir), seed=args.seed, max_pairs=args.max_pairs)
    print("| condition | positives | yes-accuracy | mean confidence | wrong: mean confidence | wrong: share p > 0.9 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for condition, r in results.items():
        print(
            f"| {condition} | {r.pairs} | {100 * r.accuracy:.1f} % | {r.mean_confidence:.3f} | "
            f"{r.wrong_confidence:.3f} | {100 * r.wrong_confident_share:.0f} % |"
        )
    print(f"({time.perf_counter() - start:.1f} s)")
    print(json.dumps({condition: asdict(r) for condition, r in results.items()}))


if __name__ == "__main__":
    main()
