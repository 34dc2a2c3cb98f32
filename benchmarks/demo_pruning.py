"""The demo model card's pruning table: every selector x budget on the demo questions (issue 16).

    python -m benchmarks.demo_pruning --model demo --budgets 16,32,64
    python -m benchmarks.demo_pruning --model demo-qwen --budgets 16,32 --per-split 300 --selectors fastv,e2s
    python -m benchmarks.demo_pruning --selectors tome --option location=tower --budgets 32,64

Runs ``prune-audit run`` (through the Python API) unpruned and for each selector and budget
on the demo question set, or on its first ``--per-split`` questions of each POPE split
(written to ``OUT/questions``), into ``OUT/<selector>-<budget>[-<option>...]`` (finished runs are
reused; ``--option KEY=VALUE``, repeatable, goes to every selector).
Per run, against the unpruned run on the same questions: accuracy, mean confidence
(two-way top-label), the share of yes-questions whose object lost every token (the records'
``lost`` column, i.e. at the first pruning stage), accuracy and mean confidence on those lost questions for the
pruned and the unpruned model, ECE (15 bins) and AUROC; under the table, for runs whose merged tokens
carry objects the kept cells lose (the records' ``diluted``: VisionZip, SparseVLM with ``recycle=true``),
the same numbers on those diluted questions. Writes ``OUT/table.md`` and
``OUT/table.json`` and prints the table. Selectors or budgets the model cannot run
(e.g. a budget below what the layers before the first stage already use) are listed
with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# benchmarks/selectors.py would shadow the standard library's selectors module (torch imports it)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from prune_audit.analysis.lost_objects import lost_object_summary  # noqa: E402
from prune_audit.analysis.runs import load_run  # noqa: E402
from prune_audit.demo import DEMO_MODELS  # noqa: E402
from prune_audit.demo.assets import demo_assets, is_demo_name  # noqa: E402
from prune_audit.demo.questions import first_questions  # noqa: E402
from prune_audit.errors import PruneAuditError  # noqa: E402
from prune_audit.runner.execute import execute  # noqa: E402
from prune_audit.runner.plan import plan_run  # noqa: E402
from prune_audit.runner.request import RunRequest  # noqa: E402

COLUMNS = (
    ("run", "selector@budget"),
    ("accuracy", "accuracy"),
    ("mean_confidence", "mean conf."),
    ("lost_share", "yes-questions lost"),
    ("lost_accuracy", "lost: acc."),
    ("dense_lost_accuracy", "lost: unpruned acc."),
    ("lost_confidence", "lost: conf."),
    ("dense_lost_confidence", "lost: unpruned conf."),
    ("ece", "ECE"),
    ("auroc", "AUROC"),
)


def question_files(model: str, out: Path, per_split: int | None) -> tuple[str, list[Path], Path, Path]:
    """(model folder, POPE files, image folder, annotations) of the demo set, or its first questions."""
    if not is_demo_name(model):
        raise PruneAuditError(f"--model must be a bundled demo ({', '.join(DEMO_MODELS)}), got {model!r}")
    assets = demo_assets(name=model)
    files = list(assets.pope_files)
    if per_split is not None:
        files = first_questions(files, per_split, out / "questions")
    return str(assets.model_dir), files, assets.images_dir, assets.annotations


def run_once(
    model: str,
    files: list[Path],
    images: Path,
    annotations: Path,
    selector: str,
    budget: int | None,
    run_dir: Path,
    batch_size: int,
    threads: int,
    options: list[str] = (),
) -> Path:
    """One audit run (resumed if partly done); returns its folder."""
    request = RunRequest(
        model=model,
        selector=selector,
        budget=budget,
        question_files=files,
        images=images,
        annotations=annotations,
        out=run_dir,
        batch_size=batch_size,
        device="cpu",
        threads=threads,
        options=list(options),
        command=f"benchmarks.demo_pruning {selector}@{budget}",
    )
    result = execute(plan_run(request))
    if not result.complete:
        raise PruneAuditError(f"{run_dir} did not finish")
    return run_dir


def row_text(name: str, values: dict) -> str:
    cells = [name]
    for key, _ in COLUMNS[1:]:
        value = values[key]
        cells.append(
            "–" if value != value else f"{100 * value:.1f} %" if key.endswith(("accuracy", "share")) else f"{value:.3f}"
        )
    return "| " + " | ".join(cells) + " |"


def diluted_text(name: str, values: dict) -> str:
    """One line on the yes-questions whose object only merged tokens carry."""
    return (
        f"* {name}: {values['diluted']} yes-questions diluted ({100 * values['diluted_share']:.1f} %), "
        f"accuracy {100 * values['diluted_accuracy']:.1f} % (unpruned {100 * values['dense_diluted_accuracy']:.1f} %), "
        f"confidence {values['diluted_confidence']:.3f} (unpruned {values['dense_diluted_confidence']:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo or demo-qwen")
    parser.add_argument(
        "--selectors", default=None, help="comma-separated (default: every selector the model supports)"
    )
    parser.add_argument("--budgets", default="16,32,64", help="comma-separated visual-token budgets")
    parser.add_argument("--per-split", type=int, default=None, help="first N questions of each POPE split only")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the runs and the table (default runs/<model>-pruning)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--option", action="append", default=[], help="selector option KEY=VALUE for every selector")
    args = parser.parse_args()
    out = args.out or Path("runs") / f"{args.model}-pruning"
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.per_split is not None and args.per_split <= 0:
        raise SystemExit(f"--per-split must be positive, got {args.per_split}")
    start = time.perf_counter()
    model, files, images, annotations = question_files(args.model, out, args.per_split)
    if args.selectors:
        selectors = args.selectors.split(",")
    else:
        from prune_audit.models import load_vlm

        selectors = [s for s in load_vlm(model, device="cpu").supported_selectors() if s != "none"]
    dense = load_run(
        run_once(model, files, images, annotations, "none", None, out / "dense", args.batch_size, args.threads)
    )
    rows, skipped = {}, {}
    for selector in selectors:
        for budget in budgets:
            name = f"{selector}@{budget}" + "".join(f" {option}" for option in args.option)
            folder = "-".join([selector, str(budget), *args.option])
            try:
                run_dir = run_once(
                    model,
                    files,
                    images,
                    annotations,
                    selector,
                    budget,
                    out / folder,
                    args.batch_size,
                    args.threads,
                    args.option,
                )
            except (PruneAuditError, ValueError) as error:  # the CLI reports both as user errors
                skipped[name] = str(error)
                print(f"{name}: skipped ({error})", file=sys.stderr)
                continue
            rows[name] = lost_object_summary(load_run(run_dir).questions, dense.questions).as_dict()
            print(f"{name}: done after {time.perf_counter() - start:.0f} s", file=sys.stderr)
    dense_row = lost_object_summary(dense.questions, dense.questions).as_dict()
    lines = [
        f"{len(dense.questions)} questions ({'first ' + str(args.per_split) + ' per split' if args.per_split else 'all'}), "
        f"model {args.model}; command: python -m benchmarks.demo_pruning {' '.join(sys.argv[1:])}",
        "",
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
        row_text("unpruned", dense_row),
        *(row_text(name, values) for name, values in rows.items()),
    ]
    diluted = {name: values for name, values in rows.items() if values["diluted"]}
    if diluted:
        lines += [
            "",
            "Diluted: the object only in cells a merged token carries (not lost, as the table counts):",
            *(diluted_text(name, values) for name, values in diluted.items()),
        ]
    if skipped:
        lines += ["", *(f"* not run: {name}: {reason}" for name, reason in skipped.items())]
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    (out / "table.json").write_text(json.dumps({"unpruned": dense_row, "runs": rows, "skipped": skipped}, indent=2))
    print(table)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
