"""The lmms-eval model plugin (``prune_audit.api.lmms_eval``) through lmms-eval's own command line.

Runs only where the optional extra is installed (``pip install "prune-audit[lmms-eval]"``) with this checkout
registered for the ``lmms_eval.models`` entry point; elsewhere it is skipped. Local tasks (Parquet files of demo
questions and images, their YAML through ``--include_path``) cover every request type the plugin serves:
``localpope`` (generate_until), ``localpope_mc`` (multiple_choice: loglikelihood of "yes" and "no"),
``localpope_rounds`` (generate_until_multi_round, two rounds) and ``localcaption`` (generate_until, "Describe this
image in detail."). They run on the demo and on a tiny offline LLaVA, dense and pruned; the plugin's records must
equal the Python API's answers on the same inputs and, under FastV on the demo, ``prune-audit run``'s records on
the same questions (POPE and captions). Dense answers must equal lmms-eval's own ``llava_hf`` class.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prune_audit.demo.lmms_tasks import CAPTION_PROMPT, CAPTION_TOKENS, MAX_NEW_TOKENS, write_tasks
from prune_audit.demo.lmms_tasks import TASKS as TASK_NAMES

pytest.importorskip("lmms_eval")
REPO = Path(__file__).resolve().parents[1]
QUESTIONS = 8
CAPTIONS = 4
TASKS = ",".join(TASK_NAMES)
ENVIRONMENT = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def lmms_eval_command() -> Path:
    command = Path(sys.executable).parent / "lmms-eval"
    if not command.is_file():
        pytest.skip("the lmms-eval command is not installed beside this Python")
    from importlib.metadata import entry_points

    if not any(entry.name == "prune_audit" for entry in entry_points(group="lmms_eval.models")):
        pytest.skip("prune-audit is not registered for lmms_eval.models here (pip install -e '.[lmms-eval]')")
    return command


def run_lmms_eval(model: str, model_args: str, tasks: str, task_dir: Path, out: Path, batch_size: int = 1) -> Path:
    """lmms-eval's CLI on the local tasks; the folder of its results."""
    completed = subprocess.run(
        [
            str(lmms_eval_command()),
            "eval",
            "--model",
            model,
            "--model_args",
            model_args,
            "--tasks",
            tasks,
            "--include_path",
            str(task_dir),
            "--output_path",
            str(out),
            "--batch_size",
            str(batch_size),
            "--log_samples",
        ],
        capture_output=True,
        text=True,
        env=ENVIRONMENT,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return out


def prune_audit_run(out: Path, *arguments: str) -> list[dict]:
    """``prune-audit run`` (the CLI, in a child process) on the demo; its records as dicts in question order."""
    import pyarrow.parquet as pq

    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "prune_audit.cli.main",
            "run",
            "--device",
            "cpu",
            "--quiet",
            "--out",
            str(out),
            *arguments,
        ],
        capture_output=True,
        text=True,
        env=ENVIRONMENT,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return pq.read_table(out / "records.parquet").to_pylist()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> dict:
    """``prune-audit run`` under FastV at 16 on the first demo POPE questions and captions, and the local tasks
    written from the same questions and images."""
    lmms_eval_command()
    from prune_audit.demo.assets import demo_assets

    demo, root = demo_assets(), tmp_path_factory.mktemp("lmms")
    # the plugin's default model; without --model a caption run would answer with the task demo
    common = ["--model", "demo", "--selector", "fastv", "--budget", "16", "--images", str(demo.images_dir)]
    pope = prune_audit_run(
        root / "run-pope",
        *common,
        "--pope",
        str(demo.pope_files[0]),
        "--annotations",
        str(demo.annotations),
        "--limit",
        str(QUESTIONS),
    )
    caption = prune_audit_run(
        root / "run-caption",
        *common,
        "--task",
        "caption",
        "--questions",
        str(demo.annotations),
        "--annotations",
        str(demo.annotations),
        "--limit",
        str(CAPTIONS),
        "--max-new-tokens",
        str(CAPTION_TOKENS),
    )
    pope_rows = [json.loads(line) for line in demo.pope_files[0].read_text().splitlines()[:QUESTIONS]]
    assert [row["question_id"] for row in pope_rows] == [record["question_id"] for record in pope]
    (root / "task").mkdir()
    write_tasks(root / "task", pope_rows, [record["image"] for record in caption], demo.images_dir)
    return {"root": root, "pope": pope, "caption": caption, "pope_rows": pope_rows}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from prune_audit.data.scenes import CATEGORIES
    from prune_audit.models.llava import LlavaModel

    words = ["Is", "there", "a", "an", "in", "the", "image", "yes", "no", "Describe", "this", *CATEGORIES]
    return LlavaModel.build_tiny(
        tmp_path_factory.mktemp("tiny") / "model", words=words, image_size=56, patch_size=14, text_layers=4, seed=0
    )


def recorded_kept(result) -> list[list[int]]:
    """An API result's kept sets as run records them: the unpruned model as one stage keeping every token."""
    return result.kept_stages or [list(range(result.grid[0] * result.grid[1]))]


def plugin_records(records: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (records / f"{task}.jsonl").read_text().splitlines()]


def lmms_scores(out: Path) -> dict:
    [results_file] = out.rglob("*_results.json")
    return json.loads(results_file.read_text())["results"]


@pytest.mark.parametrize(
    "model, selector, budget, batch_size",
    [
        ("demo", "none", None, 1),
        ("demo", "fastv", 16, 3),
        ("tiny", "fastv", 6, 2),
        ("tiny", "divprune", 6, 1),
    ],
)
def test_plugin_answers_every_request_type_as_the_python_api(demo_run, tiny_model, model, selector, budget, batch_size):
    from prune_audit import load, pruned
    from prune_audit.demo.assets import demo_assets

    pretrained = "demo" if model == "demo" else str(tiny_model)
    root = demo_run["root"] / f"{model}-{selector}"
    model_args = f"pretrained={pretrained},selector={selector},records={root / 'records'},device=cpu"
    model_args += "" if budget is None else f",budget={budget}"
    scores = lmms_scores(
        run_lmms_eval("prune_audit", model_args, TASKS, demo_run["root"] / "task", root / "out", batch_size)
    )
    rows, images_dir = demo_run["pope_rows"], demo_assets().images_dir
    images = [images_dir / row["image"] for row in rows]
    questions = [row["text"] for row in rows]
    with pruned(load(pretrained, device="cpu"), selector, budget) as api:
        expected = api.generate(images, questions, max_new_tokens=MAX_NEW_TOKENS)
        yes = api.score(images, questions, ["yes"] * QUESTIONS)
        no = api.score(images, questions, ["no"] * QUESTIONS)
        again = api.generate(
            images, [f"You said {e.text}. {q}" for e, q in zip(expected, questions)], max_new_tokens=MAX_NEW_TOKENS
        )
        captions = api.generate(
            [images_dir / record["image"] for record in demo_run["caption"]],
            [CAPTION_PROMPT] * CAPTIONS,
            max_new_tokens=CAPTION_TOKENS,
        )

    generated = plugin_records(root / "records", "localpope")
    assert [line["doc_id"] for line in generated] == list(range(QUESTIONS))
    assert [line["text"] for line in generated] == [result.text for result in expected]
    assert [line["kept_stages"] for line in generated] == [recorded_kept(result) for result in expected]
    assert [line["sequence_probability"] for line in generated] == pytest.approx(
        [result.sequence_probability for result in expected], rel=1e-5
    )
    scored = [result.text.lower().startswith(row["label"]) for result, row in zip(expected, rows)]
    assert scores["localpope"]["accuracy,none"] == pytest.approx(sum(scored) / QUESTIONS)

    choices = sorted(
        plugin_records(root / "records", "localpope_mc"), key=lambda line: (line["doc_id"], line["continuation"])
    )
    assert [(line["doc_id"], line["continuation"].strip()) for line in choices] == [
        (doc, answer) for doc in range(QUESTIONS) for answer in ("no", "yes")
    ]
    for doc, (line_no, line_yes) in enumerate(zip(choices[::2], choices[1::2])):
        assert line_yes["log_probability"] == pytest.approx(yes[doc].log_probability, abs=1e-5)
        assert line_no["log_probability"] == pytest.approx(no[doc].log_probability, abs=1e-5)
        assert line_yes["kept_stages"] == recorded_kept(yes[doc])
        assert line_yes["mean_loss"] == pytest.approx(-yes[doc].log_probability / len(yes[doc].token_probs), abs=1e-5)
        assert line_yes["is_greedy"] == yes[doc].is_greedy
    picked = [
        "yes" if y.log_probability / len(y.token_probs) >= n.log_probability / len(n.token_probs) else "no"
        for y, n in zip(yes, no)
    ]
    assert scores["localpope_mc"]["acc,none"] == pytest.approx(
        sum(p == row["label"] for p, row in zip(picked, rows)) / QUESTIONS
    )

    rounds = plugin_records(root / "records", "localpope_rounds")
    assert [(line["doc_id"], line["round"]) for line in rounds] == [(d, r) for d in range(QUESTIONS) for r in (0, 1)]
    assert [line["text"] for line in rounds[::2]] == [result.text for result in expected]
    assert [line["text"] for line in rounds[1::2]] == [result.text for result in again]

    described = plugin_records(root / "records", "localcaption")
    assert [line["text"] for line in described] == [result.text for result in captions]


def test_plugin_records_equal_prune_audit_run(demo_run):
    """Same selector (FastV at 16), questions, images and prompts: the plugin's kept sets per stage equal
    ``prune-audit run``'s; captions (both greedy) have the same text and sequence probability; POPE's answers
    agree, run's from the first token's yes/no probabilities (spellings summed), the plugin's from the
    multiple-choice scores of "yes" and "no" (one spelling each)."""
    root = demo_run["root"] / "demo-fastv"
    if not (root / "records").is_dir():
        run_lmms_eval(
            "prune_audit",
            f"pretrained=demo,selector=fastv,budget=16,records={root / 'records'},device=cpu",
            TASKS,
            demo_run["root"] / "task",
            root / "out",
        )
    generated = plugin_records(root / "records", "localpope")
    assert [line["kept_stages"] for line in generated] == [record["kept_stages"] for record in demo_run["pope"]]
    assert [line["stage_layers"] for line in generated] == [record["stage_layers"] for record in demo_run["pope"]]
    choices = plugin_records(root / "records", "localpope_mc")
    by_doc = {(line["doc_id"], line["continuation"].strip()): line for line in choices}
    picked = [
        "yes" if by_doc[(doc, "yes")]["mean_loss"] <= by_doc[(doc, "no")]["mean_loss"] else "no"
        for doc in range(QUESTIONS)
    ]
    assert picked == [record["answer"] for record in demo_run["pope"]]
    assert all(
        by_doc[(doc, "yes")]["kept_stages"] == record["kept_stages"] for doc, record in enumerate(demo_run["pope"])
    )
    described = plugin_records(root / "records", "localcaption")
    assert [line["kept_stages"] for line in described] == [record["kept_stages"] for record in demo_run["caption"]]
    assert [line["text"] for line in described] == [record["answer_text"] for record in demo_run["caption"]]
    assert [line["sequence_probability"] for line in described] == pytest.approx(
        [record["sequence_prob"] for record in demo_run["caption"]], rel=1e-5
    )
    assert all(math.isfinite(line["flops"]) for line in described)


def test_dense_answers_equal_lmms_evals_own_llava_class(demo_run):
    """selector=none gives lmms-eval's llava_hf answers on the same inputs (the demo is a LLaVA checkpoint)."""
    pytest.importorskip("decord")  # lmms-eval's llava_hf module imports it
    from prune_audit.demo import DEMO_MODEL_DIR

    answers = {}
    for model, model_args in [
        ("prune_audit", "pretrained=demo,selector=none,device=cpu"),
        ("llava_hf", f"pretrained={DEMO_MODEL_DIR},device=cpu,device_map=cpu,dtype=float32"),
    ]:
        out = run_lmms_eval(model, model_args, "localpope", demo_run["root"] / "task", demo_run["root"] / model)
        [samples] = out.rglob("*samples*.jsonl")
        answers[model] = [json.loads(line)["filtered_resps"] for line in samples.read_text().splitlines()]
    assert len(answers["prune_audit"]) == QUESTIONS
    assert answers["prune_audit"] == answers["llava_hf"]


@pytest.mark.slow
def test_the_comparison_benchmark_prints_all_equal_rows(tmp_path):
    """``benchmarks/lmms_eval_compare.py`` at a small size (issue 40): every selector's kept sets, answers and
    captions through lmms-eval equal ``prune-audit run``'s, as docs/lmms-eval.md reports at full size."""
    lmms_eval_command()
    questions, captions = 20, 4
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.lmms_eval_compare",
            str(tmp_path / "compare"),
            "--questions",
            str(questions),
            "--captions",
            str(captions),
        ],
        capture_output=True,
        text=True,
        env=ENVIRONMENT,
        cwd=REPO,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in completed.stdout.splitlines() if line.startswith("| ")][1:]
    assert [cells[0].strip() for cells in rows] == ["none", "fastv-16", "divprune-16", "visionzip-16"]
    for cells in rows:
        kept, mc_answers, generated, described = (cells[index].strip() for index in (5, 6, 8, 9))
        assert kept == f"{3 * questions + captions}/{3 * questions + captions}", cells
        assert mc_answers == generated == f"{questions}/{questions}", cells
        assert described == f"{captions}/{captions}", cells
