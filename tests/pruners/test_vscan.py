"""VScan (Tencent/SelfEvolvingAgent a82450e1, VScan/) against re-derivations of its official code: LLaVA-1.5's
scans and merging in float32 and half precision, and the Qwen2.5-VL path (``VScan/qwen/model/``)."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch
from qwen_vision import models, raster_to_window_order  # noqa: F401 (models: fixture)
from rederivation import (
    BUDGETS,
    EXACT,
    FIDELITY,
    GRID,
    HALF_DTYPES,
    PREFIX,
    SEEDS,
    TOKENS,
    VISION_LAYERS,
    clip_half_attention,
    dtype_name,
    fastv_cpu_gemm_case,
    pair_half_agreement,
)
from tiny_models import QUESTIONS, WORDS, random_image
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.models import load_vlm
from prune_audit.pruners import LayerSignals, Stage, get_selector
from prune_audit.pruners.fidelity import RANDOM_CASES
from prune_audit.pruners.vscan import greedy_window_scan


def official_vscan_vision(cls_attention: torch.Tensor, features: torch.Tensor, visual_token_num: int):
    """VScan's ``encode_images`` (Tencent/SelfEvolvingAgent a82450e1, VScan/): window scan of layer 5, global
    scan of layer -2, then ``token_merging`` (scaling 1), for one image; returns (index mask, merged features)."""
    shallow, deep = cls_attention[5][None].clone(), cls_attention[-1][None].clone()
    attn_map = shallow.view(1, 24, 24)
    k = int(visual_token_num * 0.5) // 16
    local = []
    for i in range(4):
        for j in range(4):
            window = attn_map[0, i * 6 : (i + 1) * 6, j * 6 : (j + 1) * 6].reshape(-1)
            for idx in torch.topk(window, k)[1]:
                dy, dx = divmod(idx.item(), 6)
                local.append((i * 6 + dy) * 24 + j * 6 + dx)
    local = torch.tensor([local])
    deep[0, local[0]] = 0
    chosen = torch.topk(deep, k=visual_token_num - int(visual_token_num * 0.5), dim=1)[1]
    mask = torch.zeros(1, TOKENS, dtype=torch.bool)
    mask.scatter_(1, torch.cat((local, chosen), dim=1), True)
    retained, others = features[mask[0]][None], features[~mask[0]][None]
    # the official broadcast (others[:, :, None] against retained[:, None]) row by row: the same values, less memory
    cosine = torch.stack([torch.nn.functional.cosine_similarity(row[None], retained[0], dim=1) for row in others[0]])
    nearest = cosine.argmax(dim=1)[None]
    count = torch.zeros(1, retained.shape[1], dtype=torch.int)
    merged = retained.clone()
    merged.scatter_add_(1, nearest.unsqueeze(-1).expand(-1, -1, features.shape[1]), others)
    count.scatter_add_(1, nearest, torch.ones_like(nearest, dtype=count.dtype))
    merged /= 1 + count.unsqueeze(2)
    return mask[0], merged[0]


def vision_stage_signals(seed: int, dim: int = 4096) -> LayerSignals:
    generator = torch.Generator().manual_seed(seed)
    cls_rows = torch.softmax(torch.randn(VISION_LAYERS, TOKENS + 1, generator=generator) * 2, dim=-1)[:, 1:]
    # clustered features, so that many pruned tokens join the same kept one
    centres = torch.randn(12, dim, generator=generator)
    features = centres[torch.randint(0, 12, (TOKENS,), generator=generator)] + torch.randn(
        TOKENS, dim, generator=generator
    )
    return LayerSignals(
        alive=torch.arange(TOKENS),
        grid=GRID,
        layer=0,
        num_layers=32,
        layer_cls_attention=cls_rows,
        hidden_states=features,
        text_probs=torch.rand(4, 3, TOKENS, generator=generator),
    )


def test_vscan_vision_stage_reproduces_the_official_scans_and_merging():
    """30 cases: 10 seeds x the official vision-stage counts 96 / 192 / 288 (averages 64 / 128 / 192)."""
    selector = get_selector("vscan")
    identical = 0
    for seed in SEEDS:
        signals = vision_stage_signals(seed)
        for keep in (96, 192, 288):
            stage = Stage(0, keep)
            kept = selector.prune(stage, signals, {})
            merge = selector.merge(stage, signals, {}, kept)
            mask, merged = official_vscan_vision(signals.layer_cls_attention, signals.hidden_states, keep)
            ours = signals.hidden_states[kept].clone()
            slot = {int(p): i for i, p in enumerate(kept)}
            for index, target in enumerate(merge.replaces.tolist()):
                ours[slot[target]] = merge.hidden[index]
            same_set = kept.tolist() == torch.nonzero(mask).flatten().tolist()
            identical += same_set and torch.allclose(ours, merged, atol=1e-5)
            assert merge.replaces.numel() == len(merge.members) and all(m.numel() > 1 for m in merge.members)
    assert identical == len(SEEDS) * 3 == RANDOM_CASES
    assert FIDELITY["vscan"].agreement_cases == identical


def test_vscan_llm_stage_keeps_the_last_prompt_tokens_most_attended():
    """``layer_prune``'s ranking: head mean of the last prompt row, top keep."""
    selector = get_selector("vscan")
    for seed in SEEDS:
        signals = vision_stage_signals(seed)
        signals.layer = 16
        kept = selector.prune(Stage(16, 32), signals, {})
        official = torch.topk(signals.text_probs[:, -1:, :].mean(dim=0).mean(dim=0), 32).indices.sort().values
        assert kept.tolist() == official.tolist()


def test_vscan_schedule_is_the_official_default_at_64():
    assert get_selector("vscan").schedule(32, 576, 64) == [Stage(0, 96), Stage(16, 32)]
    assert get_selector("vscan").schedule(32, 576, 128) == [Stage(0, 192), Stage(16, 64)]
    assert get_selector("vscan").schedule(12, 144, 128) == [Stage(0, 144), Stage(6, 112)]


def test_vscan_official_local_count_can_keep_fewer():
    """96 // 16 windows is exact at the official counts; at 100 the official global scan still takes 50: 98 kept."""
    signals = vision_stage_signals(0, dim=8)
    assert get_selector("vscan").prune(Stage(0, 100), signals, {}).numel() == 100
    assert get_selector("vscan", local_count="official").prune(Stage(0, 100), signals, {}).numel() == 98


@pytest.mark.parametrize("merge", ["true", "false"])
def test_vscan_runs_on_the_demo_with_two_recorded_stages(tmp_path, merge):
    out = tmp_path / "vscan"
    result = CliRunner().invoke(app, ["run", "--selector", "vscan", "--budget", "32", "--option",
                                      f"merge_pruned={merge}", "--limit", "3", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        kept, merged = record["kept_stages"], record["merged_stages"]
        assert [len(k) + len(m) for k, m in zip(kept, merged)] == [48, 16] and record["visual_tokens_avg"] == 32
        cells = kept[0] + [cell for group in merged[0] for cell in group]
        assert sorted(cells) == (list(range(144)) if merge == "true" else sorted(kept[0]))


# --- half precision ---------------------------------------------------------------------------------------------------


VSCAN_KEEPS = (96, 192, 288)  # the official vision-stage counts of averages 64 / 128 / 192


def official_vscan_half(shallow: torch.Tensor, deep: torch.Tensor, keep: int) -> list[int]:
    """``window_cls_selection`` and the global scan on the half CLS attentions (576,): ``topk`` of each 6 x 6
    window in raster order, the deep row with the local tokens set to 0 in half, ``topk`` of the rest."""
    windows = shallow.view(GRID)
    per_window = int(keep * 0.5) // 16
    local = []
    for top in range(0, GRID[0], 6):
        for left in range(0, GRID[1], 6):
            flat = windows[top : top + 6, left : left + 6].reshape(-1)
            local += [(top + i // 6) * GRID[1] + left + i % 6 for i in torch.topk(flat, per_window)[1].tolist()]
    deep = deep[None].clone()
    deep[0, local] = 0
    chosen = torch.topk(deep, k=keep - int(keep * 0.5), dim=1)[1][0].tolist()
    assert deep.dtype == shallow.dtype
    return sorted(local + chosen)


def vscan_half_case(seed: int, dtype: torch.dtype, ties: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The official half CLS attention (head mean rounded) of layers 6 and 23, each (576,), and the float32 head
    means of the same half rows rounded once."""
    generator = torch.Generator().manual_seed(9000 + seed)
    rows = [clip_half_attention(generator, dtype, ties, rows=1)[:, 0, 1:] for _ in range(2)]  # (16, 576) each
    official = torch.stack([cls.mean(dim=0) for cls in rows])
    assert official.dtype == dtype
    return official, torch.stack([cls.float().mean(dim=0) for cls in rows])


def vscan_half_kept(pair: torch.Tensor, dtype: torch.dtype, keep: int, **options) -> list[int]:
    """VScan's vision stage on a (23, 576) float32 ``layer_cls_attention`` whose rows 5 and 22 are ``pair``."""
    attention = torch.zeros(VISION_LAYERS, TOKENS)
    attention[5], attention[-1] = pair.float()
    signals = LayerSignals(alive=torch.arange(TOKENS), grid=GRID, layer=0, num_layers=32, model_dtype=dtype,
                           layer_cls_attention=attention, hidden_states=torch.zeros(TOKENS, 8),
                           text_probs=torch.zeros(1, 1, TOKENS))  # fmt: skip
    return get_selector("vscan", **options).prune(Stage(0, keep), signals, {}).tolist()


def vscan_half_agreement(dtype: torch.dtype) -> dict[str, int]:
    """As :func:`hiprune_half_agreement`, on the vision-stage counts 96 / 192 / 288."""
    return pair_half_agreement(vscan_half_case, official_vscan_half, vscan_half_kept, VSCAN_KEEPS, dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_vscan_model_dtype_reproduces_the_official_half_precision_scans(dtype):
    """score_dtype=model + ties=topk: 30 of 30 random, 10 of 10 duplicated-key and 10 of 10 integer-logit cases per
    dtype, also from the float32 head means rounded once (one reduction); float32 throughout measured 29 (fp16) and
    22 (bf16) of 30."""
    identical = vscan_half_agreement(dtype)
    assert identical["exact"] == identical["rounded_once"] == 30 == FIDELITY["vscan"].half_cases[dtype_name(dtype)]
    assert identical["duplicated"] == identical["quantised"] == 10
    assert identical["float32"] < 30


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_vscan_llm_stage_keeps_the_official_half_precision_set(dtype):
    """The LLM stage (``modeling_llama_x.py::layer_prune``: eager attention of the last prompt row, / sqrt(d),
    float32 softmax rounded, head mean rounded, ``topk``) with score_dtype=model, ties=topk on the probe's rows:
    30 of 30 per dtype against the official attention run on this CPU (whose fp16 GEMM rounds a few q.k
    differently, see test_fidelity.py::test_fastv_and_pdrop_keep_the_official_set_despite_the_cpu_fp16_gemm)."""
    image, identical = slice(PREFIX, PREFIX + TOKENS), 0
    for seed in SEEDS:
        official, probe = fastv_cpu_gemm_case(seed, dtype)
        signals = LayerSignals(alive=torch.arange(TOKENS), grid=GRID, layer=16, num_layers=32, model_dtype=dtype,
                               text_probs=probe[:, :, image].float(), hidden_states=torch.zeros(TOKENS, 8),
                               layer_cls_attention=torch.zeros(VISION_LAYERS, TOKENS))  # fmt: skip
        scores = official.mean(dim=0)[-1, image]
        for keep in BUDGETS:
            expected = sorted(torch.topk(scores, keep).indices.tolist())
            identical += get_selector("vscan", **EXACT).prune(Stage(16, keep), signals, {}).tolist() == expected
    assert identical == 30


QWEN_GRID = (16, 20)  # merged tokens of a 448 x 560 image: 1,280 patches


QWEN_KEEPS = (53, 106, 160)  # int(0.167 N) (the official --image-token-ratio), a third and a half of the 320 tokens


def vscan_qwen_half_case(seed: int, dtype: torch.dtype, ties: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The official half received attention of the two full-attention blocks (head sum, query mean, 4-patch mean,
    each rounded; window order undone) divided by the 16 heads (exact: a power of 2), each (320,), and the float32
    means of the same half weights rounded once (the adapter's float32 ``layer_attention``, rounded)."""
    generator = torch.Generator().manual_seed(9500 + seed)
    blocks, window_index = window_attention_case(generator, *QWEN_GRID, dtype, ties)
    official = torch.stack([official_received(probs, window_index) / QWEN_7B_HEADS for probs in blocks])
    assert official.dtype == dtype
    return official, torch.stack([raster_received(probs, window_index) for probs in blocks])


def vscan_qwen_half_kept(pair: torch.Tensor, dtype: torch.dtype, keep: int, **options) -> list[int]:
    """VScan's Qwen vision stage on float32 copies of ``pair`` as the first full-attention and the last block."""
    signals = qwen_vision_signals(pair[0].float(), pair[1].float(), torch.zeros(pair.shape[1], 8), QWEN_GRID, dtype)
    return get_selector("vscan", **options).prune(Stage(0, keep), signals, {}).tolist()


def test_vscan_qwen_model_dtype_reproduces_the_official_half_precision_scans():
    """bf16 (the official 7B's dtype), score_dtype=model + ties=topk given the official half reductions: 30 of 30
    random, 10 of 10 duplicated-key and 10 of 10 integer-logit cases. Given the float32 means rounded once (the
    adapter's float32 signal; it passes no half twin, as HiPrune's official Qwen reduction differs: head mean and
    query sum) 0 of 30, float32 throughout 0 of 30: the thrice-rounded bf16 reductions leave only 20-25 distinct
    values among the 320 tokens, so the official set is mostly argsort's and topk's order among ties (measured:
    7.4 and 6.5 of 53-160 official tokens missed on average)."""
    official = lambda local, deep, keep: official_qwen_scans(local, deep, *QWEN_GRID, keep)  # noqa: E731
    identical = pair_half_agreement(vscan_qwen_half_case, official, vscan_qwen_half_kept, QWEN_KEEPS, torch.bfloat16)
    assert identical["exact"] == 30 and identical["duplicated"] == identical["quantised"] == 10
    assert identical["rounded_once"] == identical["float32"] == 0


# --- Qwen2.5-VL (VScan/qwen/model/) -----------------------------------------------------------------------------------


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
    assert identical == 36 and "Qwen path: test_qwen_attention_signals.py 36 of 36" in FIDELITY["vscan"].agreement


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
