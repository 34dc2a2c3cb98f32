"""The lmms-eval plugin against ``prune-audit run`` on the same demo questions, images, selector and budget.

Usage (in the lmms-eval environment, docs/lmms-eval.md)::

    PYTHONPATH=$PWD /work/venv-lmms/bin/python -m benchmarks.lmms_eval_compare OUT [--questions 100] [--captions 20]

For each selector (dense, FastV, DivPrune and VisionZip at 16 tokens) it runs ``prune-audit run`` on the first
demo POPE questions and on caption questions, then lmms-eval's CLI on the local tasks of
``prune_audit.demo.lmms_tasks`` written from the same questions and images (``localpope``: generated answer;
``localpope_mc``: loglikelihood of "yes" and "no"; ``localcaption``), and prints a Markdown table: lmms-eval's
scores, the plugin's realised tokens and FLOPs, and how its records compare with run's (kept sets per stage,
POPE answers, caption texts and sequence probabilities).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prune_audit.demo.lmms_tasks import CAPTION_TOKENS, write_tasks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_lmms_eval_plugin as local  # noqa: E402  (the test's command helpers)

SELECTORS = [("none", None), ("fastv", 16), ("divprune", 16), ("visionzip", 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--captions", type=int, default=20)
    args = parser.parse_args()
    from prune_audit.demo.assets import demo_assets

    demo, root = demo_assets(), args.out
    root.mkdir(parents=True)
    pope_rows = [json.loads(line) for line in demo.pope_files[0].read_text().splitlines()[: args.questions]]
    rows = []
    for selector, budget in SELECTORS:
        name = selector if budget is None else f"{selector}-{budget}"
        # --model demo, the plugin's default: a caption run without --model answers with the task demo
        common = [
            "--model",
            "demo",
            "--selector",
            selector,
            *([] if budget is None else ["--budget", str(budget)]),
            "--images",
            str(demo.images_dir),
            "--annotations",
            str(demo.annotations),
        ]
        pope = local.prune_audit_run(
            root / f"run-pope-{name}", *common, "--pope", str(demo.pope_files[0]), "--limit", str(args.questions)
        )
        caption = local.prune_audit_run(
            root / f"run-caption-{name}",
            *common,
            "--task",
            "caption",
            "--questions",
            str(demo.annotations),
            "--limit",
            str(args.captions),
            "--max-new-tokens",
            str(CAPTION_TOKENS),
        )
        if not (root / "task").is_dir():
            (root / "task").mkdir()
            write_tasks(root / "task", pope_rows, [record["image"] for record in caption], demo.images_dir)
        records = root / f"records-{name}"
        model_args = f"pretrained=demo,selector={selector},records={records},device=cpu"
        model_args += "" if budget is None else f",budget={budget}"
        start = time.perf_counter()
        scores = local.lmms_scores(
            local.run_lmms_eval(
                "prune_audit", model_args, "localpope,localpope_mc,localcaption", root / "task", root / f"out-{name}"
            )
        )
        wall = time.perf_counter() - start
        generated = local.plugin_records(records, "localpope")
        scored = {
            (line["doc_id"], line["continuation"].strip()): line
            for line in local.plugin_records(records, "localpope_mc")
        }
        described = local.plugin_records(records, "localcaption")
        picked = [
            "yes" if scored[(doc, "yes")]["mean_loss"] <= scored[(doc, "no")]["mean_loss"] else "no"
            for doc in range(len(pope))
        ]
        yes_no = [(scored[(doc, "yes")]["probability"], scored[(doc, "no")]["probability"]) for doc in range(len(pope))]
        two_way = [yes / (yes + no) for yes, no in yes_no]  # one spelling each; run sums the spellings
        first_word = ["yes" if line["text"].strip().lower().startswith("yes") else "no" for line in generated]
        kept_equal = sum(line["kept_stages"] == record["kept_stages"] for line, record in zip(generated, pope))
        kept_equal += sum(
            scored[(doc, answer)]["kept_stages"] == record["kept_stages"]
            for doc, record in enumerate(pope)
            for answer in ("yes", "no")
        )
        kept_equal += sum(line["kept_stages"] == record["kept_stages"] for line, record in zip(described, caption))
        rows.append(
            {
                "selector": name,
                "accuracy": scores["localpope"]["accuracy,none"],
                "mc": scores["localpope_mc"]["acc,none"],
                "tokens": sum(line["visual_tokens_avg"] for line in generated) / len(generated),
                "flops": sum(line["flops"] / line["flops_dense"] for line in generated) / len(generated),
                "kept": f"{kept_equal}/{3 * len(pope) + len(caption)}",
                "mc_vs_run": f"{sum(p == r['answer'] for p, r in zip(picked, pope))}/{len(pope)}",
                "two_way": max(abs(p - r["p_yes_2way"]) for p, r in zip(two_way, pope)),
                "gen_vs_run": f"{sum(w == r['answer'] for w, r in zip(first_word, pope))}/{len(pope)}",
                "captions": f"{sum(line['text'] == r['answer_text'] for line, r in zip(described, caption))}/{len(caption)}",
                "sequence": max(
                    abs(line["sequence_probability"] - r["sequence_prob"]) for line, r in zip(described, caption)
                ),
                "wall": wall,
            }
        )
    print(
        "| selector | localpope accuracy | localpope_mc acc | visual tokens | FLOPs vs dense | kept sets equal to "
        "run's | mc answer = run's | max two-way P(yes) diff | generated yes/no = run's | caption text = run's "
        "| max caption sequence-prob diff | lmms-eval wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['selector']} | {row['accuracy']:.2f} | {row['mc']:.2f} | {row['tokens']:.1f} | {row['flops']:.3f} "
            f"| {row['kept']} | {row['mc_vs_run']} | {row['two_way']:.1e} | {row['gen_vs_run']} | {row['captions']} "
            f"| {row['sequence']:.1e} | {row['wall']:.0f} s |"
        )


if __name__ == "__main__":
    main()
