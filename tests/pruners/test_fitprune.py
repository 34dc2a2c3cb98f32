"""FitPrune: the in-LLM deletion and the schedule fit against independent re-derivations of the official code
(ywh187/FitPrune, LLaVA_1.5 modeling_llama.py at 36bb1160 and eval/statistical_analysis.py at 2b70a5d8), a
hand-checked fit, the schedule files and the ``prune-audit fitprune fit`` command.

Kept to pytest and prune_audit imports (no tests/ helpers), so it runs from this subfolder.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners.base import Stage
from prune_audit.pruners.fitprune import (
    AttentionStatistics,
    FittedSchedule,
    FittedSchedules,
    deletion_count,
    fit_for_alpha,
    fit_schedule,
    schedules_json,
)
from prune_audit.pruners.registry import get_selector
from prune_audit.pruners.schedule import average_visual_tokens
from prune_audit.pruners.signals import LayerSignals

SYS = 35  # LLaVA-1.5's vicuna_v1 system prompt before the image, as the official code hard-codes it


def official_attention(heads: int, n: int, text: int, generator: torch.Generator) -> torch.Tensor:
    """(H, S, S) causal softmax of random logits over a LLaVA-1.5 layout: system prompt, n image tokens, text."""
    size = SYS + n + text
    logits = torch.randn(heads, size, size, generator=generator) * 2
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def official_deleted(attention: torch.Tensor, n: int, delete: int) -> set[int]:
    """The official LlamaAttention.forward deletion: head max, self x cross, the ``delete`` smallest."""
    headmax = attention.max(dim=0).values
    self_part = (headmax[SYS : SYS + n, SYS : SYS + n] / n).sum(dim=0)
    cross_part = headmax[SYS + n :, SYS : SYS + n].sum(dim=0)
    return set(torch.sort(cross_part * self_part, dim=-1, stable=True).indices[:delete].tolist())


@pytest.mark.parametrize("seed", range(10))
def test_scores_reproduce_the_official_deletion(seed):
    """30 random cases at LLaVA-1.5 shapes (32 heads, 576 tokens, 40 text rows), keeping 64 / 128 / 192."""
    n, generator = 576, torch.Generator().manual_seed(seed)
    attention = official_attention(32, n, 40, generator)
    signals = LayerSignals(
        alive=torch.arange(n), grid=(24, 24), layer=3, num_layers=32,
        text_probs=attention[:, SYS + n :, SYS : SYS + n], visual_probs=attention[:, SYS : SYS + n, SYS : SYS + n],
    )  # fmt: skip
    selector = get_selector("fitprune")
    for keep in (64, 128, 192):
        kept = selector.prune(Stage(3, keep), signals, {})
        assert set(range(n)) - set(kept.tolist()) == official_deleted(attention, n, n - keep)


# ----- the fit ---------------------------------------------------------------------------------------------


def official_count(values: torch.Tensor, full_sum: float, alpha: float) -> int:
    """The official loop over i, written as it is (no break: the loop's natural end, n - 1)."""
    order = torch.argsort(values, stable=True)
    total = values.sum()
    for i in range(len(order)):
        if (total - values[order[:i]].sum()) < (full_sum - full_sum * alpha):
            return max(i - 1, 0)
    return len(order) - 1


def official_fit_model(statistics, budget: float, alpha: float) -> tuple[bool, list[int]]:
    """The official fit_model with its FLOP forecast replaced by the layer-average token count."""
    layers, n = statistics[0].cross.shape[0] + 1, statistics[0].cross.shape[1]
    left = {i: list(range(n)) for i in range(len(statistics))}
    used = dict.fromkeys(left, 0)
    scheme = [0] * layers
    for layer in range(layers):
        forecast = sum(used[i] + len(left[i]) * (layers - layer) for i in left) / len(left)
        if forecast <= budget * layers:
            return True, [s // len(left) for s in scheme]
        if layer == layers - 1:
            break
        for i, stats in enumerate(statistics):
            used[i] += len(left[i])
            alive = torch.tensor(left[i])
            cross = stats.cross[layer][alive]
            own = (stats.visual[layer][alive][:, alive] / len(alive)).sum(dim=0)
            w_cross, w_self = float(stats.cross[layer].sum()), float(stats.visual[layer].sum()) / n
            del_cross = torch.argsort(cross, stable=True)[: official_count(cross, w_cross, alpha)]
            del_self = torch.argsort(own, stable=True)[: official_count(own, w_self, alpha)]
            both, counts = torch.cat([del_cross, del_self]).unique(return_counts=True)
            gone = set(both[counts > 1].tolist())
            scheme[layer] += len(gone)
            left[i] = [token for position, token in enumerate(left[i]) if position not in gone]
    return False, [s // len(left) for s in scheme]


def random_statistics(seed: int, samples: int = 3, layers: int = 6, n: int = 48) -> list[AttentionStatistics]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(samples):
        visual = torch.rand(layers - 1, n, n, generator=generator).tril()
        visual = visual / visual.sum(dim=-1, keepdim=True)
        cross = torch.rand(layers - 1, n, generator=generator) ** 3 / 10
        out.append(AttentionStatistics(cross, visual))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [8, 16, 30])
def test_fit_reproduces_the_official_search(seed, budget):
    statistics = random_statistics(seed)
    low, high, expected = 0.0, 1.0, None
    while high - low > 0.01 + 1e-6:  # the official binary search, written out
        middle = (low + high) / 2
        reached, expected = official_fit_model(statistics, budget, middle)
        assert fit_for_alpha(statistics, budget, middle) == (reached, expected)
        low, high = (low, middle) if reached else (middle, high)
    fit = fit_schedule(statistics, budget)
    assert list(fit.removed) == expected and fit.alpha == middle


def test_deletion_count_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # target 10 x 0.65 = 6.5; remainders 10, 9, 7, 4: the first below is i = 3, so 2 go (7 stays >= 6.5)
    assert deletion_count(values, 10.0, 0.35) == 2
    assert deletion_count(values, 10.0, 0.0) == 0  # nothing may be lost: remainder 9 < 10 at i = 1
    assert deletion_count(values, 10.0, 0.99) == 3  # target 0.1: no remainder falls below it before i = n


def test_fit_by_hand():
    """3 layers, 4 tokens, one question: both deletion sets at layer 0 are tokens {0, 1} (see the comments), then
    the forecast (4 + 2 x 2) / 3 = 2.67 tokens meets the budget of 3 at layer 1."""
    cross = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25] * 4])  # layer 0 target 0.65: remainders 1, .9, .7, .4
    visual = torch.stack([torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.eye(4)])
    # self = diag / 4 = .25, .5, .75, 1; full 10 / 4 = 2.5, target 1.625: remainders 2.5, 2.25, 1.75, 1.0
    statistics = [AttentionStatistics(cross, visual)]
    assert fit_for_alpha(statistics, 3, 0.35) == (True, [2, 0, 0])
    assert FittedSchedule("hand", (2, 0, 0)).stages(4) == [Stage(1, 2)]
    assert FittedSchedule("hand", (2, 0, 0)).average(4) == pytest.approx(8 / 3)


def test_fit_refuses_bad_statistics_and_budgets():
    statistics = random_statistics(0)
    with pytest.raises(ValueError, match="no attention statistics"):
        fit_schedule([], 8)
    with pytest.raises(ValueError, match="different model shapes"):
        fit_schedule([*statistics, *random_statistics(1, n=40)], 8)
    with pytest.raises(ValueError, match="between 0 and the 48"):
        fit_schedule(statistics, 48)


# ----- schedules -------------------------------------------------------------------------------------------


def test_paper_rule_runs_the_official_tables():
    """The shipped LLaVA-1.5-7B tables: 90 % FLOP reduction removes 262 / 153 / 80 after layers 0 / 1 / 2."""
    stages = get_selector("fitprune", budget_rule="paper").schedule(32, 576, 73)
    assert stages[:3] == [Stage(1, 314), Stage(2, 161), Stage(3, 81)]
    assert round(average_visual_tokens(stages, 32, 576)) == 73
    with pytest.raises(ValueError, match=r"73 \(FLOP reduction 90%\).* use budget_rule='average'"):
        get_selector("fitprune", budget_rule="paper").schedule(32, 576, 64)


def write_schedules(path, layers: int = 6, visual: int = 48) -> str:
    fitted = FittedSchedules(layers, visual, (FittedSchedule("budget 20", (20, 8, 0, 0, 0, 0), 0.5),), {"by": "test"})
    path.write_text(schedules_json(fitted))
    return str(path)


def test_a_schedule_file_is_run_as_fitted_and_refused_on_another_shape(tmp_path):
    path = write_schedules(tmp_path / "s.json")
    selector = get_selector("fitprune", budget_rule="paper", schedule_file=path)
    assert selector.schedule(6, 48, 26) == [Stage(1, 28), Stage(2, 20)]  # average (48 + 28 + 4 x 20) / 6 = 26
    with pytest.raises(ValueError, match="fitted on 6 layers x 48 tokens, not 12 x 144"):
        selector.schedule(12, 144, 26)
    average = get_selector("fitprune", schedule_file=path).schedule(12, 144, 40)
    assert average_visual_tokens(average, 12, 144) == pytest.approx(40, rel=0.02)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[]", "'format' is not"),
        ('{"format": "prune-audit fitprune schedule", "version": 9}', "version 9"),
        (
            '{"format": "prune-audit fitprune schedule", "version": 1, "num_layers": 2, "num_visual": 4, '
            '"schedules": [{"removed": [5, 0]}]}',
            "summing to at most 4",
        ),  # fmt: skip
    ],
)
def test_malformed_schedule_files_are_refused_in_one_line(tmp_path, text, problem):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        get_selector("fitprune", budget_rule="paper", schedule_file=str(path)).schedule(2, 4, 2)


def test_a_missing_schedule_file_is_refused_when_the_selector_is_made(tmp_path):
    with pytest.raises(ValueError, match="schedule file not found: .*pass a file written by prune-audit fitprune fit"):
        get_selector("fitprune", schedule_file=str(tmp_path / "none.json"))


# ----- the command -----------------------------------------------------------------------------------------


def test_fit_command_writes_a_schedule_the_selector_runs(tmp_path):
    out = tmp_path / "schedule.json"
    result = CliRunner().invoke(
        app, ["fitprune", "fit", "--model", "demo", "--limit", "2", "--budget", "64", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert (document["num_layers"], document["num_visual"]) == (12, 144)
    assert document["provenance"]["questions"] == 2 and "64" in document["provenance"]["budgets"]
    budget = round(document["schedules"][0]["average"])
    selector = get_selector("fitprune", budget_rule="paper", schedule_file=str(out))
    assert average_visual_tokens(selector.schedule(12, 144, budget), 12, 144) == pytest.approx(budget, abs=0.5)
    again = CliRunner().invoke(
        app, ["fitprune", "fit", "--model", "demo", "--limit", "2", "--budget", "64", "--out", str(out)]
    )
    assert again.exit_code == 2 and "exists; pass a new file name" in again.output
    assert json.loads(out.read_text()) == document  # untouched


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--budget", "144"], "keeps all 144 visual tokens"),
        (["--budget", "64", "--budget", "64"], "each budget once"),
        (["--budget", "0"], "positive integer"),
    ],
)
def test_fit_command_refusals_write_nothing(tmp_path, arguments, message):
    out = tmp_path / "schedule.json"
    result = CliRunner().invoke(
        app, ["fitprune", "fit", "--model", "demo", "--limit", "1", "--out", str(out), *arguments]
    )
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_fit_command_refuses_an_out_without_json_suffix_or_folder(tmp_path):
    for out, message in ((tmp_path / "s.txt", "must end in .json"), (tmp_path / "no" / "s.json", "does not exist")):
        result = CliRunner().invoke(app, ["fitprune", "fit", "--budget", "64", "--out", str(out)])
        assert result.exit_code == 2 and message in result.output


def test_statistics_are_the_eager_attention_of_the_unpruned_prompt():
    """The statistics the command collects (through the visual_probs and text_probs probes) against the stock
    eager forward's attention maps of the demo, as the official compute_attention_weights reads them."""
    import numpy as np
    from PIL import Image

    from prune_audit.api import load
    from prune_audit.models.attention_statistics import attention_statistics

    vlm = load("demo", device="cpu")
    pixels = np.random.default_rng(0).integers(0, 256, size=(96, 96, 3), dtype=np.uint8)
    item = vlm.prepare(Image.fromarray(pixels), "is there a red circle in the image?")
    with torch.inference_mode():
        statistics = attention_statistics(vlm, item)
        vlm.model.set_attn_implementation("eager")
        output = vlm.model(input_ids=item.input_ids[None], pixel_values=item.pixel_values[None], output_attentions=True)
    start, end = item.image_span
    assert statistics.cross.shape == (len(output.attentions) - 1, item.num_visual)
    for layer, attention in enumerate(output.attentions[:-1]):
        headmax = attention[0].float().max(dim=0).values
        text_rows = headmax.shape[0] - end
        torch.testing.assert_close(statistics.cross[layer], headmax[end:, start:end].sum(dim=0) / text_rows)
        torch.testing.assert_close(statistics.visual[layer], headmax[start:end, start:end])
