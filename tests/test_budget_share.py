"""Budgets as a share of each image's visual tokens: ``run --budget 11%`` and ``study --budgets 11%,22%``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.compute.budget import budget_share, parse_budget, resolve_budget, tokens_for_share
from prune_audit.errors import PruneAuditError
from prune_audit.runner.answering import answer_grouped

runner = CliRunner()


def test_shares_parse_and_round_per_image():
    assert parse_budget("11%") == "11%" and parse_budget("64") == 64 and parse_budget("all") == "all"
    assert budget_share("11%") == pytest.approx(0.11) and budget_share(64) is None
    assert tokens_for_share(0.11, 576) == 63 and tokens_for_share(0.11, 144) == 16 and tokens_for_share(0.01, 20) == 1
    assert tokens_for_share(0.5, 15) == 8  # half up
    assert resolve_budget("22%", 1000) == 220
    for bad in ("0%", "101%", "x%", "-5%"):
        with pytest.raises(PruneAuditError, match="share"):
            parse_budget(bad)


def test_each_question_gets_its_own_images_share():
    calls = []

    def answer(prepared, selector, budget, mode, generator, forced_kept, forced_stages):
        calls.append((budget, [item.num_visual for item in prepared], list(generator)))
        return [(item.num_visual, budget) for item in prepared]

    vlm = SimpleNamespace(answer=answer)
    prepared = [SimpleNamespace(num_visual=n, budget_tokens=n) for n in (400, 100, 400, 64)]
    answers = answer_grouped(vlm, "s", "25%", prepared, ["yes/no"] * 4, ["g0", "g1", "g2", "g3"])
    assert answers == [(400, 100), (100, 25), (400, 100), (64, 16)]  # in question order
    assert sorted(calls) == [(16, [64], ["g3"]), (25, [100], ["g1"]), (100, [400, 400], ["g0", "g2"])]


def test_run_records_the_realised_count(workspace, tmp_path):
    out = tmp_path / "share"
    arguments = [
        "run",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--annotations",
        str(workspace["instances"]),
        "--selector",
        "divprune",
        "--budget",
        "50%",
        "--limit",
        "12",
        "--out",
        str(out),
        "--quiet",
    ]
    for path in workspace["pope"]:
        arguments += ["--pope", str(path)]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["budget"] == "50%"
    records = pq.read_table(out / "records.parquet")
    assert set(records["visual_tokens_avg"].to_pylist()) == {8.0}  # half of the tiny model's 16 tokens
    assert all(len(kept) == 8 for kept in records["kept"].to_pylist())


def test_study_plans_share_budgets(tmp_path):
    result = runner.invoke(
        app, ["study", "--selectors", "divprune", "--budgets", "11%,22%", "--plan", "--out", str(tmp_path / "s")]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "--budget 11% --out " + str(Path(tmp_path / "s" / "runs" / "divprune-11pct")) in lines[1]
    assert lines[2].endswith("divprune-22pct")
