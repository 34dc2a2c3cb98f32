"""``prune-audit intervene``: the swaps (pure), and the command end to end on a tiny offline LLaVA.

The forced sets are checked from the written records against the run's own records and
object masks recomputed here: restored cells are the object's largest cells, control cells
are neither kept nor object, both conditions swap as many cells and keep the budget, and
in-LLM stage sets stay nested with their sizes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from test_run_cli import _assert_one_line_failure as assert_one_line_failure
from test_run_cli import base_args
from typer.testing import CliRunner

from prune_audit.analysis.bootstrap import image_counts
from prune_audit.cli.main import app
from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import TokenGeometry
from prune_audit.data.retention import object_area
from prune_audit.records.schema import TIMING_COLUMNS
from prune_audit.runner.intervene.swaps import NoSwap, Swap, remove_swaps, restore_swaps, swap_stages

runner = CliRunner()


# ----- swaps ---------------------------------------------------------------------------


def area_grid(values: dict[int, int], size: int = 16) -> np.ndarray:
    area = np.zeros(size, dtype=np.int64)
    for cell, pixels in values.items():
        area[cell] = pixels
    return area


def test_restore_takes_the_largest_object_cells_and_a_free_control():
    area = area_grid({2: 5, 3: 9, 6: 9, 7: 1, 11: 4})
    kept = [0, 1, 8, 9, 12]
    pair = restore_swaps(kept, area, max_cells=3, rng=np.random.default_rng(0))
    assert pair.intervention.added == (2, 3, 6)  # areas 9, 9 (cells 3, 6), then 5 (cell 2); 4 at cell 11 is out
    assert pair.intervention.removed == pair.control.removed
    assert set(pair.control.removed) <= set(kept) and len(set(pair.control.removed)) == 3
    free = set(range(16)) - set(kept) - {2, 3, 6, 7, 11}
    assert set(pair.control.added) <= free and len(set(pair.control.added)) == 3
    # fewer kept cells than max_cells: all of them are replaced
    small = restore_swaps([0, 1], area, max_cells=8, rng=np.random.default_rng(0))
    assert sorted(small.intervention.removed) == [0, 1] and small.intervention.added == (3, 6)


def test_restore_refuses_impossible_questions():
    with pytest.raises(NoSwap, match="still holds"):
        restore_swaps([2, 5], area_grid({2: 3}), 8, np.random.default_rng(0))
    with pytest.raises(NoSwap, match="no grid cell"):
        restore_swaps([1, 5], area_grid({}), 8, np.random.default_rng(0))
    everything_else = [i for i in range(16) if i != 4]
    with pytest.raises(NoSwap, match="free"):
        restore_swaps(everything_else, area_grid({4: 2}), 8, np.random.default_rng(0))


def test_remove_takes_out_the_object_cells_for_the_same_free_cells():
    area = area_grid({1: 3, 5: 7, 6: 2, 14: 1})
    kept = [0, 1, 5, 9, 10, 12]
    pair = remove_swaps(kept, area, np.random.default_rng(3))
    assert sorted(pair.intervention.removed) == [1, 5]
    assert pair.intervention.added == pair.control.added
    assert set(pair.control.removed) <= {0, 9, 10, 12} and len(set(pair.control.removed)) == 2
    assert set(pair.intervention.added) <= set(range(16)) - set(kept) - {1, 5, 6, 14}
    assert pair.intervention.object_area_changed(area) == -10 and pair.control.object_area_changed(area) == 0
    with pytest.raises(NoSwap, match="kept non-object"):
        remove_swaps([1, 5, 9], area, np.random.default_rng(0))


def test_swap_stages_keeps_sizes_and_nesting():
    rng = np.random.default_rng(1)
    for _ in range(200):
        cells = rng.permutation(36)
        sizes = sorted(rng.choice(np.arange(1, 30), size=3, replace=False), reverse=True)
        stages = [sorted(cells[:size].tolist()) for size in sizes] + [[]]
        deepest = set(stages[-2])
        count = int(rng.integers(1, min(len(deepest), 36 - len(deepest)) + 1))
        removed = tuple(int(i) for i in rng.choice(sorted(deepest), count, replace=False))
        added = tuple(int(i) for i in rng.choice(sorted(set(range(36)) - deepest), count, replace=False))
        swapped = swap_stages(stages, Swap(removed, added))
        assert [len(s) for s in swapped] == [len(s) for s in stages]
        assert all(set(later) <= set(earlier) for earlier, later in zip(swapped, swapped[1:]))
        assert set(swapped[-2]) == (deepest - set(removed)) | set(added)
        assert swapped[-1] == []
        for stage, before in zip(swapped[:-1], stages[:-1]):
            assert set(added) <= set(stage) and set(stage) - set(added) <= set(before)


def test_swap_stages_planned_on_an_earlier_stage_keeps_sizes_and_nesting():
    rng = np.random.default_rng(2)
    for _ in range(200):
        cells = rng.permutation(36)
        sizes = sorted(rng.choice(np.arange(1, 30), size=4, replace=False), reverse=True)
        stages = [sorted(cells[:size].tolist()) for size in sizes] + [[]]
        chosen = int(rng.integers(0, 4))
        kept = set(stages[chosen])
        count = int(rng.integers(1, min(len(kept), 36 - len(kept)) + 1))
        removed = tuple(int(i) for i in rng.choice(sorted(kept), count, replace=False))
        added = tuple(int(i) for i in rng.choice(sorted(set(range(36)) - kept), count, replace=False))
        swapped = swap_stages(stages, Swap(removed, added), chosen)
        assert [len(s) for s in swapped] == [len(s) for s in stages]
        assert all(set(later) <= set(earlier) for earlier, later in zip(swapped, swapped[1:]))
        assert set(swapped[chosen]) == (kept - set(removed)) | set(added)
        assert all(set(added) <= set(stage) for stage in swapped[: chosen + 1])
        for stage, before in zip(swapped[chosen + 1 :], stages[chosen + 1 :]):
            assert set(stage) - set(added) == set(before) - set(removed)
        assert swapped[-1] == []


def test_swap_stages_rejects_an_unbalanced_swap():
    with pytest.raises(ValueError, match="as many"):
        swap_stages([[0, 1, 2]], Swap((0, 1), (5,)))


# ----- the command on a tiny model -----------------------------------------------------


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    """Pruned runs over the first 36 questions: input-level random@4 and in-LLM pdrop@6 (stages 6, 2, 0)."""
    root = tmp_path_factory.mktemp("intervene_runs")
    made = {}
    for name, selector, budget in (("random", "random", "4"), ("pdrop", "pdrop", "6")):
        result = runner.invoke(
            app,
            base_args(
                workspace, root / name, "--selector", selector, "--budget", budget, "--limit", "36", "--seed", "2"
            ),
        )
        assert result.exit_code == 0, result.output
        made[name] = root / name
    return made


def intervene(run_dir, *options):
    return runner.invoke(app, ["intervene", str(run_dir), *options])


def frame(path):
    return pq.read_table(path).to_pandas()


def paired(out, run_dir):
    """Rows of both conditions beside the run's own record of each question."""
    swapped = frame(out / "records.parquet")
    original = frame(run_dir / "records.parquet").set_index(["split", "question_id"])
    pairs = []
    for (split, question_id), rows in swapped.groupby(["split", "question_id"], sort=False):
        by_condition = rows.set_index("condition")
        conditions = by_condition.loc["intervention"], by_condition.loc["control"]
        pairs.append((original.loc[(split, question_id)], *conditions))
    return pairs


def object_cells(workspace, record) -> np.ndarray:
    coco = CocoInstances.load(workspace["instances"])
    geometry = TokenGeometry(**json.loads(record["geometry"]))
    return object_area(coco.category_mask(int(record["image_id"]), record["object"]), geometry).area_per_token


def changes(before, after) -> tuple[set, set]:
    return set(before) - set(after), set(after) - set(before)


def test_restore_forces_the_largest_object_cells_against_free_cells(workspace, runs, tmp_path):
    out = tmp_path / "restore"
    result = intervene(runs["random"], "--mode", "restore", "--max-cells", "2", "--bootstrap", "50", "--out", str(out))
    assert result.exit_code == 0, result.output
    pairs = paired(out, runs["random"])
    lost = frame(runs["random"] / "records.parquet")["lost"]
    assert 0 < len(pairs) == int((lost == True).sum())  # noqa: E712 (nullable column)
    choosing = False
    for original, treated, control in pairs:
        area = object_cells(workspace, original)
        kept = set(original["kept"])
        objects = set(np.flatnonzero(area > 0).tolist())
        free = set(range(len(area))) - kept - objects
        removed, added = changes(kept, treated["kept"])
        count = min(2, len(objects), len(kept), len(free))
        by_area = sorted(objects, key=lambda cell: (-area[cell], cell))
        assert added == set(by_area[:count]) and len(removed) == count
        control_removed, control_added = changes(kept, control["kept"])
        assert control_removed == removed and control_added <= free and len(control_added) == count
        for row in (treated, control):
            assert len(row["kept"]) == len(kept) and row["visual_tokens_avg"] == original["visual_tokens_avg"]
            assert row["cells_changed"] == count
        assert treated["object_area_changed"] == area[list(added)].sum() > 0
        assert control["object_area_changed"] == 0 and control["lost"]
        assert treated["retention"] == pytest.approx(area[list(added)].sum() / original["object_area"])
        choosing |= len(objects) > count
    assert choosing, "no lost object had more cells than --max-cells"


def test_remove_swaps_object_cells_against_kept_non_object_cells(workspace, runs, tmp_path):
    out = tmp_path / "remove"
    result = intervene(runs["random"], "--mode", "remove", "--bootstrap", "50", "--out", str(out))
    assert result.exit_code == 0, result.output
    pairs = paired(out, runs["random"])
    assert pairs
    for original, treated, control in pairs:
        area = object_cells(workspace, original)
        kept = set(original["kept"])
        removed, added = changes(kept, treated["kept"])
        assert removed == {cell for cell in kept if area[cell] > 0} and len(added) == len(removed)
        assert not added & kept and all(area[cell] == 0 for cell in added)
        control_removed, control_added = changes(kept, control["kept"])
        assert control_added == added and len(control_removed) == len(removed)
        assert all(area[cell] == 0 for cell in control_removed)
        assert treated["lost"] and treated["object_area_changed"] == -area[list(removed)].sum()
        assert control["retention"] == pytest.approx(original["retention"])


@pytest.mark.parametrize("stage", ["last", "first"])
def test_in_llm_stages_stay_nested_with_their_sizes(workspace, runs, tmp_path, stage):
    out = tmp_path / "pdrop"
    result = intervene(runs["pdrop"], "--mode", "restore", "--bootstrap", "50", "--out", str(out), "--stage", stage)
    assert result.exit_code == 0, result.output
    schedule = json.loads((runs["pdrop"] / "manifest.json").read_text())["selector"]["schedule"]
    pairs = paired(out, runs["pdrop"])
    assert pairs
    grew = False
    for original, treated, control in pairs:
        before = [list(kept) for kept in original["kept_stages"]]
        chosen = 0 if stage == "first" else max(i for i, kept in enumerate(before) if kept)
        assert original["lost_stages"][chosen] is True and list(original["stage_layers"]) == [l for l, _ in schedule]
        for row in (treated, control):
            after = [list(kept) for kept in row["kept_stages"]]
            assert [len(s) for s in after] == [len(s) for s in before] == [keep for _, keep in schedule]
            assert all(set(later) <= set(earlier) for earlier, later in zip(after, after[1:]))
            removed, added = changes(set(before[chosen]), after[chosen])
            assert len(removed) == len(added) == row["cells_changed"] and added <= set(after[0])
            grew |= bool(added & set(before[0]))  # an added cell already alive before the chosen stage
        area = object_cells(workspace, original)
        assert all(area[cell] > 0 for cell in changes(set(before[chosen]), treated["kept_stages"][chosen])[1])
    assert grew or stage == "first", "no question exercised the rule for cells already kept at an earlier stage"
    assert json.loads((out / "intervention.json").read_text())["stage"].startswith(stage)


def test_report_numbers_come_from_the_records(runs, tmp_path):
    out = tmp_path / "report"
    result = intervene(
        runs["random"], "--mode", "restore", "--bootstrap", "300", "--seed", "5", "--out", str(out), "--json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert json.loads((out / "intervention.json").read_text()) == report
    assert report["threads"]["inter_op"] == 1 and report["threads"]["intra_op"] >= 1  # --threads default recorded
    rows = frame(out / "records.parquet")
    treated, control = (rows[rows["condition"] == name].reset_index(drop=True) for name in ("intervention", "control"))
    assert (treated[["split", "question_id"]] == control[["split", "question_id"]]).all().all()
    for name, part in (("intervention", treated), ("control", control)):
        assert report[name]["accuracy"]["value"] == pytest.approx(part["correct"].mean())
        assert report[name]["mean_confidence"]["value"] == pytest.approx(part["confidence"].mean())
        assert report[name]["mean_object_area_changed"] == pytest.approx(part["object_area_changed"].mean())
    original = frame(runs["random"] / "records.parquet").set_index(["split", "question_id"])
    recorded = original.loc[list(zip(treated["split"], treated["question_id"]))]
    assert report["recorded"]["accuracy"]["value"] == pytest.approx(recorded["correct"].mean())
    assert report["questions"]["intervened"] == len(treated)
    assert report["questions"]["images"] == treated["image_id"].nunique()
    # the paired interval, recomputed directly: images resampled, both conditions on the same draw
    images = np.unique(treated["image_id"])
    weights = image_counts(len(images), 300, 5)[:, np.searchsorted(images, treated["image_id"])]
    difference = (weights @ (treated["correct"].to_numpy(float) - control["correct"].to_numpy(float))) / weights.sum(1)
    plain_difference = treated["correct"].mean() - control["correct"].mean()
    assert report["difference"]["accuracy"]["value"] == pytest.approx(plain_difference)
    assert report["difference"]["accuracy"]["ci95"] == pytest.approx(list(np.percentile(difference, [2.5, 97.5])))


def test_seeded_and_deterministic(runs, tmp_path):
    def records(seed, name):
        result = intervene(
            runs["random"], "--mode", "restore", "--bootstrap", "20", "--seed", seed, "--out", str(tmp_path / name)
        )
        assert result.exit_code == 0, result.output
        return frame(tmp_path / name / "records.parquet").drop(columns=list(TIMING_COLUMNS))

    first, again, other = records("1", "a"), records("1", "b"), records("2", "c")
    pd.testing.assert_frame_equal(first, again)
    assert [list(k) for k in first["kept"]] != [list(k) for k in other["kept"]]


def test_default_output_directory(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "copy"
    shutil.copytree(runs["random"], run_dir)
    before = sorted(p.name for p in run_dir.iterdir())
    result = intervene(run_dir, "--mode", "remove", "--bootstrap", "10")
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in (tmp_path / "intervene" / "copy-remove").iterdir() if not p.name.startswith("."))
    assert written == ["intervention.json", "records.parquet"]
    assert sorted(p.name for p in run_dir.iterdir()) == before  # never inside the run directory


# ----- errors: one line, exit code 2, nothing written ----------------------------------


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        ((), ("--mode", "restore or remove")),
        (("--mode", "delete"), ("--mode", "'delete'")),
        (("--mode", "restore", "--controls", "shuffled"), ("--controls",)),
        (("--mode", "restore", "--max-cells", "0"), ("--max-cells",)),
        (("--mode", "remove", "--bootstrap", "0"), ("--bootstrap",)),
    ],
)
def test_bad_options(runs, tmp_path, options, needles):
    out = tmp_path / "out"
    assert_one_line_failure(intervene(runs["random"], *options, "--out", str(out)), out, *needles)


def test_runs_that_cannot_be_intervened_on(workspace, tmp_path):
    def make(name, *extra):
        result = runner.invoke(app, base_args(workspace, tmp_path / name, "--limit", "6", *extra))
        assert result.exit_code == 0, result.output
        return tmp_path / name

    out = tmp_path / "out"
    dense = make("dense")
    assert_one_line_failure(intervene(dense, "--mode", "remove", "--out", str(out)), out, "unpruned")
    everything = make("everything", "--selector", "uniform", "--budget", "16")
    assert_one_line_failure(intervene(everything, "--mode", "restore", "--out", str(out)), out, "no eligible questions")
    merged = make("merged", "--selector", "visionzip", "--budget", "6")
    assert_one_line_failure(intervene(merged, "--mode", "remove", "--out", str(out)), out, "merged tokens")
    missing = tmp_path / "missing"
    assert_one_line_failure(intervene(missing, "--mode", "restore", "--out", str(out)), out, "missing")


def test_run_without_annotations(workspace, tmp_path):
    args = base_args(workspace, tmp_path / "bare", "--limit", "6", "--selector", "random", "--budget", "4")
    position = args.index("--annotations")
    del args[position : position + 2]
    assert runner.invoke(app, args).exit_code == 0
    out = tmp_path / "out"
    assert_one_line_failure(intervene(tmp_path / "bare", "--mode", "restore", "--out", str(out)), out, "annotations")
