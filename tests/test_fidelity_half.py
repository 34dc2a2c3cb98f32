"""Half precision against the official arithmetic itself (issue 30, items 2 and 3).

Each ``official_*_half`` function below re-derives a selector's official code path step by step in the
model's half dtype, as that code runs on the same hardware: the dtype of every intermediate is the one
the official code leaves it in, reductions of half tensors are torch's (float32 accumulation, rounded
once), and the ranking is ``torch.topk`` on the half values, so its order among exact ties is the
kernel's. The selectors run with ``score_dtype=model`` and ``ties=topk`` (where they rank with top-k)
on the float32 signals the adapters pass, beside ``model_dtype``. Shapes are LLaVA-1.5's: 576 visual
tokens, 4096-dim LLM states, 32 heads x 128, 768-dim CLIP embeddings; 10 seeds x budgets 64/128/192 per
dtype, plus tie-heavy cases (duplicated rows, integer keys). Where a function models a GPU's float32
accumulation instead of this CPU's half kernel, it says so; how many products the kernel rounds differently
depends on the CPU (AMX, avx512_fp16, ...), so ``python -m benchmarks.half_kernels`` measures it and the tests
assert only the kept sets. The counts asserted here are the half-precision agreement quoted in
``docs/fidelity.md``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prune_audit.pruners import InputSignals, LayerSignals, Stage, get_selector
from prune_audit.pruners.fidelity import fidelity_entries

FIDELITY = fidelity_entries()  # each selector class's row, by name

TOKENS = 576
BUDGETS = (64, 128, 192)
SEEDS = range(10)
HALF_DTYPES = [torch.float16, torch.bfloat16]
PREFIX = 35  # LLaVA-1.5's system prompt + "USER:" before the image
TEXT = 40  # question and template suffix after the image
LLM_DIM, HEADS, HEAD_DIM = 4096, 32, 128
CLIP_EMBED = 768  # CLIP ViT-L/14's projection width: image and text embeddings of CDPruner's relevance
EXACT = {"score_dtype": "model", "ties": "topk"}  # the reference-exact half path
# the option sets compared: exact, the same with lower-index ties, float32 scores (the defaults)
OPTION_SETS = {"exact": EXACT, "lower": {"score_dtype": "model"}, "float32": {}}


def dtype_name(dtype: torch.dtype) -> str:
    """The key of ``Fidelity.half_cases``."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def duplicate_rows(values: torch.Tensor, generator: torch.Generator, share: float = 0.25) -> torch.Tensor:
    """A copy of (L, ...) ``values`` in which ``share`` of the rows repeat other rows (exact ties downstream)."""
    values = values.clone()
    rows = values.shape[0]
    targets = torch.randperm(rows, generator=generator)[: int(rows * share)]
    values[targets] = values[torch.randint(rows, (targets.numel(),), generator=generator)]
    return values


# --- DART (fork xqy1111111/DART 02476570, llava/model/language_model/modeling_llama_self.py) ----------------


def dart_half_case(seed: int, dtype: torch.dtype, duplicated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer K-1's post-RoPE keys (H, L, d) and the final-normed layer output (L, 4096) of one prompt, in ``dtype``.

    ``duplicated``: a quarter of the rows repeat others (equal key norms and cosines)."""
    generator = torch.Generator().manual_seed(3000 + seed)
    length = PREFIX + TOKENS + TEXT
    keys = torch.randn(length, HEADS, HEAD_DIM, generator=generator)
    keys = keys * (1 + torch.rand(length, 1, 1, generator=generator))  # token-dependent key norms
    normed = 0.5 * torch.randn(LLM_DIM, generator=generator) + torch.randn(length, LLM_DIM, generator=generator)
    if duplicated:
        keys, normed = duplicate_rows(keys, generator), duplicate_rows(normed, generator)
    return keys.transpose(0, 1).to(dtype), normed.to(dtype)


def official_dart_half(keys: torch.Tensor, normed: torch.Tensor, budget: int) -> list[int]:
    """The official ``get_retained_image_token`` in the tensors' dtype, with ``max_num_trunction = budget``.

    L1 key norms in half (``torch.norm(p=1)``), ``topk(4)`` pivots of image and following tokens, pivots
    visited in ``list(set(...))`` order; per pivot the remaining candidates (``list`` of a set of ints:
    ascending) ranked by ``-cosine_similarity`` written out: each norm rounded, each unit vector rounded,
    the elementwise product rounded, its sum rounded once; ``topk(budget // 8)`` of those half values.
    """
    start, per = PREFIX, budget // 8
    flat = keys.permute(1, 0, 2).reshape(keys.shape[1], -1)
    image_norms = torch.norm(flat[start : start + TOKENS], p=1, dim=-1)
    query_norms = torch.norm(flat[start + TOKENS :], p=1, dim=-1)
    assert image_norms.dtype == normed.dtype
    image_indices = (image_norms.topk(4).indices + start).tolist()
    query_indices = (query_norms.topk(4).indices + start + TOKENS).tolist()
    kept = set(image_indices + query_indices)
    candidates = set(range(start, start + TOKENS)) - set(image_indices)
    for pivot in list(set(image_indices + query_indices)):
        pool = list(candidates)
        rows, vector = normed[pool], normed[pivot]
        unit_rows = rows / torch.linalg.vector_norm(rows, dim=-1, keepdim=True)
        unit_vector = vector / torch.linalg.vector_norm(vector)
        products = unit_vector * unit_rows
        dissimilarity = -products.sum(dim=-1)
        assert unit_rows.dtype == products.dtype == dissimilarity.dtype == normed.dtype
        picks = [pool[i] for i in dissimilarity.topk(per).indices.tolist()]
        kept.update(picks)
        candidates.difference_update(picks)
    kept.difference_update(query_indices)
    return sorted(index - start for index in kept)


def dart_half_kept(keys: torch.Tensor, normed: torch.Tensor, budget: int, **options) -> list[int]:
    """DART on the signals the adapter passes: float32 L1 norms of the half keys, float32 copies of the states."""
    norms = keys.float().abs().sum(dim=(0, 2))
    image, text = slice(PREFIX, PREFIX + TOKENS), slice(PREFIX + TOKENS, None)
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32,
        key_norms=norms[image], text_key_norms=norms[text],
        normed_hidden_states=normed[image].float(), text_normed_hidden_states=normed[text].float(),
        sequence_index=torch.arange(PREFIX, PREFIX + TOKENS),
        text_sequence_index=torch.arange(PREFIX + TOKENS, normed.shape[0]),
        model_dtype=normed.dtype,
    )  # fmt: skip
    selector = get_selector("dart", budget_rule="paper", pivot_order="set", **options)
    return selector.prune(Stage(2, selector.paper_keep(budget)), signals, {}).tolist()


def dart_half_agreement(dtype: torch.dtype) -> dict[str, int]:
    """Random cases identical to the official kept set with the reference-exact options and with float32
    cosines (30 each), and duplicated-row cases with the exact options (10: one budget per seed)."""
    identical = {"exact": 0, "float32": 0, "duplicated": 0}
    for seed in SEEDS:
        keys, normed = dart_half_case(seed, dtype, duplicated=False)
        for budget in BUDGETS:
            expected = official_dart_half(keys, normed, budget)
            identical["exact"] += dart_half_kept(keys, normed, budget, **EXACT) == expected
            identical["float32"] += dart_half_kept(keys, normed, budget) == expected
        keys, normed = dart_half_case(seed, dtype, duplicated=True)
        budget = BUDGETS[seed % len(BUDGETS)]
        expected = official_dart_half(keys, normed, budget)
        identical["duplicated"] += dart_half_kept(keys, normed, budget, **EXACT) == expected
    return identical


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_dart_model_dtype_reproduces_the_official_half_precision_cosine(dtype):
    """score_dtype=model + ties=topk: 30 of 30 random and 10 of 10 duplicated-row cases per dtype; measured with
    float32 cosines rounded afterwards (the default) 15 (fp16) and 0 (bf16) of 30."""
    identical = dart_half_agreement(dtype)
    assert identical["exact"] == 30 == FIDELITY["dart"].half_cases[dtype_name(dtype)]
    assert identical["duplicated"] == 10
    assert identical["float32"] < 30


# --- CDPruner (Theia-4869/CDPruner 9541616c, llava/model/llava_arch.py::encode_images) ------------------------


def cdpruner_half_case(
    seed: int, dtype: torch.dtype, duplicated: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projector outputs (576, 4096), CLIP image embeddings (576, 768) and 1 or 2 text embeddings (M, 768).

    ``duplicated``: a quarter of the tokens repeat others (features and image embeddings): exact gain ties."""
    generator = torch.Generator().manual_seed(5000 + seed)
    features = 0.5 * torch.randn(LLM_DIM, generator=generator) + torch.randn(TOKENS, LLM_DIM, generator=generator)
    image = 0.3 * torch.randn(CLIP_EMBED, generator=generator) + torch.randn(TOKENS, CLIP_EMBED, generator=generator)
    text = torch.randn(1 + seed % 2, CLIP_EMBED, generator=generator)
    if duplicated:
        features, image = duplicate_rows(torch.cat([features, image], dim=1), generator).split([LLM_DIM, CLIP_EMBED], 1)
    return features.to(dtype), image.to(dtype), text.to(dtype)


def official_relevance_half(image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """(576,) the official raw relevance in the embeddings' dtype: unit vectors, their products and the
    mean of the negated cosines each rounded (``mean_m -cos``)."""
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    relevance = (-(image @ text.t())).mean(dim=-1)
    assert relevance.dtype == image.dtype
    return relevance


def official_cdpruner_half(features: torch.Tensor, raw: torch.Tensor, k: int) -> list[int]:
    """The official kernel and greedy: unit features and the min-max relevance in half, the kernel
    ``r_i S_ij r_j`` and the fast greedy MAP (plain argmax, no guard) in float32."""
    unit = (features / features.norm(dim=-1, keepdim=True)).float()
    relevance = (raw - raw.min() + 1e-6) / (raw.max() - raw.min())
    assert relevance.dtype == raw.dtype
    kernel = relevance.unsqueeze(1) * (unit @ unit.T) * relevance.unsqueeze(0)  # half x float32: float32
    assert kernel.dtype == torch.float32
    vectors, gains, picks = torch.zeros(k, TOKENS), torch.diagonal(kernel).clone(), []
    for step in range(k):
        j = int(torch.argmax(gains))
        picks.append(j)
        update = (kernel[j] - vectors[:step, j] @ vectors[:step]) / torch.sqrt(gains[j])
        vectors[step] = update
        gains = gains - update**2
        gains[j] = float("-inf")
    return sorted(picks)


def cdpruner_half_agreement(dtype: torch.dtype) -> dict[str, int]:
    """Cases identical to the official kept set with score_dtype=model given the raw relevance the adapter
    passes in the model dtype (exact) or only the float32 one (rounded once), and with float32 scoring."""
    identical = {"exact": 0, "rounded_once": 0, "float32": 0, "duplicated": 0}
    for seed in SEEDS:
        features, image, text = cdpruner_half_case(seed, dtype)
        raw = official_relevance_half(image, text)
        float32_raw = -(F.normalize(image.float(), dim=-1) @ F.normalize(text.float(), dim=-1).T).mean(dim=1)
        for budget in BUDGETS:
            expected = official_cdpruner_half(features, raw, budget)
            for name, model_raw, options in (
                ("exact", raw.float(), {"score_dtype": "model"}),
                ("rounded_once", None, {"score_dtype": "model"}),
                ("float32", raw.float(), {}),
            ):
                signals = InputSignals(grid=(24, 24), features=features.float(), text_relevance=float32_raw,
                                       model_text_relevance=model_raw, model_dtype=dtype)  # fmt: skip
                identical[name] += get_selector("cdpruner", **options).select(signals, budget).kept.tolist() == expected
        features, image, text = cdpruner_half_case(seed, dtype, duplicated=True)
        raw, budget = official_relevance_half(image, text), BUDGETS[seed % len(BUDGETS)]
        signals = InputSignals(grid=(24, 24), features=features.float(), text_relevance=raw.float(),
                               model_text_relevance=raw.float(), model_dtype=dtype)  # fmt: skip
        selected = get_selector("cdpruner", score_dtype="model").select(signals, budget).kept.tolist()
        identical["duplicated"] += selected == official_cdpruner_half(features, raw, budget)
    return identical


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_cdpruner_model_dtype_reproduces_the_official_half_precision_relevance(dtype):
    """score_dtype=model from the raw relevance computed in half (model_text_relevance): 30 of 30 random and 10 of
    10 duplicated-token cases per dtype.
    Measured: from the float32 raw relevance rounded once, 28 (fp16) and 23 (bf16) of 30; float32 throughout
    29 and 8 of 30."""
    identical = cdpruner_half_agreement(dtype)
    assert identical["exact"] == 30 == FIDELITY["cdpruner"].half_cases[dtype_name(dtype)]
    assert identical["duplicated"] == 10
    assert identical["rounded_once"] < 30 and identical["float32"] < 30


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_the_adapter_passes_the_relevance_computed_in_the_model_dtype(tiny_llava_path, tmp_path, dtype):
    """LLaVA's adapter passes model_text_relevance in the model dtype beside the float32 text_relevance."""
    from dataclasses import dataclass

    from tiny_models import QUESTIONS, WORDS, RecordingInputSelector, random_image

    from prune_audit.models import load_vlm
    from prune_audit.models.build import build_clip

    @dataclass
    class RelevanceRecording(RecordingInputSelector):
        requires = frozenset({"features", "text_relevance"})

    clip = build_clip(tmp_path / "clip", words=WORDS, vision_hidden_size=64)
    vlm = load_vlm(tiny_llava_path, device="cpu", dtype=dtype, clip_text=clip)
    selector = RelevanceRecording()
    vlm.answer([vlm.prepare(random_image(0), QUESTIONS[0])], selector, 8)
    signals = selector.records[-1]
    assert signals.model_text_relevance.dtype == signals.text_relevance.dtype == torch.float32
    assert torch.equal(signals.model_text_relevance, signals.model_text_relevance.to(dtype).float())
    ulp = signals.text_relevance.abs().max() * torch.finfo(dtype).eps
    assert (signals.model_text_relevance - signals.text_relevance).abs().max() <= 4 * ulp


# --- SparseVLM (Gumpest/SparseVLMs 26a5f488: modelling_sparse_llama.py, utils.py, score.py) -------------------


def official_sparse_attention_of(
    queries: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, gpu_dot: bool = False
) -> torch.Tensor:
    """(H, R, L) rows of ``utils.scaled_dot_product_attention`` in the tensors' dtype: ``q @ k^T`` rounded,
    times ``1/sqrt(d)`` rounded, the causal bias (0 or -inf) added, the softmax of the half logits.

    Args:
        queries: (H, R, d) the queries of the sequence positions ``rows`` (R,); keys: (H, L, d).
        gpu_dot: ``q @ k^T`` as a GPU's half GEMM computes it (float32 accumulation, rounded once) instead of
            the CPU kernel, which rounds a few fp16 dot products differently.
    """
    if gpu_dot:
        dots = (queries.float() @ keys.float().transpose(-2, -1)).to(queries.dtype)
    else:
        dots = queries @ keys.transpose(-2, -1)
    logits = dots * (1 / queries.shape[-1] ** 0.5)
    future = torch.arange(keys.shape[-2])[None, :] > rows[:, None]
    bias = torch.zeros(future.shape, dtype=queries.dtype).masked_fill(future, float("-inf"))
    probs = torch.softmax(logits + bias, dim=-1)
    assert logits.dtype == probs.dtype == queries.dtype
    return probs


def sparsevlm_half_case(seed: int, dtype: torch.dtype, ties: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The official attention (H, T, L) of the text rows after the image and the input embeddings (L, 4096).

    ``ties="duplicated"``: a quarter of the keys repeat others, so whole attention columns tie exactly;
    ``"quantised"``: keys rounded to integers, so many logits and probabilities coincide."""
    generator = torch.Generator().manual_seed(4000 + seed)
    length = PREFIX + TOKENS + TEXT
    rows = torch.arange(PREFIX + TOKENS, length)
    queries = torch.randn(HEADS, rows.numel(), HEAD_DIM, generator=generator).to(dtype)
    keys = torch.randn(length, HEADS, HEAD_DIM, generator=generator)
    if ties == "duplicated":
        keys = duplicate_rows(keys, generator)
    elif ties == "quantised":
        keys = keys.round()
    probs = official_sparse_attention_of(queries, keys.transpose(0, 1).to(dtype), rows)
    embeddings = (0.1 * torch.randn(length, LLM_DIM, generator=generator)).to(dtype)
    return probs, embeddings


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


@pytest.fixture(scope="module")
def tiny_llava_path(tmp_path_factory):
    from tiny_models import WORDS

    from prune_audit.models.llava import LlavaModel

    return LlavaModel.build_tiny(tmp_path_factory.mktemp("fidelity_half") / "llava", words=WORDS, text_layers=2, seed=3)


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


# --- V2Drop (xuyang-liu16/V2Drop 89eddbb2, llava/model/language_model/V2Drop.py) ----------------------------------


def official_v2drop_half(current: torch.Tensor, previous: torch.Tensor, keep: int) -> list[int]:
    """``torch.norm(current - previous, p=2, dim=-1)`` in the states' dtype (difference and norm rounded), topk."""
    variation = torch.norm(current - previous, p=2, dim=-1)
    assert variation.dtype == current.dtype
    return sorted(torch.topk(variation, keep).indices.tolist())


def v2drop_half_agreement(dtype: torch.dtype) -> dict[str, int]:
    """Random cases (and duplicated-row ones, one budget per seed) identical to the official kept set."""
    identical = dict.fromkeys((*OPTION_SETS, "duplicated"), 0)
    for seed in SEEDS:
        generator = torch.Generator().manual_seed(6000 + seed)
        previous = torch.randn(TOKENS, LLM_DIM, generator=generator)
        current = previous + 0.05 * torch.randn(TOKENS, LLM_DIM, generator=generator)
        for duplicated in (False, True):
            if duplicated:  # duplicated updates: exact ties in the variation
                previous, current = duplicate_rows(torch.stack([previous, current], dim=1), generator).unbind(dim=1)
            current_half, previous_half = current.to(dtype), previous.to(dtype)
            signals = LayerSignals(alive=torch.arange(TOKENS), grid=(24, 24), layer=3, num_layers=32,
                                   hidden_states=current_half.float(), previous_hidden_states=previous_half.float(),
                                   model_dtype=dtype)  # fmt: skip
            for budget in (BUDGETS[seed % len(BUDGETS)],) if duplicated else BUDGETS:
                expected = official_v2drop_half(current_half, previous_half, budget)
                for name, options in ({"duplicated": EXACT} if duplicated else OPTION_SETS).items():
                    kept = get_selector("v2drop", **options).prune(Stage(3, budget), signals, {}).tolist()
                    identical[name] += kept == expected
    return identical


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_v2drop_model_dtype_reproduces_the_official_half_precision_variation(dtype):
    """score_dtype=model + ties=topk: 30 of 30 random and 10 of 10 duplicated-row cases per dtype; measured with
    lower-index ties 5 (fp16) and 0 (bf16) of 30, float32 differences 5 and 0 of 30. (The norm is torch's half
    reduction itself: a float32 norm of the rounded difference, rounded once, differed in 7 of 30 fp16 cases.)"""
    identical = v2drop_half_agreement(dtype)
    assert identical["exact"] == 30 == FIDELITY["v2drop"].half_cases[dtype_name(dtype)]
    assert identical["duplicated"] == 10
    assert max(identical["lower"], identical["float32"]) < 30


# --- FastV / PDrop: the CPU fp16 attention GEMM (pkunlp-icler/FastV d1659729, LLaVA-era eager LlamaAttention) -------


def fastv_cpu_gemm_case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The official eager attention of one prompt run on this CPU in ``dtype`` (``matmul`` of the half queries and
    keys, ``/ sqrt(d)``, float32 softmax rounded), and the probe's rows of the text after the image: the same with
    ``q.k`` accumulated in float32 and rounded once (as GPU half GEMMs). Both (H, rows, L)."""
    generator = torch.Generator().manual_seed(7000 + seed)
    length = PREFIX + TOKENS + TEXT
    queries = torch.randn(HEADS, length, HEAD_DIM, generator=generator).to(dtype)
    keys = torch.randn(HEADS, length, HEAD_DIM, generator=generator).to(dtype)
    future = ~torch.ones(length, length, dtype=torch.bool).tril()
    logits = (torch.matmul(queries, keys.transpose(1, 2)) / HEAD_DIM**0.5).masked_fill(future, float("-inf"))
    official = torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype)
    rows = torch.arange(PREFIX + TOKENS, length)
    dots = (queries[:, rows].float() @ keys.float().transpose(1, 2)).to(dtype)
    probe = ((dots.float() / HEAD_DIM**0.5).to(dtype).float()).masked_fill(future[rows], float("-inf"))
    return official[:, rows], torch.softmax(probe, dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_fastv_and_pdrop_keep_the_official_set_despite_the_cpu_fp16_gemm(dtype):
    """A CPU's half GEMM may round a few q.k products differently from a float32-accumulated product rounded once
    (the probe's, and a GPU's); how many depends on the CPU's kernels (``python -m benchmarks.half_kernels``).
    Kept sets of FastV and PDrop (score_dtype=model, ties=topk) still equal the official topk of the CPU-run
    official attention in 30 of 30 cases each."""
    image = slice(PREFIX, PREFIX + TOKENS)
    identical = dict.fromkeys(("fastv", "pdrop"), 0)
    for seed in SEEDS:
        official, probe = fastv_cpu_gemm_case(seed, dtype)
        signals = LayerSignals(alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32,
                               text_probs=probe[:, :, image].float(), model_dtype=dtype)  # fmt: skip
        scores = official.mean(dim=0)[-1, image]  # the official head mean in half, last prompt row
        for budget in BUDGETS:
            expected = sorted(torch.topk(scores, budget).indices.tolist())
            for name in identical:
                identical[name] += get_selector(name, **EXACT).prune(Stage(2, budget), signals, {}).tolist() == expected
    assert identical == {"fastv": 30, "pdrop": 30}


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
