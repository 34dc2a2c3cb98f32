"""HiPrune and VScan on Qwen2.5-VL as their official Qwen code runs them: Danielement321/HiPrune
``Qwen2_5_VL/qwen2_5_vl_HiPrune.py`` (6e83a124), Tencent/SelfEvolvingAgent ``VScan/qwen/model/`` (a82450e1).

* the ``layer_attention`` signal equals a recomputation in raster patch order from each block's
  input (its own rotary table and window permutation re-derived here), on the tiny model and demo-qwen;
* ``prune-audit run --model demo-qwen --selector hiprune`` / ``vscan`` records the budget / both stages;
* each selection agrees with a re-derivation of the official Qwen selection on random cases.
"""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import QUESTIONS, WORDS, random_image
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.demo.assets import DEMO_MODELS
from prune_audit.demo.evaluate import load_demo
from prune_audit.models import load_vlm
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector
from prune_audit.pruners.base import Stage
from prune_audit.pruners.fidelity import fidelity_entries
from prune_audit.pruners.signals import InputSignals, LayerSignals
from prune_audit.pruners.vscan import greedy_window_scan

FIDELITY = fidelity_entries()  # each selector class's row, by name

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tiny = QwenModel.build_tiny(tmp_path_factory.mktemp("qwenm") / "qwen", words=WORDS, image_size=168, seed=4)
    return {"tiny": load_vlm(tiny, device="cpu"), "demo-qwen": load_demo(DEMO_MODELS["demo-qwen"])}


def raster_to_window_order(rows: int, cols: int, side: int) -> torch.Tensor:
    """(N,) merged-token raster index at each window slot: ``side x side`` windows tiled from the top left
    (partial ones at the bottom and right edges), windows in raster order, tokens raster inside each."""
    order = []
    for top in range(0, rows, side):
        for left in range(0, cols, side):
            order += [
                r * cols + c for r in range(top, min(top + side, rows)) for c in range(left, min(left + side, cols))
            ]
    return torch.tensor(order)


def rotary_tables(rows: int, cols: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, head_dim) cos and sin of the vision 2-D rotary embedding for the processor's patch order:
    merged tokens in raster order, the 2 x 2 patches of each row by row."""
    cells = [(2 * r + i // 2, 2 * c + i % 2) for r in range(rows) for c in range(cols) for i in range(4)]
    height, width = torch.tensor(cells, dtype=torch.float32).T
    inverse = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2))
    angles = torch.cat([height[:, None] * inverse, width[:, None] * inverse], dim=1)
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def recomputed_layer_attention(vlm, item) -> torch.Tensor:
    """(Lv, N) received attention per block, mean over heads, query patches and each token's 4 patches,
    formed in raster order from the block inputs the tower computes (window order undone here)."""
    visual = vlm.model.model.visual
    config = vlm.model.config.vision_config
    rows, cols = item.grid
    inputs: list[torch.Tensor] = []
    hooks = [block.register_forward_pre_hook(lambda module, args: inputs.append(args[0])) for block in visual.blocks]
    with torch.no_grad():
        visual(item.pixel_values, grid_thw=item.extras["image_grid_thw"])
    for hook in hooks:
        hook.remove()
    window = raster_to_window_order(rows, cols, config.window_size // config.spatial_merge_size // config.patch_size)
    to_raster = torch.argsort(window)
    heads, head_dim = config.num_heads, config.hidden_size // config.num_heads
    cos, sin = rotary_tables(rows, cols, head_dim, config.rope_parameters["rope_theta"])
    layers = []
    for hidden, block in zip(inputs, visual.blocks):
        hidden = hidden.view(rows * cols, 4, -1)[to_raster].reshape(rows * cols * 4, -1)
        with torch.no_grad():
            qkv = block.attn.qkv(block.norm1(hidden)).view(-1, 3, heads, head_dim).float()
        query, key = rotate(qkv[:, 0], cos[:, None], sin[:, None]), rotate(qkv[:, 1], cos[:, None], sin[:, None])
        logits = torch.einsum("phd,qhd->hpq", query, key) / math.sqrt(head_dim)
        received = logits.softmax(dim=-1).mean(dim=(0, 1))
        layers.append(received.view(rows * cols, 4).mean(dim=1))
    return torch.stack(layers)


@pytest.mark.parametrize(
    "name, size", [("tiny", (130, 100)), ("tiny", (120, 120)), ("demo-qwen", (96, 96)), ("demo-qwen", (120, 72))]
)
def test_layer_attention_equals_a_raster_order_recomputation(models, name, size):
    vlm = models[name]
    item = vlm.prepare(random_image(7, size), QUESTIONS[0])
    [output] = vlm._vision([item], frozenset({"layer_attention"}))
    signal = output.signals["layer_attention"]
    expected = recomputed_layer_attention(vlm, item)
    assert signal.shape == (len(vlm.model.model.visual.blocks), item.grid[0] * item.grid[1])
    torch.testing.assert_close(signal, expected, rtol=TOL, atol=TOL)
    assert output.signals["vision_tower"] == "qwen2_5_vl"


def test_hiprune_runs_and_records_on_demo_qwen(tmp_path):
    out = tmp_path / "hiprune"
    result = CliRunner().invoke(
        app,
        ["run", "--model", "demo-qwen", "--selector", "hiprune", "--budget", "16", "--limit", "6", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    records = pq.read_table(out / "records.parquet").to_pylist()
    assert len(records) == 6 and all(len(record["kept_stages"][0]) == 16 for record in records)


def official_qwen_hiprune(
    shallow: torch.Tensor, deep: torch.Tensor, width: int, visual_token_num: int, alpha: float = 0.1
) -> torch.Tensor:
    """The HiPrune block of ``Qwen2_5_VLForConditionalGeneration.forward`` (6e83a124) for one image:
    top anchors of the shallow block, flat +-1 / +-width offsets clamped, unique, then the deep block's
    attention minus 1 on those and its top for the rest; returns the retained indices (may repeat)."""
    n_image_tokens = shallow.numel()
    shallow_token_num = round((visual_token_num * alpha) / 5)
    anchors = torch.topk(shallow, k=shallow_token_num).indices
    near = torch.cat([anchors, anchors - 1, anchors + 1, anchors - width, anchors + width])
    near = torch.unique(near.clamp(0, n_image_tokens - 1), sorted=False)
    available = torch.zeros(n_image_tokens, dtype=torch.bool)
    available.scatter_(0, near, 1)
    deep = deep - available.int()
    return torch.cat([near, torch.topk(deep, k=visual_token_num - near.shape[0]).indices])


def summed_received_attention(generator: torch.Generator, patches: int) -> torch.Tensor:
    """(patches // 4,) a block's attention summed over query patches (the official scale), 4-patch mean."""
    probs = torch.randn(patches, patches, generator=generator).mul(2.0).softmax(dim=-1)
    return probs.sum(dim=0).view(-1, 4).mean(dim=1)


def test_hiprune_agrees_with_the_official_qwen_selection_on_random_cases():
    generator = torch.Generator().manual_seed(27)
    agreed = duplicated = 0
    for case in range(40):
        rows, cols = (int(v) for v in torch.randint(4, 19, (2,), generator=generator))
        n = rows * cols
        budget = int(torch.randint(5, n // 2, (1,), generator=generator))
        depth = 32
        attention = torch.stack(
            [
                summed_received_attention(generator, 4 * n)
                if layer in (15, depth - 1)
                else torch.rand(n, generator=generator)
                for layer in range(depth)
            ]
        )
        signals = InputSignals(grid=(rows, cols), layer_attention=attention, vision_tower="qwen2_5_vl")
        kept = get_selector("hiprune").select(signals, budget).kept
        official = official_qwen_hiprune(attention[15], attention[-1], cols, budget)
        if torch.unique(official).numel() < budget:  # the summed deep attention re-picked an anchor or buffer
            duplicated += 1
            continue
        assert kept.tolist() == sorted(official.tolist()), f"case {case}"
        agreed += 1
    assert agreed >= 30, (agreed, duplicated)


def test_a_heavy_buffer_cell_is_picked_twice_officially_and_once_here():
    """The documented difference: a summed deep attention above 1 survives the official "minus 1"."""
    shallow, deep = torch.zeros(36), torch.linspace(0.1, 0.5, 36)
    shallow[14], deep[15] = 1.0, 3.0  # anchor 14; its buffer 15 gets 3 query patches' worth of attention
    official = official_qwen_hiprune(shallow, deep, 6, 10, alpha=0.5)
    assert official.tolist().count(15) == 2 and torch.unique(official).numel() == 9
    attention = torch.stack([shallow] * 16 + [deep] * 16)
    signals = InputSignals(grid=(6, 6), layer_attention=attention, vision_tower="qwen2_5_vl")
    kept = get_selector("hiprune", alpha=0.5).select(signals, 10).kept
    assert kept.numel() == 10 and set(official.tolist()) < set(kept.tolist())


def test_the_qwen_object_layer_scales_to_the_towers_depth():
    attention = torch.rand(4, 36)
    attention[1] = torch.arange(36.0)  # 16 of 32 -> block 2 of 4: anchors at the highest cells
    signals = InputSignals(grid=(6, 6), layer_attention=attention, vision_tower="qwen2_5_vl")
    kept = get_selector("hiprune", alpha=1.0).select(signals, 10).kept
    assert {35, 34, 29}.issubset(set(kept.tolist()))


# --- VScan's Qwen2.5-VL path (Tencent/SelfEvolvingAgent a82450e1, VScan/qwen/model/) ----------------------------

QWEN_7B_FULL_BLOCKS = (7, 15, 23, 31)  # Qwen2.5-VL-7B's fullatt_block_indexes of its 32 vision blocks
QWEN_7B_HEADS, QWEN_7B_WIDTH, QWEN_7B_LAYERS = 16, 3584, 28  # vision heads, LLM width (merged features), LLM depth


def official_received(probs: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
    """(N,) ``Qwen2_5_VisionTransformerPretrainedModel_X.forward``'s reduction of one block's (H, P, P) attention
    in window order: sum over heads, mean over query patches, mean of each merged token's 4, window order undone."""
    received = probs.sum(dim=0).mean(dim=0).view(-1, 4).mean(dim=1)
    return received[torch.argsort(window_index)]


def official_window_selection(attention: torch.Tensor, count: int, rows: int, cols: int, side: int = 4) -> list[int]:
    """``qwen2_5_vl_utils.window_selection``: walk the tokens by decreasing attention, take one while its window
    (edge cells fold into the last window of their row or column) holds fewer than ceil(count / windows)."""
    down, across = rows // side, cols // side
    limit = math.ceil(count / (down * across))
    counter = torch.zeros(rows, cols, dtype=torch.int)
    taken = []
    for index in torch.argsort(attention, dim=0, descending=True).tolist():
        x, y = min(index // cols // side, down - 1), min(index % cols // side, across - 1)
        if counter[x, y] < limit:
            counter[x, y] += 1
            taken.append(index)
        if len(taken) >= count:
            break
    assert len(taken) == count
    return taken


def official_qwen_scans(local: torch.Tensor, deep: torch.Tensor, rows: int, cols: int, num_keep: int) -> list[int]:
    """``Qwen2_5_VLForConditionalGeneration_X.forward``'s scans: ``num_keep // 2`` by the window selection, the
    rest the top of the deep attention with those set to 0 (in its dtype), sorted."""
    chosen_local = official_window_selection(local, num_keep // 2, rows, cols)
    deep = deep.clone()
    deep[chosen_local] = 0
    return sorted(chosen_local + torch.topk(deep, num_keep - num_keep // 2).indices.tolist())


def official_qwen_vscan(
    local: torch.Tensor, deep: torch.Tensor, features: torch.Tensor, rows: int, cols: int, num_keep: int
) -> tuple[list[int], torch.Tensor]:
    """The vision stage: :func:`official_qwen_scans`, then ``token_merging`` (scaling 1)."""
    keep = official_qwen_scans(local, deep, rows, cols, num_keep)
    mask = torch.zeros(features.shape[0], dtype=torch.bool)
    mask[keep] = True
    retained, others = features[mask], features[~mask]
    nearest = torch.nn.functional.cosine_similarity(others[:, None], retained[None], dim=2).argmax(dim=1)
    merged = retained.clone().index_add_(0, nearest, others)
    counts = torch.zeros(retained.shape[0]).index_add_(0, nearest, torch.ones(nearest.numel()))
    return keep, merged / (1 + counts[:, None])


def window_attention_case(
    generator: torch.Generator, rows: int, cols: int, dtype: torch.dtype = torch.float32, ties: str = ""
):
    """Two full-attention blocks' (H, P, P) softmax in the tower's window order (P = 4 rows cols patches, each
    merged token's 4 together) and the window index (raster merged token at each window slot).

    The logits are rounded to ``dtype`` and the float32 softmax cast to it, as the official SDPA path forms the
    weights; ``ties="duplicated"``: a quarter of the key columns repeat others, ``"quantised"``: integer logits."""
    window_index = raster_to_window_order(rows, cols, 4)
    patches = 4 * rows * cols
    blocks = []
    for _ in range(2):
        logits = 2 * torch.randn(QWEN_7B_HEADS, patches, patches, generator=generator)
        if ties == "duplicated":
            targets = torch.randperm(patches, generator=generator)[: patches // 4]
            logits[:, :, targets] = logits[:, :, torch.randint(patches, (targets.numel(),), generator=generator)]
        elif ties == "quantised":
            logits = logits.round()
        blocks.append(torch.softmax(logits.to(dtype).float(), dim=-1).to(dtype))
    return blocks, window_index


def raster_received(probs: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
    """(N,) the adapter's ``layer_attention`` row, formed another way: columns put in raster patch order first,
    then the mean over heads, query patches and each merged token's 4 (float32)."""
    slot = torch.argsort(window_index)  # raster merged token -> its window slot
    columns = (4 * slot[:, None] + torch.arange(4)).flatten()
    return probs.float()[:, :, columns].mean(dim=(0, 1)).view(-1, 4).mean(dim=1)


def qwen_vision_signals(local: torch.Tensor, deep: torch.Tensor, features: torch.Tensor, grid, dtype=None):
    """Vision-stage LayerSignals of a Qwen2.5-VL-7B-like tower whose blocks 8 and 32 have ``local`` and ``deep``."""
    attention = torch.rand(32, local.numel())
    attention[QWEN_7B_FULL_BLOCKS[0]], attention[-1] = local, deep
    return LayerSignals(
        alive=torch.arange(local.numel()),
        grid=grid,
        layer=0,
        num_layers=QWEN_7B_LAYERS,
        layer_attention=attention,
        hidden_states=features,
        text_probs=torch.zeros(1, 1, local.numel()),
        vision_tower="qwen2_5_vl",
        full_attention_layers=QWEN_7B_FULL_BLOCKS,
        model_dtype=dtype,
    )


def test_vscan_agrees_with_the_official_qwen_vision_stage_on_random_cases():
    """36 cases: merged grids of 6..20 rows and columns (Qwen2.5-VL-7B: 16 vision heads, 4 x 4 windows, blocks 8 and
    32, 3584-wide clustered features), vision-stage counts of 10 to 60 % of the tokens."""
    generator = torch.Generator().manual_seed(2705)
    selector = get_selector("vscan")
    identical = 0
    for _ in range(36):
        rows, cols = (int(v) for v in torch.randint(6, 21, (2,), generator=generator))
        n = rows * cols
        (local, deep), window_index = window_attention_case(generator, rows, cols)
        centres = torch.randn(10, QWEN_7B_WIDTH, generator=generator)
        features = centres[torch.randint(0, 10, (n,), generator=generator)] + torch.randn(
            n, QWEN_7B_WIDTH, generator=generator
        )
        keep = int(torch.randint(n // 10, 3 * n // 5, (1,), generator=generator))
        official_keep, official_merged = official_qwen_vscan(official_received(local, window_index),
                                                             official_received(deep, window_index), features, rows,
                                                             cols, keep)  # fmt: skip
        signals = qwen_vision_signals(
            raster_received(local, window_index), raster_received(deep, window_index), features, (rows, cols)
        )
        kept = selector.prune(Stage(0, keep), signals, {})
        merge = selector.merge(Stage(0, keep), signals, {}, kept)
        ours = features[kept].clone()
        slot = {int(p): i for i, p in enumerate(kept)}
        for index, target in enumerate(merge.replaces.tolist()):
            ours[slot[target]] = merge.hidden[index]
        identical += kept.tolist() == official_keep and torch.allclose(ours, official_merged, atol=1e-5)
    assert identical == 36 and "Qwen path: test_methods_qwen.py 36 of 36" in FIDELITY["vscan"].agreement


def test_vscan_runs_on_demo_qwen_with_two_recorded_stages(tmp_path):
    """8 of 36 tokens on 8 decoder layers: 12 at the input (merged tokens carrying every cell), 4 from layer 4."""
    out = tmp_path / "vscan"
    result = CliRunner().invoke(
        app, ["run", "--model", "demo-qwen", "--selector", "vscan", "--budget", "8", "--limit", "4", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        kept, merged = record["kept_stages"], record["merged_stages"]
        assert record["stage_layers"] == [0, 4] and [len(k) + len(m) for k, m in zip(kept, merged)] == [12, 4]
        assert sorted(kept[0] + [cell for group in merged[0] for cell in group]) == list(range(36))


@pytest.mark.parametrize("name", ["tiny", "demo-qwen"])
def test_vscan_reads_the_towers_received_attention_and_first_full_attention_block(models, name):
    """The vision stage the prefill records (kept tokens, and merged ones in their kept token's place) is the
    selector's on the adapter's ``layer_attention`` with the tower's ``fullatt_block_indexes`` (tiny: [1] of 2,
    demo-qwen: [3] of 4)."""
    vlm = models[name]
    item = vlm.prepare(random_image(3, (120, 96)), QUESTIONS[1])
    [output] = vlm._vision([item], frozenset({"layer_attention"}))
    assert output.signals["full_attention_layers"] == tuple(vlm.model.config.vision_config.fullatt_block_indexes)
    selector = get_selector("vscan")
    [stage, _] = vlm.schedule(selector, item.num_visual, 6)
    signals = LayerSignals(alive=torch.arange(item.num_visual), grid=item.grid, layer=0, num_layers=vlm.num_layers,
                           hidden_states=output.features.float(), text_probs=torch.zeros(1, 1, item.num_visual),
                           **{key: output.signals[key] for key in ("layer_attention", "vision_tower",
                                                                    "full_attention_layers")})  # fmt: skip
    answer = vlm.answer([item], selector, 6)[0]
    kept = selector.prune(stage, signals, {})
    members = sorted(group.tolist() for group in selector.merge(stage, signals, {}, kept).members)
    assert sorted(answer.merged_stages[0]) == members  # each kept token that gained members became a merged one
    assert (
        sorted(answer.kept_stages[0] + [cell for group in members for cell in group if cell in kept]) == kept.tolist()
    )


def test_vscan_on_a_qwen_7b_depth_is_the_official_layer_14_with_a_third():
    selector = get_selector("vscan")
    assert selector.schedule(QWEN_7B_LAYERS, 1000, 64) == [Stage(0, 96), Stage(14, 32)]
    assert selector.schedule(QWEN_7B_LAYERS, 1000, 100) == [Stage(0, 150), Stage(14, 50)]


def test_greedy_window_scan_folds_edge_cells_into_the_last_windows():
    """A 5 x 9 grid has 1 x 2 windows of 4: column 8 and row 4 join them; 6 tokens, at most 3 per window."""
    scores = torch.zeros(45)
    scores[[8, 17, 26, 35, 44]] = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0])  # the right edge column: window 2
    scores[[0, 1]] = torch.tensor([4.0, 3.0])
    taken = greedy_window_scan(scores, torch.arange(45), (5, 9), 4, 6)
    assert taken.tolist() == [8, 17, 26, 0, 1, 2]
    assert greedy_window_scan(scores, torch.arange(45), (5, 9), 8, 4).tolist() == [8, 17, 26, 35]  # one window


def test_vscan_is_refused_in_one_line_on_qwen2_vl(tmp_path):
    from prune_audit.errors import PruneAuditError
    from prune_audit.models.families import adapter_for

    vlm = load_vlm(adapter_for("qwen2_vl", "test").build_tiny(tmp_path / "qwen2", words=WORDS), device="cpu")
    with pytest.raises(PruneAuditError) as error:
        vlm.check_selector(get_selector("vscan"))
    assert "vscan" in str(error.value) and "\n" not in str(error.value)


def test_attention_rope_skipped_forms_the_llm_stage_attention_from_unrotated_q_and_k(models):
    """``attention_rope="skipped"`` (VScan's official Qwen ``layer_prune``): the text rows' attention at layer 1 is
    the causal softmax of q.k / sqrt(d) of the layer's normed input without M-RoPE; the default differs."""
    from dataclasses import dataclass

    from tiny_models import RecordingLayerSelector, stock_inputs

    @dataclass
    class Unrotated(RecordingLayerSelector):
        attention_rope: str = "skipped"

    vlm = models["tiny"]
    item = vlm.prepare(random_image(5, (120, 120)), QUESTIONS[0])
    recorded = {}
    for selector in (Unrotated(), RecordingLayerSelector()):
        vlm.answer([item], selector, 8)
        recorded[selector.attention_rope] = selector.records[-1].text_probs
    with torch.no_grad():
        hidden = vlm.model(**stock_inputs(vlm, item), output_hidden_states=True).hidden_states[1][0]
        layer, config = vlm.model.model.language_model.layers[1], vlm.model.config.text_config
        normed = layer.input_layernorm(hidden)
        head_dim = config.hidden_size // config.num_attention_heads
        query = layer.self_attn.q_proj(normed).view(-1, config.num_attention_heads, head_dim).transpose(0, 1)
        key = layer.self_attn.k_proj(normed).view(-1, config.num_key_value_heads, head_dim).transpose(0, 1)
        key = key.repeat_interleave(config.num_attention_heads // config.num_key_value_heads, dim=0)
    start, end = item.image_span
    logits = query[:, end:] @ key.transpose(1, 2) / math.sqrt(head_dim)
    causal = torch.arange(hidden.shape[0])[None, :] <= torch.arange(end, hidden.shape[0])[:, None]
    expected = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)[:, :, start:end]
    torch.testing.assert_close(recorded["skipped"], expected, rtol=TOL, atol=TOL)
    assert not torch.allclose(recorded["applied"], expected, rtol=TOL, atol=TOL)
