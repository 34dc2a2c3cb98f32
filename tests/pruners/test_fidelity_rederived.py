"""Issue 27, third batch: HiPrune, VScan and SparseVLM v2 against independent re-derivations of their official code.

Each re-derivation follows the official code's own steps (its tensors, its masks, its ``topk``) rather than
the library's, on random signals at LLaVA-1.5 shapes (24 x 24 patches, 23 encoder layers run up to the feature
layer); continuous random scores have no exact ties, so ``topk``'s unspecified order among ties never matters.
"""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners import InputSignals, LayerSignals, Stage, get_selector
from prune_audit.pruners.fidelity import RANDOM_CASES, fidelity_entries
from prune_audit.pruners.hiprune import buffer_cells, scaled_vision_layer

FIDELITY = fidelity_entries()  # each selector class's row, by name

GRID, N, LAYERS = (24, 24), 576, 23
SEEDS, BUDGETS = range(10), (64, 128, 192)


def global_attention(seed: int) -> torch.Tensor:
    """(23, 576) per-layer attention received by each patch: a softmax over 577 keys averaged over rows, CLS dropped."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(LAYERS, 16, N + 1, generator=generator) * 2
    return torch.softmax(logits, dim=-1).mean(dim=1)[:, 1:]


def official_hiprune(shallow: torch.Tensor, deep: torch.Tensor, budget: int, alpha: float = 0.1) -> list[int]:
    """HiPrune's ``encode_images`` (Danielement321/HiPrune 6e83a124) for one image, as the official code steps it."""
    deep = deep.clone()[None]
    shallow_num = round(budget * alpha / 5)
    anchors = torch.topk(shallow[None], k=shallow_num, dim=1)[1]
    near = torch.cat([anchors, anchors - 1, anchors + 1, anchors - 24, anchors + 24], dim=1).clamp(0, 575)
    near = torch.unique(near, sorted=False)[None]
    mask = torch.zeros(1, N, dtype=torch.bool)
    mask.scatter_(1, near, 1)
    deep[0] -= mask.int().squeeze()
    registers = torch.topk(deep, k=budget - near.shape[1], dim=1)[1]
    index_mask = torch.zeros(1, N, dtype=torch.bool)
    index_mask.scatter_(1, torch.cat([near, registers], dim=1), True)
    return torch.nonzero(index_mask[0]).flatten().tolist()


def test_hiprune_reproduces_the_official_anchors_buffers_and_registers():
    selector = get_selector("hiprune")
    identical = 0
    for seed in SEEDS:
        attention = global_attention(seed)
        for budget in BUDGETS:
            kept = selector.select(InputSignals(grid=GRID, layer_attention=attention), budget).kept.tolist()
            identical += kept == official_hiprune(attention[8], attention[-1], budget)
            assert len(kept) == budget
    assert identical == len(SEEDS) * len(BUDGETS) == RANDOM_CASES
    assert FIDELITY["hiprune"].agreement_cases == identical


def test_hiprune_scales_the_object_layer_with_the_tower_depth():
    assert scaled_vision_layer(9, 23) == 8  # LLaVA-1.5: attentions[9 - 1]
    assert scaled_vision_layer(9, 3) == 0  # the demo runs 3 layers to its feature layer: round(27 / 23) = 1
    assert scaled_vision_layer(23, 3) == 2 and scaled_vision_layer(1, 46) == 1


def test_hiprune_grid_neighbours_stay_inside_the_grid():
    corner_and_edge = torch.tensor([0, 24 * 5 + 23])
    official = buffer_cells(corner_and_edge, GRID, "official").tolist()
    assert 24 * 5 + 24 in official  # the official +1 of a row's last cell wraps to the next row's first
    assert buffer_cells(corner_and_edge, GRID, "grid").tolist() == [
        0,
        1,
        24,
        24 * 4 + 23,
        24 * 5 + 22,
        24 * 5 + 23,
        24 * 6 + 23,
    ]


def test_hiprune_caps_the_anchors_so_buffers_fit_the_budget():
    attention = global_attention(0)
    for budget in (1, 4, 5, 9, 16):
        kept = (
            get_selector("hiprune", alpha=1.0).select(InputSignals(grid=GRID, layer_attention=attention), budget).kept
        )
        assert kept.numel() == budget


@pytest.mark.parametrize("budget", ["16", "64"])
def test_hiprune_runs_on_the_demo(tmp_path, budget):
    out = tmp_path / "hiprune"
    result = CliRunner().invoke(
        app, ["run", "--selector", "hiprune", "--budget", budget, "--limit", "3", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        assert len(record["kept_stages"][0]) == min(int(budget), 144)


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
    mask = torch.zeros(1, N, dtype=torch.bool)
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
    cls_rows = torch.softmax(torch.randn(LAYERS, N + 1, generator=generator) * 2, dim=-1)[:, 1:]
    # clustered features, so that many pruned tokens join the same kept one
    centres = torch.randn(12, dim, generator=generator)
    features = centres[torch.randint(0, 12, (N,), generator=generator)] + torch.randn(N, dim, generator=generator)
    return LayerSignals(
        alive=torch.arange(N),
        grid=GRID,
        layer=0,
        num_layers=32,
        layer_cls_attention=cls_rows,
        hidden_states=features,
        text_probs=torch.rand(4, 3, N, generator=generator),
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


def official_rope_ones(position_ids: torch.Tensor, head_dim: int = 128, base: float = 10000.0) -> torch.Tensor:
    """(L, L) ``rope_weights`` of SparseVLM v2.0: all-ones query and key through LLaVA-era Llama RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(int(position_ids.max()) + 1).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[position_ids], emb.sin()[position_ids]
    ones = torch.ones(position_ids.numel(), head_dim)
    rotated = ones * cos + torch.cat((-ones[:, head_dim // 2 :], ones[:, : head_dim // 2]), dim=-1) * sin
    return rotated @ rotated.T / math.sqrt(head_dim)


def official_sparsevlm2_stage(probs, rope_weights, t_token_idx, v_start, v_num, count):
    """One v2.0 stage: gravity correction, ``select_attn_head_by_sum`` (14 heads), ``attn_postprocess_topk``."""
    attn = (probs / rope_weights)[None]
    text_start = v_start + v_num
    rows = t_token_idx + text_start
    per_head = attn[0][:, rows, v_start:text_start].sum((1, 2))
    attn = attn[:, per_head.topk(14)[1]]
    relation = attn.mean(1)[:, rows, v_start : v_start + v_num].mean(1)
    mask = torch.zeros_like(relation, dtype=torch.bool)
    mask[0][torch.topk(relation, min(count, v_num - 1), dim=1)[1]] = True
    return torch.nonzero(mask[0]).flatten().tolist()


def test_sparsevlm2_reproduces_the_official_gravity_corrected_priority_head_ranking():
    """30 cases: 10 seeds x first-stage counts of 64 / 128 / 192, the last two on 400 tokens left by an earlier
    stage (original position ids, as v2.0 keeps them); 32 heads, 40 text tokens, the library's own RoPE probe."""
    from types import SimpleNamespace

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from prune_audit.models.probe import DecoderProbe, single_tensor_rope
    from prune_audit.pruners.sparsevlm import select_raters

    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=4096, num_attention_heads=32))
    probe = DecoderProbe(
        SimpleNamespace(self_attn=SimpleNamespace(head_dim=128)), single_tensor_rope(apply_rotary_pos_emb)
    )
    selector, identical, prefix, text = get_selector("sparsevlm2"), 0, 35, 40
    for seed in SEEDS:
        generator = torch.Generator().manual_seed(seed)
        embeddings = torch.randn(N + text, 256, generator=generator)
        relevance = (embeddings[:N] @ embeddings[N:].T).softmax(1).mean(0)
        t_token_idx = torch.where(relevance > relevance.mean())[0]
        raters = select_raters(embeddings[:N], embeddings[N:])
        assert torch.nonzero(raters).flatten().tolist() == t_token_idx.tolist()
        for budget, count in ((64, 66), (128, 108), (192, 118)):
            alive = torch.arange(N) if budget == 64 else torch.randperm(N, generator=generator)[:400].sort().values
            positions = torch.cat([torch.arange(prefix), prefix + alive, prefix + N + torch.arange(text)])
            length = positions.numel()
            logits = torch.randn(32, length, length, generator=generator) * 3
            probs = logits.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            visual = torch.arange(prefix, prefix + alive.numel())
            rows = torch.arange(prefix + alive.numel(), length)
            cos, sin = rotary(torch.ones(1), positions[None])
            signals = LayerSignals(
                alive=alive, grid=GRID, layer=3, num_layers=32, text_probs=probs[:, rows][:, :, visual],
                rope_ones_logits=probe.rope_ones_logits(rows, visual, cos[0], sin[0]),
                embeddings=embeddings[alive], text_embeddings=embeddings[N:],
            )  # fmt: skip
            kept = selector.prune(Stage(3, count), signals, {"raters": raters})
            rope_weights = official_rope_ones(positions)
            official = official_sparsevlm2_stage(probs, rope_weights, t_token_idx, prefix, alive.numel(), count)
            identical += kept.tolist() == official
    assert identical == RANDOM_CASES
    assert FIDELITY["sparsevlm2"].agreement_cases == identical


def test_sparsevlm2_runs_on_the_demo_and_is_refused_nowhere_it_has_signals(tmp_path):
    out = tmp_path / "sparsevlm2"
    result = CliRunner().invoke(
        app, ["run", "--selector", "sparsevlm2", "--budget", "32", "--limit", "3", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        assert record["visual_tokens_avg"] == pytest.approx(32, abs=1) and len(record["kept_stages"]) == 3
    qwen = tmp_path / "qwen"
    result = CliRunner().invoke(app, ["run", "--model", "demo-qwen", "--selector", "sparsevlm2", "--budget", "32",
                                      "--limit", "2", "--out", str(qwen)])  # fmt: skip
    assert result.exit_code == 0, result.output


# --- ToMe in the vision tower (facebookresearch/ToMe af95e4b1: merge.py, patch/timm.py) ----------------------


def official_tower_merges(states: list[torch.Tensor], metrics: list[torch.Tensor], schedule: list[int]):
    """``ToMeBlock``'s merge, layer after layer: ``bipartite_soft_matching(metric, r, class_token=True)``,
    ``merge_wavg`` and ``merge_source`` (one-hot rows, ``amax``). ``states[l]`` (the residual stream after layer
    l's attention) and ``metrics[l]`` are given for the token count the layer sees; returns the last merged states
    and each token's cells."""
    size, source, x = torch.ones(1, 577, 1), torch.eye(577)[None], None
    for state, metric, r in zip(states, metrics, schedule):
        x = state[None]
        r = min(r, (x.shape[1] - 1) // 2)
        metric = metric[None] / metric[None].norm(dim=-1, keepdim=True)
        scores = metric[..., ::2, :] @ metric[..., 1::2, :].transpose(-1, -2)
        scores[..., 0, :] = -math.inf
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx, src_idx = edge_idx[..., r:, :].sort(dim=1)[0], edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

        def merge(values: torch.Tensor, mode: str) -> torch.Tensor:
            src, dst = values[..., ::2, :], values[..., 1::2, :]
            n, t1, c = src.shape
            unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
            src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
            return torch.cat([unm, dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)], dim=1)

        x, size, source = merge(x * size, "sum"), merge(size, "sum"), merge(source, "amax")
        x = x / size
    return x[0], [torch.nonzero(row[1:]).flatten().tolist() for row in source[0]]


def test_tome_tower_merging_reproduces_the_official_blocks():
    """30 cases: 10 seeds x budgets 64/128/192 through 23 layers of (1 + 576)-token CLIP-L states (1024 wide,
    64-dim head-mean keys), each layer's states and metric drawn for the token count it sees."""
    from prune_audit.pruners.tome import TowerMerging, tower_schedule

    identical = 0
    for seed in SEEDS:
        for budget in BUDGETS:
            generator = torch.Generator().manual_seed(seed)
            schedule, count = tower_schedule(N, budget, LAYERS), N + 1
            states, metrics = [], []
            for r in schedule:
                states.append(torch.randn(count, 1024, generator=generator))
                metrics.append(torch.randn(count, 64, generator=generator))
                count -= r
            merge = TowerMerging(budget, proportional=True)
            size, sources = (
                torch.ones(N + 1),
                [torch.zeros(0, dtype=torch.long)] + [torch.tensor([c]) for c in range(N)],
            )
            for layer, (state, metric) in enumerate(zip(states, metrics)):
                hidden, size, sources = merge(layer, LAYERS, state, metric, size, sources)
            tokens, cells = official_tower_merges(states, metrics, schedule)
            same = [group.tolist() for group in sources] == cells and torch.allclose(hidden, tokens, atol=1e-5)
            identical += same and hidden.shape[0] == budget + 1
    assert identical == RANDOM_CASES


def test_tower_schedule_is_even_and_falls_back_to_halving():
    from prune_audit.pruners.tome import tower_schedule

    assert tower_schedule(576, 64, 23) == [23] * 6 + [22] * 17
    assert tower_schedule(144, 64, 3) == [27, 27, 26]
    assert tower_schedule(144, 32, 3) == [72, 36, 4]  # an even share fails the halving cap in layer 3
    with pytest.raises(ValueError, match="raise the budget or use location=projector"):
        tower_schedule(144, 16, 3)


def demo_llava():
    from prune_audit.demo import DEMO_MODELS
    from prune_audit.models import load_vlm

    return load_vlm(str(DEMO_MODELS["demo"]), device="cpu")


def test_proportional_attention_adds_log_size_to_every_keys_logits():
    """``clip_attention_block`` against the official ``ToMeAttention`` written out on a demo CLIP layer."""
    from prune_audit.models.probe import clip_attention_block

    layer = demo_llava().vision_tower.encoder.layers[0]
    generator = torch.Generator().manual_seed(0)
    hidden, size = torch.randn(40, 128, generator=generator), torch.randint(1, 9, (40,), generator=generator).float()
    attention, normed = layer.self_attn, layer.layer_norm1(hidden)
    q, k, v = (
        p(normed).view(40, 4, 32).transpose(0, 1) for p in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    weights = (q @ k.transpose(-2, -1) * attention.scale + size.log()[None, None, :]).softmax(dim=-1)
    official = attention.out_proj((weights @ v).transpose(0, 1).reshape(40, 128))
    attended, heads = clip_attention_block(layer, hidden, size.log())
    assert torch.allclose(attended, official, atol=1e-5) and torch.allclose(heads.keys.mean(dim=0), k.mean(dim=0))
    assert torch.allclose(heads.cls_probs, weights[:, 0]) and torch.equal(heads.values, v)


def test_merging_tower_without_merges_is_the_stock_tower():
    """No merge and no sizes: the rerun tower gives the feature layer's states of the stock forward."""
    vlm = demo_llava()
    pixels = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(0))

    def no_merge(layer, num_layers, hidden, metric, size, sources):
        return hidden, size, sources

    no_merge.proportional, no_merge.metric = True, lambda cls_probs, keys, values: keys.mean(dim=0)
    states, sources = vlm._merging_tower(pixels[0], no_merge)
    assert torch.allclose(states, vlm._tower_states(pixels)[vlm.feature_index][0], atol=1e-5) and len(sources) == 145


def test_tome_in_the_tower_runs_on_the_demo_and_is_refused_on_qwen(tmp_path):
    out = tmp_path / "tower"
    result = CliRunner().invoke(app, ["run", "--selector", "tome", "--option", "location=tower", "--budget", "32",
                                      "--limit", "3", "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    for record in pq.read_table(out / "records.parquet").to_pylist():
        kept, merged = record["kept_stages"][0], record["merged_stages"][0]
        assert len(kept) + len(merged) == 32 and sorted(kept + [c for g in merged for c in g]) == list(range(144))
    result = CliRunner().invoke(app, ["run", "--model", "demo-qwen", "--selector", "tome", "--option", "location=tower",
                                      "--budget", "16", "--limit", "1", "--out", str(tmp_path / "q")])  # fmt: skip
    assert result.exit_code != 0 and "selector 'tome' needs" in result.output and "Traceback" not in result.output
