"""Issue 41 item 4: the hard subsets of ``analysis.subsets`` (VTC-Bench's difficult questions), on run folders
written by hand."""

from __future__ import annotations

import pytest
from test_calibrate_cli import write_run

from prune_audit.analysis.calibration import CalibrationSettings
from prune_audit.analysis.runs import load_run
from prune_audit.analysis.study import StudySettings, subset_note, subset_table
from prune_audit.analysis.subsets import budget_subsets, parse_subset
from prune_audit.errors import PruneAuditError


def test_parse_subset():
    assert parse_subset(None, None, "downsample") is None
    subset = parse_subset("difficult", None, "downsample")
    assert (subset.name, subset.baseline) == ("difficult", "downsample")
    assert parse_subset("difficult", "pool", "downsample").baseline == "pool"


def test_a_budget_whose_baseline_answers_everything_right_is_named(tmp_path):
    """A baseline run that answers every question right leaves no difficult question at its budget: no rows, and
    the note under the table names the budget."""
    dense = load_run(write_run(tmp_path / "dense", seed=2, strength=3.0, tokens=600, selector=None, budget=None))
    perfect = load_run(write_run(tmp_path / "perfect", seed=3, strength=50.0, tokens=100, selector="random"))
    other = load_run(write_run(tmp_path / "other", seed=1, strength=1.5, tokens=100))
    assert perfect.questions.correct.all()
    settings = StudySettings(CalibrationSettings(bootstrap=20), subset=parse_subset("difficult", "random", "x"))
    table = subset_table(dense, [other, perfect], settings)
    assert table.rows == [] and table.empty == ["64"]
    assert "No such question at budget 64: random answers every one right." in subset_note(table)


def test_difficult_keys_are_the_baseline_wrong_answers_of_each_budget(tmp_path):
    dense = load_run(write_run(tmp_path / "dense", seed=2, strength=3.0, tokens=600, selector=None, budget=None))
    runs = [
        load_run(
            write_run(
                tmp_path / f"{selector}-{budget}", seed=seed, strength=1.0, tokens=100, selector=selector, budget=budget
            )
        )
        for seed, (selector, budget) in enumerate([("random", 32), ("divprune", 32), ("random", 64), ("divprune", 64)])
    ]
    parts = budget_subsets(runs, parse_subset("difficult", "random", "x"))
    assert [part.budget for part in parts] == ["32", "64"]
    for part, baseline in zip(parts, (runs[0], runs[2])):
        assert part.baseline is baseline
        wrong = {key for key, right in zip(baseline.questions.keys(), baseline.questions.correct) if not right}
        assert part.keys == wrong and part.mask(dense).sum() == len(wrong)
    with pytest.raises(PruneAuditError, match="needs a divprune run at budget 32"):
        budget_subsets(runs[:1] + runs[3:], parse_subset("difficult", "divprune", "x"))
