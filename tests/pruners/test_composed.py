"""Issue 41 item 2: composed selectors, an input-level selector then an in-LLM selector (``visionzip+fastv``).

The spelling and its refusals; one run on the bundled demo (144 visual tokens) through the CLI, whose per-stage
records hold VisionZip's own kept set at layer 0 and FastV's, a subset, at its layer; the FLOPs of both parts
against a hand computation and against ``FlopCounterMode``; the Python API under the same spelling.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from cli_checks import refused, snapshot
from tiny_models import random_image
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.compute.budget import check_budget_parts, parse_budget, resolve_budget
from prune_audit.compute.flops import decoder_probe, language_prefill
from prune_audit.demo.assets import DEMO_MODELS
from prune_audit.demo.evaluate import load_demo
from prune_audit.errors import PruneAuditError
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import InputSelector, LayerSelector
from prune_audit.pruners.composed import ComposedSelector, parse_selector, part_count
from prune_audit.pruners.registry import get_selector, selector_class

runner = CliRunner()
COMPOSED = "visionzip+fastv"
QUESTION = "is there a red dog in the image?"


# ----- spelling -----------------------------------------------------------------------


def test_the_spelling_names_an_input_part_then_an_in_llm_part_each_from_the_registry():
    composed = parse_selector(COMPOSED, ["fastv.budget_rule=paper", "visionzip.contextual_fraction=0.25"])
    assert isinstance(composed, ComposedSelector) and composed.name == COMPOSED and part_count(composed) == 2
    assert isinstance(composed.input, InputSelector) and isinstance(composed.llm, LayerSelector)
    assert type(composed.input) is selector_class("visionzip") and type(composed.llm) is selector_class("fastv")
    assert composed.llm.budget_rule == "paper" and composed.input.contextual_fraction == 0.25
    assert composed.options()["fastv.budget_rule"] == "paper"
    assert parse_selector("fastv", []) == get_selector("fastv")  # a registered name stays itself


@pytest.mark.parametrize(
    ("name", "options", "needle"),
    [
        ("visionzip+nosuch", [], "'nosuch'"),
        ("visionzip+divprune", [], "both parts of 'visionzip+divprune' prune at the input"),
        ("fastv+pdrop", [], "prune inside the LLM"),
        ("fastv+visionzip", [], "the input-level part runs first: visionzip+fastv"),
        ("visionzip+fastv+pdrop", [], "names two parts"),
        ("visionzip+", [], "names two parts"),
        (COMPOSED, ["budget_rule=paper"], "fastv.KEY=VALUE"),
        (COMPOSED, ["pdrop.layer=2"], "names its part"),
        (COMPOSED, ["fastv.nosuch=1"], "nosuch"),
        (COMPOSED, ["visionzip.contextual_fraction=2"], "contextual_fraction"),
    ],
)
def test_a_bad_composition_is_refused_in_one_line(name, options, needle):
    with pytest.raises(PruneAuditError) as error:
        parse_selector(name, options)
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_budgets_are_one_per_part_each_below_the_one_before():
    assert parse_budget("128,64") == (128, 64) and parse_budget("11%,5%") == ("11%", "5%")
    assert parse_budget("all,64") == ("all", 64)
    for good in [(128, 64), ("11%", "5%"), ("all", 64), ("all", "5%")]:
        check_budget_parts(good, 2, COMPOSED)
    bad = {
        (64,): "gives 1 budget",
        (64, 128): "128 is not below 64",
        (64, 64): "64 is not below 64",
        ("5%", "11%"): "11% is not below 5%",
        (128, "all"): "give a smaller count",
        (128, "5%"): "give a smaller count",
    }
    for budget, needle in bad.items():
        with pytest.raises(PruneAuditError, match=needle):
            check_budget_parts(budget[0] if len(budget) == 1 else budget, 2, COMPOSED)
    with pytest.raises(PruneAuditError, match="gives 2 budget"):
        check_budget_parts((128, 64), 1, "fastv")
    with pytest.raises(PruneAuditError, match="one budget per part"):
        parse_budget("128,")
    assert resolve_budget(("11%", "5%"), 144) == (16, 7) and resolve_budget(("all", 48), 144) == (144, 48)


# ----- a run on the bundled demo ------------------------------------------------------------


def _run(out, selector, budget, *extra):
    args = ["run", "--selector", selector, "--budget", budget, "--limit", "4", "--out", str(out), *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    return pq.read_table(out / "records.parquet").to_pandas().sort_values("order"), manifest


def test_a_composed_run_records_each_stage_in_original_indices(tmp_path):
    composed, manifest = _run(tmp_path / "composed", COMPOSED, "96,48", "--option", "fastv.budget_rule=paper")
    alone, _ = _run(tmp_path / "visionzip", "visionzip", "96")
    selector = manifest["selector"]
    assert selector["name"] == COMPOSED and selector["stage"] == "composed" and manifest["budget"] == [96, 48]
    assert [(part["name"], part["budget"]) for part in selector["parts"]] == [("visionzip", 96), ("fastv", 48)]
    assert selector["options"]["fastv.budget_rule"] == "paper" and selector["schedule_num_visual"] == 96
    [[layer, keep]] = selector["schedule"]
    assert keep == 48 and selector["parts"][1]["schedule"] == [[layer, keep]]
    layers = manifest["num_layers"]
    for row, own in zip(composed.itertuples(), alone.itertuples()):
        assert list(row.stage_layers) == [0, layer]
        first, second = [list(k) for k in row.kept_stages], [[list(m) for m in s] for s in row.merged_stages]
        assert first[0] == list(own.kept_stages[0])  # stage 1 is VisionZip's own selection on that image
        assert second[0] == [list(m) for m in own.merged_stages[0]]
        assert set(first[1]) <= set(first[0])  # FastV keeps a subset, in grid indices
        assert all(merged in second[0] for merged in second[1] if merged)  # and of VisionZip's merged tokens
        assert len(first[1]) + len(second[1]) == 48  # an alive CLS is an empty merged entry
        assert row.visual_tokens_avg == pytest.approx((layer * 96 + (layers - layer) * 48) / layers)
        assert not row.retention_stages[1] > row.retention_stages[0]  # a subset keeps no more (NaN without a mask)
        assert row.flops == row.flops_vision + row.flops_selector + row.flops_llm
        assert row.flops_vision == own.flops_vision  # VisionZip's signals and re-projection, once
        assert row.flops_llm < own.flops_llm and row.flops_selector >= own.flops_selector  # FastV: a top-k


@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        (["--selector", COMPOSED, "--budget", "96"], "gives 1 budget"),
        (["--selector", COMPOSED, "--budget", "48,96"], "96 is not below 48"),
        (["--selector", "fastv", "--budget", "96,48"], "gives 2 budget"),
        (["--selector", "fastv+visionzip", "--budget", "96,48"], "runs first"),
        (["--selector", COMPOSED, "--budget", "96,48", "--option", "budget_rule=paper"], "names its part"),
    ],
)
def test_the_cli_refuses_a_bad_composition_in_one_line_and_writes_nothing(tmp_path, arguments, needle):
    out = tmp_path / "run"
    before = snapshot(tmp_path)
    result = runner.invoke(app, ["run", *arguments, "--limit", "2", "--out", str(out)])
    refused(result, needle)
    assert not out.exists() and snapshot(tmp_path) == before


# ----- FLOPs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    vlm = load_demo(DEMO_MODELS["demo"])
    vlm.model.set_attn_implementation("eager")  # the counter sees attention products only when eager
    return vlm


def _answer(vlm, item, selector, budget):
    return vlm.answer([item], selector, budget, generator=torch.Generator().manual_seed(0))[0]


def test_composed_flops_are_visionzip_then_fastv_on_the_reduced_count(demo):
    item = demo.prepare(random_image(3, (96, 96)), QUESTION)
    composed = parse_selector(COMPOSED, [])
    answer, alone = _answer(demo, item, composed, (96, 48)), _answer(demo, item, get_selector("visionzip"), 96)
    [stage] = demo.schedule(composed.llm, 96, 48)  # FastV's schedule solved on the 96 tokens VisionZip feeds
    layers = demo.num_layers
    assert answer.tokens_per_layer == [96] * stage.layer + [stage.keep] * (layers - stage.layer)
    text, after = item.input_ids.numel() - item.num_visual, item.input_ids.numel() - item.image_span[1]
    language = demo.shape.language
    probe = decoder_probe(language, after, text + 96, attention_rows=True, key_norms=False)  # at layer K-1
    assert answer.cost.flops_llm == language_prefill(language, [text + n for n in answer.tokens_per_layer]) + probe
    assert answer.cost.flops_vision == alone.cost.flops_vision
    work = SelectorWork(
        tokens=96, kept=48, feature_width=language.hidden, vision_width=demo.shape.vision.width,
        key_width=demo.vision_head_dim, hidden=language.hidden, text_rows=after, stages=((96, stage.keep),),
        options=composed.llm.options(),
    )  # fmt: skip
    assert answer.cost.flops_selector == alone.cost.flops_selector + composed.llm.flops(work)


def test_composed_flops_equal_the_counted_flops(demo):
    item = demo.prepare(random_image(4, (96, 96)), QUESTION)
    composed = parse_selector(COMPOSED, [])
    inside = []
    for part, name in [(composed.input, "select"), (composed.llm, "prune"), (composed.llm, "merge")]:
        method = getattr(part, name)

        def counting(*args, _method=method, **kwargs):
            with FlopCounterMode(display=False) as counter:
                result = _method(*args, **kwargs)
            inside.append(counter.get_total_flops())
            return result

        object.__setattr__(part, name, counting)
    with FlopCounterMode(display=False) as counter:
        answer = _answer(demo, item, composed, (96, 48))
    cost = answer.cost
    assert counter.get_total_flops() - sum(inside) == cost.flops_vision + cost.flops_llm
    if composed.input.flops_exact and composed.llm.flops_exact:
        assert sum(inside) == cost.flops_selector


# ----- Python API -----------------------------------------------------------------------------


def test_the_python_api_takes_the_composed_spelling(demo):
    from prune_audit.api import pruned

    with pruned(demo, COMPOSED, "96,48", **{"fastv.budget_rule": "paper"}) as model:
        result = model.answer(random_image(5, (96, 96)), QUESTION)
    assert result.stage_layers[0] == 0 and len(result.stage_layers) == 2
    assert set(result.kept_stages[1]) <= set(result.kept_stages[0])
    with pruned(demo, COMPOSED, (96, 48)) as model:
        assert len(model.answer(random_image(5, (96, 96)), QUESTION).kept_stages) == 2
    with pytest.raises(PruneAuditError, match="gives 1 budget"):
        with pruned(demo, COMPOSED, 96):
            pass


@pytest.mark.parametrize(("model", "name"), [("demo", "divprune+pdrop"), ("demo-qwen", "divprune+fastv")])
def test_every_in_llm_stage_prunes_the_input_parts_tokens(model, name):
    """A non-merging input part, a several-stage in-LLM part, and Qwen's original M-RoPE positions."""
    vlm = load_demo(DEMO_MODELS[model])
    item = vlm.prepare(random_image(6, (96, 96)), QUESTION)
    composed = parse_selector(name, [])
    answer = _answer(vlm, item, composed, (64, 24))
    fed = min(64, item.num_visual)
    assert answer.stage_layers[0] == 0 and len(answer.kept_stages) == 1 + len(vlm.schedule(composed.llm, fed, 24))
    assert len(answer.kept_stages[0]) == fed and answer.tokens_per_layer[0] == fed
    for earlier, later in zip(answer.kept_stages, answer.kept_stages[1:]):
        assert set(later) <= set(earlier)
    kept = [len(stage) for stage in answer.kept_stages[1:]]
    assert kept == [stage.keep for stage in vlm.schedule(composed.llm, fed, 24)]
