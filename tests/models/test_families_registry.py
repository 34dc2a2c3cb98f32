"""Every registered model family, the same checks (as timm tests every registered model).

Each family builds its own tiny random-weight checkpoint offline (``build_tiny``). For
each: keep-all equals the stock transformers forward (logits) and stock greedy
generation; the decoder probe equals eager attention; dropping tokens equals the stock
forward with them masked; every selector runs at the full budget or is refused in one
line (the class-level ``selector_support`` and ``selectors --model FAMILY`` say the same); a batch of two
image sizes equals each prompt alone; forced kept sets and stages are honoured; the yes/no reduction and
``describe`` hold; ``prune-audit run`` records every supported selector, shards merge to one
process's records, a rerun resumes, ``visualize`` (live and ``--run``; one picture per token grid on
LLaVA-NeXT and LLaVA-OneVision) and ``intervene`` run; the token
geometry maps every visual token to its pixels, on synthetic images and on a real COCO
image's object masks; docs/models.md's selector table says what runs. The registry itself
(registration order, one-line refusals of other model types and bad options) is checked here too. What only one
family has is in tests/models/test_<family>.py (test_llava.py, test_qwen2_5_vl.py, test_internvl.py,
test_qwen3_vl.py, test_llava_next.py, test_llava_onevision.py); what the several-grid families share is in
tests/models/test_multi_grid_families.py.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from tiny_models import (
    QUESTIONS,
    WORDS,
    RecordingLayerSelector,
    assert_batch_equals_one_at_a_time,
    masked_reference_logits,
    random_image,
    run_args,
    stock_inputs,
    visual_columns,
)
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import mask_area_per_token, token_footprints, token_index_map
from prune_audit.data.multigrid import grid_pieces
from prune_audit.data.scenes import CATEGORIES
from prune_audit.errors import PruneAuditError
from prune_audit.models import families, family_names, load_vlm, register_family
from prune_audit.models.families import adapter_for
from prune_audit.models.llava import LlavaModel
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector, list_selectors
from prune_audit.records.schema import TIMING_COLUMNS

TOL = 1e-5
NUM_LAYERS = 4
SIZES = [(130, 100), (100, 130)]  # landscape and portrait: non-square grids where the family allows them

runner = CliRunner()


@pytest.fixture(scope="module", params=family_names())
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    words = [*WORDS, "Is", *CATEGORIES]
    return adapter_for(family, "test").build_tiny(
        tmp_path_factory.mktemp(family) / "model", words=words, text_layers=NUM_LAYERS, seed=3
    )


@pytest.fixture(scope="module")
def vlm(checkpoint):
    return load_vlm(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def prepared(vlm):
    return [vlm.prepare(random_image(seed, size), q) for seed, (size, q) in enumerate(zip(SIZES, QUESTIONS))]


@pytest.mark.parametrize("name", [None, "divprune", "fastv", "e2s"])
def test_batch_with_different_grids_equals_one_at_a_time(vlm, prepared, name):
    """Two prompts of different image sizes in one batch (padding, per-row positions) answer as alone."""
    selector = None if name is None else get_selector(name)
    if name is not None and name not in vlm.supported_selectors():
        pytest.skip(f"{name} does not run on {vlm.family}")
    budget = None if name is None else min(item.num_visual for item in prepared) // 2
    assert_batch_equals_one_at_a_time(vlm, prepared, selector, budget)


def test_forced_kept_sets_and_stages_are_honoured(vlm, prepared):
    item = prepared[0]
    n = item.num_visual
    kept = [n - 1, 1, 5, 0]
    [answer] = vlm.answer([item], forced_kept=[kept])
    assert answer.kept == sorted(kept) and answer.kept_stages == [sorted(kept)]
    assert answer.tokens_per_layer == [len(kept)] * NUM_LAYERS
    stages = [(1, list(range(0, n, 2))), (3, [0, 4])]
    [answer] = vlm.answer([item], forced_stages=[stages])
    assert answer.kept_stages == [stages[0][1], stages[1][1]] and answer.stage_layers == [1, 3]
    assert answer.tokens_per_layer == [n, len(stages[0][1]), len(stages[0][1]), 2]


def test_yes_no_reduction_is_consistent(vlm, prepared):
    [answer] = vlm.answer([prepared[0]])
    probs = torch.softmax(vlm.prefill([prepared[0]])[0].logits[0].double(), dim=-1)
    assert answer.p_yes == pytest.approx(float(probs[vlm.yes_ids].sum()))
    assert answer.p_yes_2way == pytest.approx(answer.p_yes / (answer.p_yes + answer.p_no))
    assert answer.logit_diff == pytest.approx(float(torch.log(probs[vlm.yes_ids].sum() / probs[vlm.no_ids].sum())))
    assert sorted(vlm.tokenizer.convert_ids_to_tokens(vlm.yes_ids + vlm.no_ids)) == ["No", "Yes", "no", "yes"]


def test_describe_names_what_a_manifest_needs(family, vlm):
    description = vlm.describe()
    assert description["family"] == family and description["attn_implementation"] == "sdpa"
    assert description["dtype"] == "float32" and description["device"] == "cpu"
    assert description["num_layers"] == NUM_LAYERS and len(description["model"]["config_hash"]) == 16
    assert description["processor"]["mode"]


# ----- the registry itself -------------------------------------------------------------------------------


def test_registered_families_in_registration_order():
    assert family_names() == [
        "llava",
        "qwen2_5_vl",
        "qwen2_vl",
        "internvl",
        "qwen3_vl",
        "llava_next",
        "llava_onevision",
    ]
    assert families.adapter_for("llava", "x") is LlavaModel
    assert families.adapter_for("qwen2_5_vl", "x") is QwenModel


def test_an_unregistered_model_type_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(PruneAuditError) as error:
        load_vlm(tmp_path, device="cpu")
    assert (
        str(error.value)
        == f"{tmp_path} is a 'bert' model; supported families: llava, qwen2_5_vl, qwen2_vl, internvl, qwen3_vl, llava_next, llava_onevision"
    )


def test_a_model_type_cannot_be_served_by_two_adapters():
    register_family("llava", LlavaModel)  # the same registration again is harmless
    with pytest.raises(ValueError, match="already served by LlavaModel"):
        register_family("llava", QwenModel)


def test_load_vlm_uses_the_registered_adapter(tmp_path, monkeypatch):
    class CustomLlava(LlavaModel):
        pass

    path = LlavaModel.build_tiny(tmp_path / "llava", words=WORDS, text_layers=2, seed=1)
    monkeypatch.setitem(families._ADAPTERS, "llava", CustomLlava)
    assert type(load_vlm(path, device="cpu")) is CustomLlava


@pytest.mark.parametrize(
    ("adapter", "template", "clip_text", "message"),
    [
        (LlavaModel, "chatml", None, "unknown LLaVA prompt template 'chatml'; choose llava_hf or vicuna_v1"),
        (QwenModel, "vicuna_v1", None, "unknown Qwen2.5-VL prompt template 'vicuna_v1'; choose qwen2_5_vl"),
        (QwenModel, None, "clip", "clip_text applies to LLaVA's CLIP vision tower; Qwen2.5-VL has no CLIP space"),
    ],
)
def test_options_are_checked_by_the_adapter_class(adapter, template, clip_text, message):
    with pytest.raises(PruneAuditError) as error:
        adapter.resolve_template(template)
        adapter.check_clip_text(clip_text)
    assert str(error.value) == message


def test_every_family_declares_its_parts():
    for name in family_names():
        adapter = adapter_for(name, "test")
        assert adapter.family == name and adapter.display_name and adapter.prompt_templates
        assert callable(adapter.build_tiny) and adapter.transformers_class().__name__.endswith(
            "ForConditionalGeneration"
        )


def test_loaded_model_is_the_registered_adapter(family, vlm):
    assert type(vlm) is adapter_for(family, "test")
    assert vlm.describe()["family"] == family


DIRECT_FORWARD_FAMILIES = {"llava", "qwen2_5_vl", "qwen2_vl"}  # the demo's direct forwards hold on these only


def test_direct_forwards_equal_the_stock_forward_or_refuse_in_one_line(family, vlm):
    image = random_image(5, (112, 112))  # square: Qwen's first_token_logits rebuilds the grid from the count
    if family not in DIRECT_FORWARD_FAMILIES:
        for call in (
            lambda: vlm.vision_state_width,
            lambda: vlm.image_inputs([image]),
            lambda: vlm.first_token_logits(None, None, []),
        ):
            with pytest.raises(PruneAuditError, match="has no direct forwards") as error:
                call()
            assert "\n" not in str(error.value)
        return
    item = vlm.prepare(image, QUESTIONS[0])
    ids = item.input_ids[None]
    with torch.no_grad():
        features = vlm.image_features(**vlm.image_inputs([image]))[0]
        direct = vlm.first_token_logits(ids, torch.ones_like(ids), [features])[0].float()
        stock = vlm.model(**stock_inputs(vlm, item)).logits[0, -1].float()
    assert (direct - stock).abs().max() <= TOL


def test_keep_all_equals_the_stock_forward(vlm, prepared):
    for item in prepared:
        with torch.no_grad():
            stock = vlm.model(**stock_inputs(vlm, item)).logits[0, -1].float()
        assert (vlm.prefill([item])[0].logits[0] - stock).abs().max() <= TOL


def test_decoder_probe_equals_eager_attention(vlm, checkpoint, prepared):
    """The text-to-image attention rows the in-LLM selectors score, against the stock eager attention
    (GQA, M-RoPE, Qwen3's per-head query/key norms, deepstack additions before the layer)."""
    item = prepared[0]
    eager = type(vlm).transformers_class().from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = eager(**stock_inputs(vlm, item), output_attentions=True).attentions
    end = item.image_span[1]
    for layer in (1, NUM_LAYERS - 1):
        selector = RecordingLayerSelector(layer=layer, keep=item.num_visual - 1)
        vlm.answer([item], selector, 1)
        expected = attentions[layer][0, :, end:, visual_columns(item)]
        assert (selector.records[-1].text_probs - expected).abs().max() <= TOL


def test_in_llm_drop_equals_the_stock_forward_with_dropped_keys_masked(vlm, prepared):
    """Dropping tokens at a layer (original positions) equals masking them from that layer on in the stock
    forward: Qwen3-VL's deepstack features follow the same kept set."""
    item = prepared[1]
    kept = list(range(0, item.num_visual, 3))
    logits = vlm.prefill([item], forced_stages=[[(1, kept)]])[0].logits[0]
    assert (logits - masked_reference_logits(vlm, item, [1], [kept])).abs().max() <= TOL
    if vlm.positions_for(get_selector("divprune")) == "keep_original":  # input level, same ids
        logits = vlm.prefill([item], forced_kept=[kept])[0].logits[0]
        assert (logits - masked_reference_logits(vlm, item, [0], [kept])).abs().max() <= TOL


def test_keep_all_generation_equals_stock_generate(vlm, prepared):
    item = prepared[0]
    with torch.no_grad():
        stock = vlm.model.generate(**stock_inputs(vlm, item), max_new_tokens=5, do_sample=False)
    expected = vlm.tokenizer.decode(stock[0, item.input_ids.numel() :], skip_special_tokens=True).strip()
    assert vlm.generate(item, max_new_tokens=5) == expected


@pytest.mark.parametrize("name", list_selectors())
def test_every_selector_at_full_budget_equals_keep_all_or_refuses_in_one_line(vlm, prepared, name):
    item = prepared[0]
    if name not in vlm.supported_selectors():
        with pytest.raises(PruneAuditError) as error:
            vlm.answer([item], get_selector(name), item.num_visual)
        message = str(error.value)  # the cause, and the fix: other selectors or the missing CLIP text tower
        assert "\n" not in message and ("selectors that work here: " in message or "--clip-text" in message)
        return
    prefill, _ = vlm.prefill([item], get_selector(name), item.num_visual)
    assert prefill.tokens_per_layer[0] == [item.num_visual] * NUM_LAYERS


def test_geometry_maps_every_visual_token_to_its_pixels(vlm, prepared):
    """Every grid of the geometry (LLaVA-NeXT: base view and unpadded tiles) maps each of its tokens to pixels
    it owns, and the grids together number every visual token once; the family declares that geometry
    from the image size alone (``token_geometry``, what ``import --geometry`` and the demo ask)."""
    for item in prepared:
        geometry = item.geometry
        assert vlm.token_geometry(item.image_size) == geometry
        assert geometry.grid == item.grid and geometry.num_tokens == item.num_visual
        assert geometry.image_size == item.image_size
        covered = []
        for first, grid in grid_pieces(geometry):
            index = token_index_map(grid)
            # every token owns pixels; pixels without a token (-1) are those a centre crop or unpadding removed, or
            # the strip a SigLIP crop leaves unseen (OneVision: 27 patches of 14 px in a 384-px crop)
            assert set(np.unique(index)) - {-1} == set(range(grid.num_tokens))
            assert (index >= 0).all() or grid.mode in ("hf_crop", "anyres_tiles", "anyres_tiles_downsampled")
            covered += range(first, first + grid.num_tokens)
        assert covered == list(range(item.num_visual))
        boxes = token_footprints(geometry)
        assert boxes.shape == (item.num_visual, 4) and (boxes[:, 2] > boxes[:, 0]).all()


def test_real_coco_mask_area_sums_back_per_token(vlm, shared_data):
    coco_dir = shared_data / "coco" / "tiny_coco_val2017"
    coco = CocoInstances.load(coco_dir / "instances_val2017.json")
    image_id = next(i for i in sorted(coco.images) if coco.object_names(i))
    entry = coco.image(image_id)
    image = Image.open(coco_dir / "val2017" / entry.file_name)
    geometry = vlm.prepare(image, QUESTIONS[0]).geometry
    assert geometry.image_size == entry.size
    for name in coco.object_names(image_id):
        mask = coco.category_mask(image_id, name)
        area = mask_area_per_token(mask, geometry)
        for first, grid in grid_pieces(geometry):  # each grid alone counts every mask pixel it sees once
            seen = token_index_map(grid) >= 0
            assert mask.any() and area[first : first + grid.num_tokens].sum() == (mask & seen).sum()


#: options a selector runs with below: FlowCut's default layer average cannot go below the share of decoder layers
#: 0 and 1, which hold every token its tower stage feeds (on an anyres image, where it cuts after layer 1): half of
#: them on 4 layers, over the budget below on the larger scenes; its official count after layer 1 has no floor
RUN_OPTIONS = {"flowcut": ("--option", "budget_rule=paper")}


@pytest.mark.parametrize("name", list_selectors())
def test_run_records_every_supported_selector_and_refuses_the_rest(
    vlm, prepared, checkpoint, workspace, tmp_path, name
):
    out = tmp_path / name
    budget = prepared[0].num_visual // 2  # feasible for every schedule: above the layer-0 share of 4 layers
    options = RUN_OPTIONS.get(name, ())
    result = runner.invoke(
        app, run_args(workspace, checkpoint, out, "--selector", name, "--budget", str(budget), *options)
    )
    if name not in vlm.supported_selectors():
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
        assert name in result.stderr and ("selectors that work here" in result.stderr or "--clip-text" in result.stderr)
        assert not (out / "records.parquet").exists()
        return
    if result.exit_code == 2 and "the processor gives at least" in result.stderr:
        # a selector resizing the image on a fixed-resolution processor (these tiny Qwen checkpoints' min = max
        # pixels): no smaller image has fewer tokens, refused in one line while planning, nothing written
        assert get_selector(name).resizes_image and len(result.stderr.strip().splitlines()) == 1
        assert not out.exists() or not any(out.iterdir())
        return
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pandas()
    assert len(records) == 4
    assert records["visual_tokens_avg"].between(1, records["prefill_tokens"].min()).all()


def test_class_declarations_say_what_the_loaded_model_runs(family, vlm):
    """``selector_support`` (class-level, no checkpoint) agrees with the loaded model's ``supported_selectors``."""
    support = type(vlm).selector_support()
    assert [name for name, refusal in support.items() if refusal is None] == vlm.supported_selectors()
    for name, refusal in support.items():
        if refusal is not None:
            with pytest.raises(PruneAuditError) as error:
                vlm.check_selector(get_selector(name))
            assert refusal in str(error.value) and "\n" not in refusal


@pytest.mark.parametrize(
    ("document", "heading"),
    [("docs/models.md", "## Selectors per family")],
)
def test_docs_table_lists_what_runs_on_each_family(family, document, heading):
    """The families x selectors table of docs/models.md says what the class-level
    ``selector_support`` says."""
    from pathlib import Path

    from prune_audit.models.selector_support import ON_REQUEST_SIGNALS
    from prune_audit.pruners import selector_class

    text = (Path(__file__).resolve().parents[2] / document).read_text()
    table = text.split(heading, 1)[1].split("\n## ", 1)[0]
    lines = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0]]
    column = header.index(family)  # a registered family without a column fails here
    cells = {cell[0].strip(): cell[column].strip() for cell in lines[1:] if not set(cell[0]) <= {"-"}}
    assert sorted(cells) == list_selectors()
    adapter = adapter_for(family, "test")
    available = adapter.input_signals - ON_REQUEST_SIGNALS
    with_clip = {
        name for name in list_selectors() if adapter.refusal(selector_class(name), adapter.input_signals) is None
    }
    expected = {
        name: "yes"
        if refusal is None
        else "with --clip-text"
        if name in with_clip
        else "with budget_scope=crop"
        if adapter.runs_per_crop(selector_class(name), available)
        else "no"
        for name, refusal in adapter.selector_support().items()
    }
    assert cells == expected


@pytest.mark.parametrize("family_name", family_names())
def test_selectors_command_says_what_runs_on_a_family_without_loading_it(family_name):
    """`selectors --model FAMILY` lists, from the class declarations, what runs and each refusal's reason."""
    import json

    result = runner.invoke(app, ["selectors", "--model", family_name, "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    support = adapter_for(family_name, "test").selector_support()
    assert {name: row["refusal"] for name, row in rows.items()} == support
    assert all(row["runs"] == (row["refusal"] is None) and row["family"] == family_name for row in rows.values())
    per_grid = adapter_for(family_name, "test").per_grid_selectors  # how those run on a several-grid image
    assert {name for name, row in rows.items() if row["runs_as"]} == set(per_grid)
    text = " ".join(runner.invoke(app, ["selectors", "--model", family_name], terminal_width=200).stdout.split())
    for name, refusal in support.items():
        runs = f"runs ({per_grid[name]})" if name in per_grid else "runs"
        assert f"on {family_name}: " + (runs if refusal is None else f"refused: {refusal}") in text


def test_selectors_command_names_the_families_when_model_is_neither_a_folder_nor_a_family(tmp_path):
    result = runner.invoke(app, ["selectors", "--model", str(tmp_path / "nosuch")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "name a model family: " + ", ".join(family_names()) in result.stderr


def test_shards_resume_visualize_and_intervene(vlm, prepared, checkpoint, workspace, tmp_path):
    """The other commands on every family: 2 shards merged equal one process, a rerun resumes without
    duplicates, ``visualize`` draws a kept set, ``intervene`` re-answers with the kept object cells removed."""
    budget = str(prepared[0].num_visual // 2)
    common = ("--selector", "divprune", "--budget", budget, "--limit", "12")
    whole = tmp_path / "whole"
    assert runner.invoke(app, run_args(workspace, checkpoint, whole, *common)).exit_code == 0
    for index in range(2):
        result = runner.invoke(
            app, run_args(workspace, checkpoint, tmp_path / f"shard{index}", *common, "--shard", f"{index}/2")
        )
        assert result.exit_code == 0, result.output
    merged = tmp_path / "merged"
    assert (
        runner.invoke(
            app, ["merge", str(tmp_path / "shard0"), str(tmp_path / "shard1"), "--out", str(merged)]
        ).exit_code
        == 0
    )

    def records(run_dir):
        frame = pq.read_table(run_dir / "records.parquet").to_pandas()
        return frame.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)

    assert records(merged).equals(records(whole))
    assert runner.invoke(app, run_args(workspace, checkpoint, whole, *common)).exit_code == 0
    assert records(whole).equals(records(merged))

    image = sorted(workspace["images"].iterdir())[0]
    figures = tmp_path / "figures"
    result = runner.invoke(
        app,
        [
            "visualize",
            str(image),
            "--model",
            str(checkpoint),
            "--selector",
            "divprune",
            "--budget",
            budget,
            "--question",
            "Is there a cat in the image?",
            "--out",
            str(figures),
        ],
    )
    assert result.exit_code == 0, result.output
    question_id = int(records(whole)["question_id"][0])
    redraw = ["visualize", "--run", str(whole), "--question-id", str(question_id), "--out", str(figures)]
    result = runner.invoke(app, redraw)
    assert result.exit_code == 0, result.output
    assert {path.name for path in figures.glob("*.png")} == {
        f"tokens-{checkpoint.name}-{budget}.png",
        f"tokens-{records(whole)['split'][0]}-{question_id}.png",
    }

    result = runner.invoke(app, ["intervene", str(whole), "--mode", "remove", "--out", str(tmp_path / "intervene")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "intervene" / "records.parquet").exists()


def test_analytic_flops_equal_the_counted_flops(family, checkpoint, prepared):
    """The family's declared ``shape`` gives the compute accounting the FLOPs ``FlopCounterMode`` counts over
    the same eager forward (tests/test_compute.py holds every selector to it on LLaVA and Qwen2.5-VL)."""
    from test_compute import counted, eager

    vlm = eager(load_vlm(checkpoint, device="cpu"))
    item = prepared[0]
    for name in (None, "divprune", "fastv"):
        selector = None if name is None else get_selector(name)
        outside, _, answer = counted(vlm, item, selector, None if name is None else item.num_visual // 2)
        assert outside == answer.cost.flops_vision + answer.cost.flops_llm, name


def test_budget_scope_through_run_and_visualize(family, vlm, checkpoint, prepared, workspace, tmp_path):
    """``--option budget_scope=crop``: the crops partition the visual tokens (LLaVA-OneVision's resized tile grid
    included), the option is recorded in the manifest, the records' kept sets stay within the budget; one line and
    exit 2 on one-crop families, before anything is written."""
    import json

    for item in prepared:
        crops = vlm.crop_tokens(item)
        assert torch.equal(torch.cat([tokens for tokens, _ in crops]).sort().values, torch.arange(item.num_visual))
        assert all(rows * cols == tokens.numel() for tokens, (rows, cols) in crops)
        assert len(crops) > 2 if vlm.several_crops else len(crops) == 1

    out = tmp_path / "crop"
    budget = str(prepared[0].num_visual // 3)
    args = run_args(
        workspace, checkpoint, out, "--selector", "divprune", "--budget", budget, "--option", "budget_scope=crop"
    )
    result = runner.invoke(app, args)
    if not vlm.several_crops:
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert "one crop" in result.stderr and not out.exists()
        return
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["selector"]["options"]["budget_scope"] == "crop"
    kept = pq.read_table(out / "records.parquet").column("kept").to_pylist()
    assert kept and all(0 < len(tokens) <= int(budget) for tokens in kept)
    if family == "llava_next":  # VisionZip per crop: its contextual tokens' sources are recorded and count
        result = runner.invoke(
            app,
            run_args(
                workspace,
                checkpoint,
                tmp_path / "zip",
                "--selector",
                "visionzip",
                "--budget",
                budget,
                "--option",
                "budget_scope=crop",
            ),
        )
        assert result.exit_code == 0, result.output
        records = pq.read_table(tmp_path / "zip" / "records.parquet").to_pandas()
        assert all(len(merged[0]) for merged in records["merged_stages"])
        assert (records["visual_tokens_avg"] <= int(budget)).all()
    image = sorted(workspace["images"].iterdir())[0]
    result = runner.invoke(
        app,
        [
            "visualize",
            str(image),
            "--model",
            str(checkpoint),
            "--selector",
            "divprune",
            "--option",
            "budget_scope=crop",
            "--budget",
            budget,
            "--question",
            "Is there a cat in the image?",
            "--out",
            str(tmp_path / "figure.png"),
        ],
    )
    assert result.exit_code == 0, result.output
