"""The demo models reproduce the calibration study's mechanism (issue 16).

A selector at a feasible budget loses objects at its first stage; on those yes-questions the
pruned model's accuracy falls well below the unpruned model's on the same questions, while
its mean confidence stays high. The runs use the questions of the model card's table
(`python -m benchmarks.demo_pruning --per-split 50`: the first 50 of each POPE split).

Input-level (random@16) on the shipped 3-layer demo: measured 22 of 75 yes-questions lost,
accuracy on them 27.3 % vs 100 % unpruned, confidence 0.994 (model card). In-LLM (FastV, E2S)
needs a demo with at least 8 decoder layers; none ships yet, so those cases skip with the
reason, and their thresholds (the issue's: 30 points below the unpruned model, confidence at
least 0.8) are to be checked against the table when one does.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prune_audit.analysis.lost_objects import lost_object_summary
from prune_audit.analysis.runs import load_run
from prune_audit.cli.main import app
from prune_audit.demo import DEMO_MODELS
from prune_audit.demo.assets import demo_assets
from prune_audit.demo.questions import first_questions

runner = CliRunner()
PER_SPLIT = 50

# (demo, selector, budget): feasible for a demo with 8 or more decoder layers (16 is not: the 144
# tokens of layer 0 alone average 18 per layer); the thresholds are to be re-derived from the model
# card's table when a deeper demo ships
IN_LLM_CASES = [
    ("demo", "fastv", 32),
    ("demo", "e2s", 32),
    ("demo-qwen", "fastv", 16),
    ("demo-qwen", "e2s", 16),
]


def _missing_reason(name: str) -> str | None:
    """Why the bundled ``name`` cannot show the mechanism in the LLM, or None when it can."""
    config_file = DEMO_MODELS[name] / "config.json"
    if not config_file.is_file():
        return f"the {name} checkpoint is not bundled"
    layers = json.loads(config_file.read_text())["text_config"]["num_hidden_layers"]
    if layers < 8:
        # issue 16: with 3 layers every in-LLM schedule collapses onto layers 1-2 and evidence has
        # already spread into the text tokens there; the deeper demo replaces it when it reaches 97 %
        return f"the bundled {name} has {layers} decoder layers; in-LLM pruning needs the deeper demo (issue 16)"
    return None


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_every_in_llm_schedule_is_feasible_on_distinct_layers_of_the_llava_demo(budget):
    from prune_audit.pruners import LayerSelector, get_selector, list_selectors

    config = json.loads((DEMO_MODELS["demo"] / "config.json").read_text())
    layers = config["text_config"]["num_hidden_layers"]
    tokens = (config["vision_config"]["image_size"] // config["vision_config"]["patch_size"]) ** 2
    for name in list_selectors():
        selector = get_selector(name)
        if not isinstance(selector, LayerSelector):
            continue
        stages = selector.schedule(layers, tokens, budget)  # raises when the budget is infeasible
        stage_layers = [stage.layer for stage in stages]
        assert len(set(stage_layers)) == len(stage_layers) and 0 < stage_layers[0], (name, stages)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-pruning")

    def run(name: str, selector: str, budget: int | None):
        out = root / f"{name}-{selector}-{budget}"
        if not out.exists():
            assets = demo_assets(name=name)
            files = first_questions(assets.pope_files, PER_SPLIT, root / "questions")
            args = ["run", "--model", name, "--images", str(assets.images_dir), "--annotations", str(assets.annotations),
                    "--out", str(out), "--device", "cpu", "--threads", "1"]
            args += [arg for path in files for arg in ("--pope", str(path))]
            if budget is not None:
                args += ["--selector", selector, "--budget", str(budget)]
            result = runner.invoke(app, args)
            assert result.exit_code == 0, result.output[-2000:]
        return load_run(out).questions

    return run


@pytest.mark.slow
def test_input_level_lost_objects_lose_accuracy_but_not_confidence(run_dir):
    summary = lost_object_summary(run_dir("demo", "random", 16), run_dir("demo", "none", None))
    assert summary.lost >= 12, summary
    assert summary.dense_lost_accuracy >= 0.9, summary
    assert summary.dense_lost_accuracy - summary.lost_accuracy >= 0.4, summary
    assert summary.lost_confidence >= 0.9, summary


@pytest.mark.slow
@pytest.mark.parametrize(("name", "selector", "budget"), IN_LLM_CASES)
def test_in_llm_lost_objects_lose_accuracy_but_not_confidence(run_dir, name, selector, budget):
    reason = _missing_reason(name)
    if reason:
        pytest.skip(reason)
    summary = lost_object_summary(run_dir(name, selector, budget), run_dir(name, "none", None))
    assert summary.lost >= 10, summary
    assert summary.dense_lost_accuracy >= 0.9, summary
    assert summary.dense_lost_accuracy - summary.lost_accuracy >= 0.3, summary
    assert summary.lost_confidence >= 0.8, summary

def _table(correct, confidence, lost, label_yes, order=None):
    import numpy as np

    from prune_audit.analysis.questions import QuestionTable

    n = len(correct)
    order = np.arange(n) if order is None else np.asarray(order)
    column = lambda values, dtype: np.asarray(values, dtype=dtype)[order]  # noqa: E731
    return QuestionTable(
        split=np.array(["random"] * n), question_id=order.astype(np.int64), image_id=np.zeros(n, dtype=np.int64),
        label_yes=column(label_yes, bool), answer_yes=column(label_yes, bool), correct=column(correct, bool),
        confidence=column(confidence, float), p_yes=np.full(n, 0.5), logit_diff=np.zeros(n),
        retention=np.full(n, np.nan), lost=column(lost, float), cost_tokens=np.ones(n),
    )


def test_lost_object_summary_pairs_the_lost_questions_with_the_unpruned_run():
    nan = float("nan")
    pruned = _table([False, False, True, True, True], [0.9, 0.7, 0.8, 0.6, 0.9], [1, 1, 0, nan, nan],
                    [True, True, True, True, False])
    # the unpruned run lists the same questions in another order
    dense = _table([True, False, True, True, True], [0.95, 0.85, 0.9, 0.9, 0.9], [0, 0, 0, nan, nan],
                   [True, True, True, True, False], order=[4, 3, 2, 1, 0])
    summary = lost_object_summary(pruned, dense)
    assert (summary.questions, summary.yes_with_mask, summary.lost) == (5, 3, 2)
    assert summary.lost_share == pytest.approx(2 / 3)
    assert summary.lost_accuracy == 0.0 and summary.lost_confidence == pytest.approx(0.8)
    assert summary.dense_lost_accuracy == 0.5 and summary.dense_lost_confidence == pytest.approx(0.9)
    assert summary.accuracy == pytest.approx(0.6) and summary.mean_confidence == pytest.approx(0.78)
