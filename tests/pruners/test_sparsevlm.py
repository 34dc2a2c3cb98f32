"""SparseVLM: raters and rater-row scores by hand, the official half-precision scores and attention recipe
(Gumpest/SparseVLMs 26a5f488: modelling_sparse_llama.py, utils.py, score.py), the previous layer's rater attention on
a tiny LLaVA, the paper's schedule, and token recycling against the official cluster-and-merge."""

from __future__ import annotations

import pytest
import torch
from rederivation import (  # noqa: F401 (tiny_llava, tiny_llava_path, tiny_llava_paths: fixtures)
    BUDGETS,
    EXACT,
    FIDELITY,
    HALF_DTYPES,
    HEAD_DIM,
    HEADS,
    OPTION_SETS,
    PREFIX,
    SEEDS,
    TEXT,
    TOKENS,
    dtype_name,
    official_sparse_attention_of,
    sparsevlm_half_case,
    tiny_llava,
    tiny_llava_path,
    tiny_llava_paths,
    top_k_sorted,
)
from selector_cases import counts, signals

from prune_audit.pruners import LayerSignals, Stage, get_selector
from prune_audit.pruners.schedule import average_visual_tokens
from prune_audit.pruners.sparsevlm import (
    DENSITY_NOISE,
    NOISE_SEED,
    recycled_average,
    recycled_tokens,
    recycled_tokens_per_layer,
    select_raters,
)


def test_sparsevlm_raters_by_hand():
    visual = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    text = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    # each visual row: softmax of [2, 2, 0] -> weights e^2/(2e^2+1) twice and 1/(2e^2+1): the first two rate
    assert select_raters(visual, text).tolist() == [True, True, False]
    assert select_raters(visual, torch.ones(3, 2)).tolist() == [True, True, True]  # all equal: everyone rates


def test_sparsevlm_scores_with_rater_rows_and_keeps_its_raters():
    probs = torch.zeros(2, 3, 4)
    probs[:, 0] = torch.tensor([0.1, 0.5, 0.2, 0.2])  # rater
    probs[:, 1] = torch.tensor([0.3, 0.3, 0.1, 0.3])  # rater
    probs[:, 2] = torch.tensor([0.0, 0.0, 0.9, 0.1])  # not a rater: would favour token 2
    visual = torch.tensor([[1.0, 0.0]] * 4)
    text = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    selector, state = get_selector("sparsevlm"), {}
    layer = signals(4, text_probs=probs, embeddings=visual, text_embeddings=text)
    assert torch.allclose(selector.score(Stage(2, 2), layer, state), torch.tensor([0.2, 0.4, 0.15, 0.25]))
    assert selector.prune(Stage(2, 2), layer, state).tolist() == [1, 3]
    # later stages reuse the raters chosen from the first stage's embeddings
    flipped = signals(4, text_probs=probs, embeddings=visual, text_embeddings=text.flip(0))
    assert selector.prune(Stage(6, 2), flipped, state).tolist() == [1, 3]
    assert state["raters"].tolist() == [True, True, False]


# --- half precision ---------------------------------------------------------------------------------------------------


def official_sparsevlm_half(probs: torch.Tensor, embeddings: torch.Tensor, keep: int) -> list[int]:
    """Raters, then ``attn_postprocess_topk``, in the tensors' dtype: ``v @ t^T``, its softmax over the text,
    the mean over the visual tokens and that mean each rounded; the head mean rounded, the rater rows' mean of
    the image columns rounded; ``topk(keep)`` of those half scores."""
    image = slice(PREFIX, PREFIX + TOKENS)
    weights = (embeddings[image] @ embeddings[PREFIX + TOKENS :].T).softmax(1).mean(0)
    raters = torch.where(weights > weights.mean())[0]
    head_mean = probs.mean(0)  # (T, L)
    scores = head_mean[raters][:, image].mean(0)
    assert weights.dtype == head_mean.dtype == scores.dtype == probs.dtype
    return sorted(torch.topk(scores, keep).indices.tolist())


def sparsevlm_half_kept(probs: torch.Tensor, embeddings: torch.Tensor, keep: int, **options) -> list[int]:
    """SparseVLM's first stage on float32 copies of the official half attention rows and embeddings."""
    image, text = slice(PREFIX, PREFIX + TOKENS), slice(PREFIX + TOKENS, None)
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=3, num_layers=32, text_probs=probs[:, :, image].float(),
        embeddings=embeddings[image].float(), text_embeddings=embeddings[text].float(), model_dtype=probs.dtype,
    )  # fmt: skip
    return get_selector("sparsevlm", **options).prune(Stage(3, keep), signals, {}).tolist()


def sparsevlm_half_agreement(dtype: torch.dtype) -> dict[str, int]:
    """Random cases identical to the official kept set per option set (30 each), and duplicated-key and
    quantised-key cases with the exact options (10 each: one budget per seed)."""
    identical = dict.fromkeys((*OPTION_SETS, "duplicated", "quantised"), 0)
    for seed in SEEDS:
        probs, embeddings = sparsevlm_half_case(seed, dtype)
        for budget in BUDGETS:
            expected = official_sparsevlm_half(probs, embeddings, budget)
            for name, options in OPTION_SETS.items():
                identical[name] += sparsevlm_half_kept(probs, embeddings, budget, **options) == expected
        for ties in ("duplicated", "quantised"):
            probs, embeddings = sparsevlm_half_case(seed, dtype, ties)
            budget = BUDGETS[seed % len(BUDGETS)]
            expected = official_sparsevlm_half(probs, embeddings, budget)
            identical[ties] += sparsevlm_half_kept(probs, embeddings, budget, **EXACT) == expected
    return identical


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_sparsevlm_model_dtype_reproduces_the_official_half_precision_scores(dtype):
    """score_dtype=model + ties=topk: 30 of 30 random, 10 of 10 duplicated-key and 10 of 10 quantised-key cases per
    dtype; measured with lower-index ties 19 (fp16) and 5 (bf16) of 30, float32 scores 16 and 0 of 30."""
    identical = sparsevlm_half_agreement(dtype)
    assert identical["exact"] == 30 == FIDELITY["sparsevlm"].half_cases[dtype_name(dtype)]
    assert identical["duplicated"] == identical["quantised"] == 10
    assert max(identical["lower"], identical["float32"]) < 30


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_scaled_attention_is_the_official_sparsevlm_attention_of_a_half_model(tiny_llava_path, dtype):
    """model_attention=scaled: the probe's text rows are SparseVLM's scaled_dot_product_attention on the layer's
    own half queries and keys, bit for bit, with q.k accumulated in float32 as a GPU does (a CPU's half GEMM may
    round a few dot products differently: benchmarks/half_kernels.py); the eager recipe's rows coincide on this
    model only because its head_dim is 16."""
    from tiny_models import QUESTIONS, random_image
    from transformers import LlavaForConditionalGeneration
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from prune_audit.models import load_vlm
    from prune_audit.models.probe import DecoderProbe, single_tensor_rope

    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_path, attn_implementation="eager", dtype=dtype)
    item = load_vlm(tiny_llava_path, device="cpu", dtype=dtype).prepare(random_image(0), QUESTIONS[1])
    with torch.no_grad():
        output = model.eval()(input_ids=item.input_ids[None], pixel_values=item.pixel_values[None].to(dtype),
                              output_hidden_states=True)  # fmt: skip
        hidden = output.hidden_states[0][0]  # the input of decoder layer 0
        language = model.model.language_model
        cos, sin = language.rotary_emb(hidden[None], torch.arange(hidden.shape[0])[None])
        probe = DecoderProbe(language.layers[0], single_tensor_rope(apply_rotary_pos_emb))
        rows = torch.arange(item.image_span[1], hidden.shape[0])
        queries, keys = probe.queries(hidden, rows, cos[0], sin[0]), probe.keys(hidden, cos[0], sin[0])
        keys = keys.repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
        official = official_sparse_attention_of(queries, keys, rows, gpu_dot=True).float()
        _, scaled = probe.probabilities(hidden, rows, cos[0], sin[0], in_model_dtype=True, recipe="scaled")
        _, eager = probe.probabilities(hidden, rows, cos[0], sin[0], in_model_dtype=True)
    assert queries.dtype == dtype
    assert torch.equal(scaled, official)
    assert torch.equal(eager, official)  # head_dim 16: sqrt(d) = 4, so both scalings are exact here


def test_the_two_scalings_differ_in_fp16_at_llava_head_dim():
    """At head_dim 128 (sqrt(d) is not a power of two) q.k x 1/sqrt(d) and q.k / sqrt(d) rounded to fp16 differ
    in about 0.1 % of the logits (measured 1100 of 896000 here), in bf16 in none of these."""
    generator = torch.Generator().manual_seed(0)
    dots = (torch.randn(HEADS, TEXT, 700, generator=generator) * 30).half()
    scaled = dots * (1 / HEAD_DIM**0.5)
    divided = (dots.float() / HEAD_DIM**0.5).half()
    assert 0.0005 < (scaled != divided).float().mean() < 0.003


def test_sparsevlm_model_attention_reaches_the_probe(tiny_llava_path):
    """The executor hands SparseVLM's recipe to the probe (other selectors keep the eager one); both recipes run
    end to end on an fp16 tiny LLaVA."""
    from tiny_models import QUESTIONS, random_image

    from prune_audit.models import load_vlm
    from prune_audit.models.executor import LayerPlan

    for name, options, recipe in (("sparsevlm", {}, "scaled"), ("sparsevlm", {"model_attention": "eager"}, "eager"),
                                  ("fastv", {}, "eager")):  # fmt: skip
        selector = get_selector(name, score_dtype="model", **options)
        assert LayerPlan(stages=[[]], grids=[(2, 2)], selector=selector).model_attention == recipe
    vlm = load_vlm(tiny_llava_path, device="cpu", dtype=torch.float16)
    item = vlm.prepare(random_image(0), QUESTIONS[1])
    for recipe in ("scaled", "eager"):
        selector = get_selector("sparsevlm", score_dtype="model", ties="topk", model_attention=recipe)
        assert vlm.answer([item], selector, 40)


# --- the previous layer's rater attention on a tiny LLaVA -------------------------------------------------------------


def test_sparsevlm_scores_its_first_stage_with_the_previous_layer_rater_attention(tiny_llava):
    vlm, items, outputs = tiny_llava
    selector = get_selector("sparsevlm")
    for item, output in zip(items, outputs):
        prefill, _ = vlm.prefill([item], selector, 24)
        layer, keep = prefill.stage_layers[0][0], len(prefill.kept_stages[0][0])
        start, end = item.image_span
        embeddings = output.hidden_states[0][0]
        visual, text = embeddings[start:end].float(), embeddings[end:].float()
        relevance = torch.softmax(visual @ text.T, dim=-1).mean(dim=0)
        raters = torch.nonzero(relevance > relevance.mean()).flatten() + end
        scores = output.attentions[layer - 1][0][:, raters, start:end].mean(dim=(0, 1))
        assert prefill.kept_stages[0][0] == top_k_sorted(scores, keep)


# --- the paper's schedule ---------------------------------------------------------------------------------------------


def test_sparsevlm_paper_schedule_realises_the_reference_averages():
    """Issue 14 item 3: with the official layer semantics the paper counts average 202.75 / 140.81 / 79.19."""
    realised = {
        budget: average_visual_tokens(get_selector("sparsevlm", budget_rule="paper").schedule(32, 576, budget), 32, 576)
        for budget in (192, 128, 64)
    }
    assert realised == pytest.approx({192: 202.75, 128: 140.8125, 64: 79.1875})
    current = get_selector("sparsevlm", budget_rule="paper", signal_layer="current").schedule(32, 576, 192)
    assert counts(current) == [(2, 300), (6, 200), (15, 110)]


# --- token recycling (recycle=true) against the official cluster-and-merge --------------------------------------------

# The official clustering is re-implemented here from Gumpest/SparseVLMs (26a5f488),
# ``llava/model/language_model/utils.py::cluster_and_merge`` and the recycling block of
# ``modelling_sparse_llama.py`` (batched tensors, broadcast differences, the reference's
# ``topk`` / ``argmin`` / ``index_add_`` steps), and compared with the selector on random
# cases at LLaVA sizes. The reference adds unseeded ``rand * 1e-6`` to the density; both
# sides here get the same draw, the selector's seeded one.


def official_cluster_and_merge(
    x: torch.Tensor, cluster_num: int, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """utils.py::cluster_and_merge on (B, N, C) ``x``; returns merged (B, K, C) and idx_cluster (B, N)."""
    batch, count, channels = x.shape
    # pairwise L2 of broadcast differences (the reference's einops rearrange), a block of rows at a time
    blocks = [(x[:, i : i + 32, None, :] - x[:, None, :, :]).norm(dim=-1, p=2) for i in range(0, count, 32)]
    distance = torch.cat(blocks, 1)
    dist_matrix = distance / (channels**0.5)
    dist_nearest, _ = torch.topk(dist_matrix, k=cluster_num, dim=-1, largest=False)
    density = (-(dist_nearest**2).mean(dim=-1)).exp()
    density = density + noise[None]
    mask = (density[:, None, :] > density[:, :, None]).type(x.dtype)
    dist_max = dist_matrix.flatten(1).max(dim=-1)[0][:, None, None]
    dist, _ = (dist_matrix * mask + dist_max * (1 - mask)).min(dim=-1)
    score = dist * density
    _, index_down = torch.topk(score, k=cluster_num, dim=-1)
    dist_to_centres = torch.gather(dist_matrix, 1, index_down[:, :, None].expand(-1, -1, count))
    idx_cluster = dist_to_centres.argmin(dim=1)
    idx_batch = torch.arange(batch)[:, None].expand(batch, cluster_num)
    idx_tmp = torch.arange(cluster_num)[None, :].expand(batch, cluster_num)
    idx_cluster[idx_batch.reshape(-1), index_down.reshape(-1)] = idx_tmp.reshape(-1)
    idx = idx_cluster + torch.arange(batch)[:, None] * cluster_num
    token_weight = x.new_ones(batch, count, 1)
    all_weight = token_weight.new_zeros(batch * cluster_num, 1)
    all_weight.index_add_(dim=0, index=idx.reshape(batch * count), source=token_weight.reshape(batch * count, 1))
    all_weight = all_weight + 1e-6
    norm_weight = token_weight / all_weight[idx]
    x_merged = x.new_zeros(batch * cluster_num, channels)
    source = x * norm_weight
    x_merged.index_add_(dim=0, index=idx.reshape(batch * count), source=source.reshape(batch * count, channels))
    return x_merged.reshape(batch, cluster_num, channels), idx_cluster


def official_recycling(
    relevance: torch.Tensor, hidden: torch.Tensor, keep: int
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The recycling block of modelling_sparse_llama.py for one stage: kept mask, merged tokens, members."""
    mask = torch.zeros_like(relevance, dtype=torch.bool)
    mask[torch.topk(relevance, min(keep, relevance.numel() - 1)).indices] = True
    pruned = torch.where(~mask)[0]
    chosen = pruned[relevance[pruned].topk(int(pruned.shape[0] * 0.3) + 1)[1]]
    cluster_num = int(chosen.shape[0] / 10) + 1
    noise = torch.rand(chosen.numel(), generator=torch.Generator().manual_seed(NOISE_SEED)) * DENSITY_NOISE
    merged, idx_cluster = official_cluster_and_merge(hidden[chosen][None], cluster_num, noise)
    members = [sorted(chosen[idx_cluster[0] == c].tolist()) for c in range(cluster_num)]
    return mask, merged[0], members


# (alive visual tokens, keep) of the reference's stages: 576 -> 300 / 303 / 238 / 66, then the later stages
STAGE_SIZES = [
    (576, 300),
    (576, 303),
    (576, 238),
    (576, 66),
    (309, 200),
    (313, 110),
    (247, 48),
    (80, 30),
    (204, 110),
    (114, 36),
]


CASES = [(seed, *STAGE_SIZES[seed % len(STAGE_SIZES)]) for seed in range(30)]


def hidden_case(seed: int, count: int) -> torch.Tensor:
    """(count, 4096) layer outputs: Gaussian, clustered (a mixture), or clustered with exact duplicates."""
    generator = torch.Generator().manual_seed(seed)
    kind = seed % 3
    if kind == 0:
        return torch.randn(count, 4096, generator=generator)
    centres = torch.randn(12, 4096, generator=generator) * 3
    members = torch.randint(0, 12, (count,), generator=generator)
    hidden = centres[members] + torch.randn(count, 4096, generator=generator)
    if kind == 2:  # duplicates: equal densities, the noise decides
        hidden[1::4] = hidden[0::4][: hidden[1::4].shape[0]]
    return hidden


def signals_for(relevance: torch.Tensor, hidden: torch.Tensor) -> LayerSignals:
    """Signals whose SparseVLM score is ``relevance``: one text token (it rates), one head."""
    count = relevance.numel()
    return LayerSignals(
        alive=torch.arange(count), grid=(24, 24), layer=3, num_layers=32, text_probs=relevance[None, None, :],
        embeddings=torch.zeros(count, 8), text_embeddings=torch.zeros(1, 8), hidden_states=hidden,
    )  # fmt: skip


@pytest.mark.parametrize(("seed", "count", "keep"), CASES)
def test_recycling_reproduces_the_official_cluster_and_merge(seed, count, keep):
    # distinct relevances: torch.topk orders ties arbitrarily (here: the lower index first, a documented choice)
    relevance = torch.randperm(count, generator=torch.Generator().manual_seed(100 + seed)).float() / count
    hidden = hidden_case(seed, count)
    selector, state, stage = get_selector("sparsevlm", recycle=True), {}, Stage(3, keep)
    signals = signals_for(relevance, hidden)
    kept = selector.prune(stage, signals, state)
    merge = selector.merge(stage, signals, state, kept)
    mask, merged, members = official_recycling(relevance, hidden, keep)
    assert torch.equal(kept, torch.nonzero(mask).flatten())
    assert [m.tolist() for m in merge.members] == members
    assert merge.num_tokens == recycled_tokens(count - keep)
    assert torch.equal(merge.hidden, merged)


def test_recycling_is_off_by_default_and_skips_a_stage_that_prunes_nothing():
    relevance, hidden = torch.rand(20), torch.randn(20, 16)
    signals, stage = signals_for(relevance, hidden), Stage(3, 8)
    plain = get_selector("sparsevlm")
    assert plain.recycle is False and plain.merge(stage, signals, {}, plain.prune(stage, signals, {})) is None
    recycling = get_selector("sparsevlm", recycle=True)
    assert recycling.merge(Stage(3, 20), signals, {}, torch.arange(20)) is None


# --- token recycling: schedules and realised averages -----------------------------------------------------------------


def test_recycled_counts_follow_the_reference():
    # int(0.3 p) + 1 selected, int(selected / 10) + 1 clusters: 576 -> 300 prunes 276, 83 selected, 9 clusters
    assert [recycled_tokens(p) for p in (0, 1, 9, 29, 30, 276, 510)] == [0, 1, 1, 1, 2, 9, 16]
    stages = get_selector("sparsevlm", budget_rule="paper", recycle=True).schedule(32, 576, 192)
    counts = recycled_tokens_per_layer(stages, 32, 576)
    assert counts[3] == 309 and counts[7] == 204 and counts[16] == 113


def test_paper_rule_with_recycling_realises_the_reference_averages():
    realised = {
        budget: recycled_average(
            get_selector("sparsevlm", budget_rule="paper", recycle=True).schedule(32, 576, budget), 32, 576
        )
        for budget in (192, 128, 64)
    }
    assert realised == pytest.approx({192: 206.5, 128: 145.40625, 64: 82.25})  # spec: ~206 / 145 / 82


@pytest.mark.parametrize("budget", [64, 100, 128, 192, 300])
def test_average_rule_with_recycling_counts_the_recycled_tokens(budget):
    stages = get_selector("sparsevlm", recycle=True).schedule(32, 576, budget)
    assert abs(recycled_average(stages, 32, 576) - budget) <= 0.5
    plain = get_selector("sparsevlm").schedule(32, 576, budget)
    assert plain == get_selector("sparsevlm", recycle=False).schedule(32, 576, budget)
    assert abs(average_visual_tokens(plain, 32, 576) - budget) <= 0.5


def test_average_rule_with_recycling_refuses_a_budget_the_recycled_tokens_exceed():
    with pytest.raises(ValueError, match="closest realised average to budget 56 .* is 57.03"):
        get_selector("sparsevlm", recycle=True).schedule(32, 576, 56)
    assert get_selector("sparsevlm").schedule(32, 576, 56)  # without recycling it is honoured
