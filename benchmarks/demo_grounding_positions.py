"""Does an input-level pruner hurt the task demo's grounding by the tokens it drops or by renumbering positions?

    python benchmarks/demo_grounding_positions.py                       # divprune at 16 and 64, 600 expressions
    python benchmarks/demo_grounding_positions.py --selectors random --budgets 64 --limit 200

LLaVA's reference code, and so the LLaVA family here, gives the tokens an input-level selector keeps consecutive
position ids (``compact``). This diagnostic runs the demo's RefCOCO expressions with the bundled task demo
(``demo-tasks``) twice per selector and budget: as shipped, and with every kept token at its original position id
(``keep_original``, the Qwen families' mode, set here on the model class; ``run`` has no option for it). The same
tokens reach the language model both times; only their positions differ. Reported per run: Acc@0.5, mean IoU, and
the share of expressions whose referred shape kept no token (equal in both modes). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/selectors.py would shadow the standard library's selectors module (torch imports it)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import pyarrow.parquet as pq  # noqa: E402

from prune_audit.cli.main import app  # noqa: E402
from prune_audit.models.base import VisionLanguageModel  # noqa: E402

POSITION_MODES = ("compact", "keep_original")


def grounding_run(selector: str, budget: int, limit: int, positions: str, out: Path) -> dict[str, float]:
    """One ``run --task refcoco`` on the task demo with kept tokens at ``positions``; its accuracy, mean IoU and lost
    share."""
    VisionLanguageModel.input_positions = positions  # the LLaVA family inherits the base class's declaration
    args = ["run", "--task", "refcoco", "--model", "demo-tasks", "--selector", selector, "--budget", str(budget)]
    app([*args, "--limit", str(limit), "--threads", "1", "--quiet", "--out", str(out)], standalone_mode=False)
    recorded = json.loads((out / "manifest.json").read_text())["selector"]["positions"]
    if recorded != positions:  # the manifest says which position ids the language model saw
        raise RuntimeError(f"the run recorded {recorded} positions, not {positions}")
    records = pq.read_table(out / "records.parquet").to_pydict()
    count = len(records["correct"])
    return {
        "accuracy": sum(records["correct"]) / count,
        "mean_iou": sum(records["iou"]) / count,
        "lost_share": sum(bool(lost) for lost in records["lost"]) / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selectors", default="divprune", help="comma-separated input-level selectors")
    parser.add_argument("--budgets", default="16,64", help="comma-separated token budgets")
    parser.add_argument("--limit", type=int, default=600, help="first N expressions of the demo's RefCOCO file")
    args = parser.parse_args()
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for selector in args.selectors.split(","):
            for budget in (int(value) for value in args.budgets.split(",")):
                for positions in POSITION_MODES:
                    out = Path(scratch) / f"{selector}-{budget}-{positions}"
                    scores = grounding_run(selector, budget, args.limit, positions, out)
                    results.append({"selector": selector, "budget": budget, "positions": positions, **scores})
    print("| selector | budget | positions | Acc@0.5 | mean IoU | referred shape lost |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in results:
        print(
            f"| {row['selector']} | {row['budget']} | {row['positions']} | {row['accuracy']:.3f} | "
            f"{row['mean_iou']:.3f} | {row['lost_share']:.1%} |"
        )
    print(f"({time.perf_counter() - start:.1f} s)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
