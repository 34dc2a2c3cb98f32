"""Reference-exact variants against independent re-implementations of the official algorithms (issue 14).

Each ``official_*`` function below is written from the official code's math (the
repository and commit are in ``docs/fidelity.md``), shares no code with the package,
and runs on random cases at realistic sizes (576 tokens, 1024/4096-dim). The counts
asserted here are the "measured agreement" quoted in the fidelity table.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from prune_audit.pruners import InputSignals, LayerSignals, Stage, get_selector
from prune_audit.pruners.fidelity import fidelity_entries

FIDELITY = fidelity_entries()  # each selector class's row, by name

TOKENS = 576
BUDGETS = (64, 128, 192)
# 30 cases: 10 seeds x 3 budgets, the feature size alternating 1024 / 4096
CASES = [(seed, budget, 1024 if seed % 2 else 4096) for seed in range(10) for budget in BUDGETS]


def features_of(seed: int, dim: int) -> torch.Tensor:
    """(576, dim) LLaVA-like features: a shared direction plus per-token noise (so cosines spread)."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(dim, generator=generator)
    return 0.5 * shared + torch.randn(TOKENS, dim, generator=generator)


# --- DivPrune (vbdi/divprune, llava_arch.py::DivPrune) ---------------------------------------------


def official_divprune(features: torch.Tensor, k: int) -> list[int]:
    """Dense cosine distance in the features' dtype; first pick = argmax of each column's second smallest,
    then argmax of the min over the picks."""
    unit = features / features.norm(dim=1, keepdim=True)
    distance = 1.0 - unit @ unit.T
    picks: list[int] = []
    for step in range(k):
        if step == 0:
            scores = torch.topk(distance, 2, dim=0, largest=False).values[1]
        else:
            scores = distance[torch.tensor(picks)].min(dim=0).values
        picks.append(int(torch.argmax(scores)))
    return sorted(picks)


# --- CDPruner (Theia-4869/CDPruner, llava_arch.py::encode_images) --------------------------------------


def official_cdpruner(features: torch.Tensor, raw: torch.Tensor, k: int) -> list[int]:
    """Dense kernel ``diag(r) S diag(r)`` and the batched fast greedy MAP with a plain argmax, no guard.

    The unit rows and the min-max relevance are computed in the features' dtype (the official relevance is
    half precision too) and then widened, the rest in float32."""
    unit = (features / features.norm(dim=-1, keepdim=True)).float()
    raw = raw.to(features.dtype)
    relevance = ((raw - raw.min() + 1e-6) / (raw.max() - raw.min())).float()
    kernel = relevance[:, None] * (unit @ unit.T) * relevance[None, :]
    vectors = torch.zeros(k, TOKENS)
    gains = torch.diagonal(kernel).clone()
    picks: list[int] = []
    for step in range(k):
        j = int(torch.argmax(gains))
        picks.append(j)
        update = (kernel[j] - vectors[:step, j] @ vectors[:step]) / torch.sqrt(gains[j])
        vectors[step] = update
        gains = gains - update**2
        gains[j] = float("-inf")
    return sorted(picks)


def relevance_of(seed: int) -> torch.Tensor:
    """(576,) raw CDPruner text relevance of a case."""
    return torch.randn(TOKENS, generator=torch.Generator().manual_seed(100 + seed))


@functools.lru_cache(maxsize=None)  # several option sets are compared with the same official picks
def official_kept(name: str, seed: int, budget: int, dim: int, dtype: torch.dtype) -> list[int]:
    features = features_of(seed, dim).to(dtype)
    if name == "divprune":
        return official_divprune(features, budget)
    return official_cdpruner(features, relevance_of(seed), budget)


def agreement(name: str, dtype: torch.dtype = torch.float32, cases: list = CASES, **options) -> int:
    identical = 0
    for seed, budget, dim in cases:
        features = features_of(seed, dim).to(dtype)
        signals = InputSignals(grid=(24, 24), features=features)
        if name == "cdpruner":
            signals = InputSignals(grid=(24, 24), features=features, text_relevance=relevance_of(seed))
        kept = get_selector(name, **options).select(signals, budget).kept.tolist()
        identical += kept == official_kept(name, seed, budget, dim, dtype)
    return identical


@pytest.mark.parametrize("name", ["divprune", "cdpruner"])
def test_plain_argmax_reproduces_the_official_greedy(name):
    assert agreement(name) == len(CASES) == FIDELITY[name].agreement_cases


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cdpruner_model_dtype_reproduces_the_official_half_precision_normalisation(dtype):
    """The official code normalises fp16/bf16 projector outputs and its relevance before widening them;
    score_dtype=model does too.

    Measured: 30 of 30 in both dtypes with score_dtype=model; float32 normalisation 26 (fp16) and 9 (bf16).
    """
    assert agreement("cdpruner", dtype, score_dtype="model") == len(CASES) == FIDELITY["cdpruner"].agreement_cases
    assert agreement("cdpruner", dtype) < len(CASES)


def test_divprune_model_dtype_reproduces_the_official_half_precision_picks():
    """fp16 distances tie often; score_dtype=model computes them as the reference does, float32 does not.

    Half-precision matrix products are slow on CPU: 6 of the 30 cases (1024-dim) run here.
    """
    cases = [case for case in CASES if case[2] == 1024][:6]
    assert agreement("divprune", torch.float16, cases, score_dtype="model") == len(cases)
    assert agreement("divprune", torch.float16, cases) < len(cases)


def test_divprune_model_dtype_reproduces_the_official_bf16_picks():
    """In bf16 (fast on CPU) all 30 cases: score_dtype=model 30 of 30, float32 distances 0 of 30 (measured)."""
    assert agreement("divprune", torch.bfloat16, score_dtype="model") == len(CASES)
    assert agreement("divprune", torch.bfloat16) < len(CASES)


@pytest.mark.parametrize("name", ["divprune", "cdpruner"])
def test_both_tie_rules_are_deterministic_across_thread_counts(name):
    features = features_of(3, 1024)
    signals = InputSignals(grid=(24, 24), features=features, text_relevance=torch.randn(TOKENS))
    threads = torch.get_num_threads()
    for ties in ("argmax", "tolerance"):
        first = get_selector(name, ties=ties).select(signals, 128).kept
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            again = get_selector(name, ties=ties).select(signals, 128).kept
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(first, again)


# --- DART (ZichenWen1/DART, modeling_llama_self.py::get_retained_image_token) ----------------------

PROMPT_PREFIX = 35  # LLaVA-1.5's system prompt + "USER:" before the image
TEXT = 40
HEADS, HEAD_DIM = 32, 128


def dart_case(seed: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer K-1's post-RoPE keys (H, L, d) and the final-normed output (L, dim) of a whole prompt."""
    generator = torch.Generator().manual_seed(seed)
    length = PROMPT_PREFIX + TOKENS + TEXT
    keys = torch.randn(HEADS, length, HEAD_DIM, generator=generator) * (1 + torch.rand(length, 1, generator=generator))
    normed = 0.5 * torch.randn(dim, generator=generator) + torch.randn(length, dim, generator=generator)
    return keys, normed


def official_dart(keys: torch.Tensor, normed: torch.Tensor, budget: int) -> list[int]:
    """Top-4 L1 key norms of image and of following tokens as pivots, visited in ``set`` order; per = budget // 8."""
    start, per = PROMPT_PREFIX, budget // 8
    flat = keys.permute(1, 0, 2).reshape(keys.shape[1], -1)
    image_norms = flat[start : start + TOKENS].norm(p=1, dim=-1)
    query_norms = flat[start + TOKENS :].norm(p=1, dim=-1)
    image_indices = (image_norms.topk(4).indices + start).tolist()
    query_indices = (query_norms.topk(4).indices + start + TOKENS).tolist()
    kept = set(image_indices + query_indices)
    candidates = set(range(start, start + TOKENS)) - set(image_indices)
    for pivot in list(set(image_indices + query_indices)):
        pool = list(candidates)
        similarity = -F.cosine_similarity(normed[pivot], normed[pool], dim=-1)
        picks = [pool[i] for i in similarity.topk(per).indices.tolist()]
        kept.update(picks)
        candidates.difference_update(picks)
    kept.difference_update(query_indices)
    return sorted(index - start for index in kept)


def dart_kept(keys: torch.Tensor, normed: torch.Tensor, budget: int, **options) -> list[int]:
    start = PROMPT_PREFIX
    flat_norms = keys.permute(1, 0, 2).reshape(keys.shape[1], -1).abs().sum(dim=-1)
    image, text = slice(start, start + TOKENS), slice(start + TOKENS, None)
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32,
        key_norms=flat_norms[image], text_key_norms=flat_norms[text],
        normed_hidden_states=normed[image], text_normed_hidden_states=normed[text],
        sequence_index=torch.arange(start, start + TOKENS), text_sequence_index=torch.arange(start + TOKENS, normed.shape[0]),
    )  # fmt: skip
    selector = get_selector("dart", budget_rule="paper", **options)
    stage = Stage(2, selector.paper_keep(budget))
    return selector.prune(stage, signals, {}).tolist()


def dart_agreement() -> dict[str, int]:
    """Cases identical to the official kept set, per ``pivot_order``."""
    identical = {"set": 0, "sequence": 0}
    for seed, budget, dim in CASES:
        keys, normed = dart_case(seed, dim)
        expected = official_dart(keys, normed, budget)
        for order in identical:
            identical[order] += dart_kept(keys, normed, budget, pivot_order=order) == expected
    return identical


def test_dart_set_order_reproduces_the_official_iteration():
    identical = dart_agreement()
    assert identical["set"] == len(CASES) == FIDELITY["dart"].agreement_cases
    assert identical["sequence"] < len(CASES)  # the ascending default differs from the official order


# --- score_dtype="model" ---------------------------------------------------------------------------------


def test_model_dtype_scores_rank_the_rounded_probabilities():
    """FastV in fp16 as the reference: fp16 probabilities, head mean, fp16 score; ties to the lower index."""
    generator = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(32, 8, TOKENS + 60, generator=generator) * 0.02, dim=-1)[..., :TOKENS]
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32, text_probs=probs, model_dtype=torch.float16
    )
    reference = probs.half().float()[:, -1].mean(dim=0).half().float()
    expected = torch.sort(torch.sort(-reference, stable=True).indices[:128]).values
    kept = get_selector("fastv", score_dtype="model").prune(Stage(2, 128), signals, {})
    assert torch.equal(kept, expected)
    assert not torch.equal(kept, get_selector("fastv").prune(Stage(2, 128), signals, {}))


# --- signal_layer="previous" on a tiny LLaVA: the attention layer K-1 computed (FastV, SparseVLM) ----------


@pytest.fixture(scope="module")
def tiny_llava_paths(tmp_path_factory):
    """A tiny LLaVA and its CLIP text tower, built once per module."""
    from tiny_models import WORDS

    from prune_audit.models.build import build_clip
    from prune_audit.models.llava import LlavaModel

    root = tmp_path_factory.mktemp("fidelity")
    llava = LlavaModel.build_tiny(root / "llava", words=WORDS, text_layers=4, seed=3)
    return llava, build_clip(root / "clip", words=WORDS, vision_hidden_size=64)


@pytest.fixture(scope="module")
def tiny_llava(tiny_llava_paths):
    from tiny_models import QUESTIONS, random_image
    from transformers import LlavaForConditionalGeneration

    from prune_audit.models import load_vlm

    llava, clip = tiny_llava_paths
    vlm = load_vlm(llava, device="cpu", clip_text=clip)
    eager = LlavaForConditionalGeneration.from_pretrained(llava, attn_implementation="eager").eval()
    items = [vlm.prepare(random_image(seed), question) for seed, question in enumerate(QUESTIONS)]
    outputs = []
    for item in items:
        with torch.no_grad():
            outputs.append(eager(input_ids=item.input_ids[None], pixel_values=item.pixel_values[None],
                                 output_attentions=True, output_hidden_states=True))  # fmt: skip
    return vlm, items, outputs


def top_k_sorted(scores: torch.Tensor, k: int) -> list[int]:
    """The k largest, ties to the lower index (torch.topk leaves their order unspecified), ascending."""
    return sorted(torch.sort(-scores, stable=True).indices[:k].tolist())


@pytest.mark.parametrize("signal_layer", ["previous", "current"])
def test_fastv_ranks_with_the_attention_of_the_layer_before_the_cut(tiny_llava, signal_layer):
    vlm, items, outputs = tiny_llava
    selector = get_selector("fastv", budget_rule="paper", signal_layer=signal_layer)
    for item, output in zip(items, outputs):
        prefill, _ = vlm.prefill([item], selector, 20)
        (layer,) = prefill.stage_layers[0]
        source = layer - 1 if signal_layer == "previous" else layer  # nothing is pruned before the cut
        start, end = item.image_span
        scores = output.attentions[source][0, :, -1, start:end].mean(dim=0)
        assert prefill.kept_stages[0][0] == top_k_sorted(scores, 20)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_adapter_gives_input_selectors_the_model_dtype(tiny_llava_paths, dtype):
    """score_dtype="model" of cls_attn/DivPrune/SCOPE rounds to what the adapter passes: the model's dtype."""
    from tiny_models import QUESTIONS, RecordingInputSelector, random_image

    from prune_audit.models import load_vlm

    vlm = load_vlm(tiny_llava_paths[0], device="cpu", dtype=dtype)
    selector = RecordingInputSelector()
    vlm.answer([vlm.prepare(random_image(0), QUESTIONS[0])], selector, 8)
    signals = selector.records[-1]
    assert signals.model_dtype == dtype
    # the probabilities come in float32; score_dtype="model" rounds them and their head mean to the model dtype
    scores = signals.cls_attention.to(dtype).float().mean(dim=0).to(dtype).float()
    expected = top_k_sorted(scores, 8)
    assert get_selector("cls_attn", score_dtype="model").select(signals, 8).kept.tolist() == expected
    # DivPrune's distances in the model dtype: the float32 features the adapter passes, cast to it
    rounded = InputSignals(grid=signals.grid, features=signals.features.to(dtype))
    assert (
        get_selector("divprune", score_dtype="model").select(signals, 8).kept.tolist()
        == get_selector("divprune", score_dtype="model").select(rounded, 8).kept.tolist()
    )
    # SCOPE likewise computes in the model dtype of the float32 signals, as on hand-rounded ones
    rounded = InputSignals(
        grid=signals.grid, vision_features=signals.vision_features.to(dtype), cls_attention=signals.cls_attention
    )
    assert (
        get_selector("scope", score_dtype="model").select(signals, 8).kept.tolist()
        == get_selector("scope", score_dtype="model").select(rounded, 8).kept.tolist()
    )


# --- attention and variation scorers at LLaVA sizes (32 heads, 576 image + 40 text tokens, 4096-dim) ---------

HEADS_LLM, TEXT_ROWS = 32, 40


@functools.lru_cache(maxsize=1)  # CASES come grouped by seed: one case serves its three budgets
def attention_case(seed: int) -> dict[str, torch.Tensor]:
    """Eager-style tensors of one prompt: attention rows of the text after the image, hidden states, embeddings."""
    generator = torch.Generator().manual_seed(1000 + seed)
    length = PROMPT_PREFIX + TOKENS + TEXT_ROWS
    logits = torch.randn(HEADS_LLM, TEXT_ROWS, length, generator=generator) * 2
    rows = torch.arange(PROMPT_PREFIX + TOKENS, length)
    logits = logits.masked_fill(torch.arange(length)[None, None, :] > rows[None, :, None], float("-inf"))
    dim = 1024 if seed % 2 else 4096
    return {
        "probs": torch.softmax(logits, dim=-1),  # (H, T, L) causal rows of the text tokens
        "hidden": torch.randn(TOKENS, dim, generator=generator),
        "previous": torch.randn(TOKENS, dim, generator=generator),
        "embeddings": torch.randn(length, dim, generator=generator),
        "cls": torch.softmax(torch.randn(16, TOKENS + 1, generator=generator), dim=-1),  # CLIP CLS row (H, 1 + N)
    }


def official_scores(name: str, case: dict[str, torch.Tensor]) -> torch.Tensor:
    """(576,) the official score of every image token (the official code then takes ``topk``)."""
    image = slice(PROMPT_PREFIX, PROMPT_PREFIX + TOKENS)
    if name == "cls_attn":  # FasterVLM: CLS row of CLIP layer -2, mean over heads, patches only
        return case["cls"][:, 1:].mean(dim=0)
    if name in ("fastv", "pdrop"):  # head mean, last prompt row, image columns
        return case["probs"].mean(dim=0)[-1, image]
    if name == "v2drop":  # L2 norm of the update the previous layer wrote
        return torch.norm(case["hidden"] - case["previous"], dim=-1)
    # SparseVLM: raters from the input embeddings, then head mean, rater rows, image columns, rater mean
    visual, text = case["embeddings"][image], case["embeddings"][PROMPT_PREFIX + TOKENS :]
    weights = torch.softmax(visual @ text.T, dim=-1).mean(dim=0)
    raters = torch.nonzero(weights > weights.mean()).flatten()
    return case["probs"].mean(dim=0)[raters][:, image].mean(dim=0)


def selector_kept(name: str, case: dict[str, torch.Tensor], keep: int) -> list[int]:
    image, text = slice(PROMPT_PREFIX, PROMPT_PREFIX + TOKENS), slice(PROMPT_PREFIX + TOKENS, None)
    if name == "cls_attn":
        signals = InputSignals(grid=(24, 24), cls_attention=case["cls"][:, 1:])
        return get_selector(name).select(signals, keep).kept.tolist()
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32, text_probs=case["probs"][:, :, image],
        hidden_states=case["hidden"], previous_hidden_states=case["previous"],
        embeddings=case["embeddings"][image], text_embeddings=case["embeddings"][text],
    )  # fmt: skip
    return get_selector(name).prune(Stage(2, keep), signals, {}).tolist()


SCORERS = ("cls_attn", "fastv", "pdrop", "v2drop", "sparsevlm")


def test_attention_and_variation_scorers_reproduce_the_official_top_k():
    identical = dict.fromkeys(SCORERS, 0)
    for seed, budget, _ in CASES:
        case = attention_case(seed)  # one case serves every scorer
        for name in SCORERS:
            expected = sorted(official_scores(name, case).topk(budget).indices.tolist())
            identical[name] += selector_kept(name, case, budget) == expected
    assert identical == {name: FIDELITY[name].agreement_cases for name in SCORERS} == dict.fromkeys(SCORERS, len(CASES))


def test_previous_signal_layer_gives_the_probe_of_the_layer_before(tiny_llava):
    """Any selector with signal_layer="previous" (FastV, SparseVLM, DART, E2S) reads layer l-1's attention."""
    from dataclasses import dataclass

    from tiny_models import RecordingLayerSelector

    @dataclass
    class PreviousLayerRecording(RecordingLayerSelector):
        signal_layer: str = "previous"

    vlm, items, outputs = tiny_llava
    item, output = items[1], outputs[1]
    start, end = item.image_span
    for layer in (1, 2, 3):
        selector = PreviousLayerRecording(layer=layer, keep=20)
        vlm.answer([item], selector, 1)
        signals = selector.records[-1]
        assert (signals.text_probs - output.attentions[layer - 1][0, :, end:, start:end]).abs().max() <= 1e-5
        assert torch.equal(signals.sequence_index, torch.arange(start, end))
        assert torch.equal(signals.text_sequence_index, torch.arange(end, item.input_ids.numel()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_dtype_attention_is_the_eager_attention_of_a_half_precision_model(tiny_llava_paths, dtype):
    """score_dtype="model": the probe forms the text rows' attention as the eager attention of a bf16/fp16 model
    does (q.k rounded, scaled and rounded, float32 softmax rounded), bit for bit; rounding float32
    probabilities afterwards does not. The selectors then read these rows (LayerPlan.attention_in_model_dtype)."""
    from dataclasses import dataclass

    from tiny_models import QUESTIONS, RecordingLayerSelector, random_image
    from transformers import LlavaForConditionalGeneration
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from prune_audit.models import load_vlm
    from prune_audit.models.probe import DecoderProbe, single_tensor_rope

    path = tiny_llava_paths[0]
    eager = LlavaForConditionalGeneration.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()
    vlm = load_vlm(path, device="cpu", dtype=dtype)
    item = vlm.prepare(random_image(0), QUESTIONS[1])
    with torch.no_grad():
        output = eager(input_ids=item.input_ids[None], pixel_values=item.pixel_values[None].to(dtype),
                       output_attentions=True, output_hidden_states=True)  # fmt: skip
        hidden = output.hidden_states[0][0]  # the input of decoder layer 0
        language = eager.model.language_model
        cos, sin = language.rotary_emb(hidden[None], torch.arange(hidden.shape[0])[None])
        probe = DecoderProbe(language.layers[0], single_tensor_rope(apply_rotary_pos_emb))
        rows = torch.arange(item.image_span[1], hidden.shape[0])
        eager_rows = output.attentions[0][0][:, rows].float()
        _, in_model_dtype = probe.probabilities(hidden, rows, cos[0], sin[0], in_model_dtype=True)
        _, in_float32 = probe.probabilities(hidden, rows, cos[0], sin[0])
    assert torch.equal(in_model_dtype, eager_rows)
    assert not torch.equal(in_float32.to(dtype).float(), eager_rows)

    @dataclass
    class ModelDtypeRecording(RecordingLayerSelector):
        score_dtype: str = "model"

    selector = ModelDtypeRecording(layer=1, keep=8)
    vlm.answer([item], selector, 1)
    probs = selector.records[-1].text_probs
    assert torch.equal(probs, probs.to(dtype).float())  # the rows as the model dtype holds them


# --- E2S-Pruner: the paper's Table 3 schedules (arXiv 2608.23253, section 5.4) ---------------------------------

# the rows of Table 3 as printed: 576 -> a -> b -> c visual tokens, pruning after layers 3, 17, 22 (1-based)
E2S_TABLE3_ROWS = [(122, 48, 42), (132, 40, 32), (142, 32, 22), (147, 38, 12), (152, 44, 2)]


@pytest.mark.parametrize("row", E2S_TABLE3_ROWS)
def test_every_e2s_table3_row_is_a_preset_averaging_128(row):
    from prune_audit.pruners.schedule import average_visual_tokens

    preset = "table3_" + "_".join(map(str, row))
    stages = get_selector("e2s", budget_rule="paper", schedule_preset=preset).schedule(32, 576, 128)
    assert [(stage.layer, stage.keep) for stage in stages] == list(zip((3, 17, 22), row))
    # layers 0-2 see 576 tokens, 3-16 the first count, 17-21 the second, 22-31 the third
    assert (3 * 576 + 14 * row[0] + 5 * row[1] + 10 * row[2]) / 32 == average_visual_tokens(stages, 32, 576) == 128


# --- VisionZip and SCOPE at CLIP-L/14-336 sizes: layer 22's CLS row (16 heads), 1024-dim states, 64-dim keys ------

CLIP_HEADS, CLIP_HEAD_DIM, CLIP_WIDTH = 16, 64, 1024
SEEDS = sorted({seed for seed, _, _ in CASES})  # 10 seeds x the 3 budgets = the 30 cases


@functools.lru_cache(maxsize=1)  # the three budgets of a seed share its case
def clip_case(seed: int) -> dict[str, torch.Tensor]:
    """CLIP layer 22 of one image, CLS first: CLS-row probs (H, 1 + N), states (1 + N, Dv), keys (H, 1 + N, d)."""
    generator = torch.Generator().manual_seed(2000 + seed)
    logits = torch.randn(CLIP_HEADS, 1 + TOKENS, generator=generator) * 2
    shared_key = torch.randn(CLIP_HEAD_DIM, generator=generator)
    shared_state = 0.5 * torch.randn(CLIP_WIDTH, generator=generator)
    return {
        "cls_row": torch.softmax(logits, dim=-1),
        "hidden": shared_state + torch.randn(1 + TOKENS, CLIP_WIDTH, generator=generator),
        "keys": shared_key + torch.randn(CLIP_HEADS, 1 + TOKENS, CLIP_HEAD_DIM, generator=generator),
    }


def official_visionzip(case: dict[str, torch.Tensor], dominant: int, contextual: int):
    """``CLIPVisionTower_VisionZip.forward`` on one image; ``dominant`` counts CLS (the API passes ``dominant - 1``).

    Written from the selectors spec section 4 (dvlab-research/VisionZip 3151f6df) and the same
    forward as vendored in kinredon/SCOPE ``scope/clip_encoder.py`` (read at a01b98f6).

    Returns the dominant patches (grid indices, ascending), each contextual token's
    ``[target, members...]`` (grid indices) and the (dominant + contextual, Dv) output states.
    """
    hidden = case["hidden"]  # every tensor in its own dtype, as the official code in the model's
    # torch.topk orders exact ties (frequent in half precision) arbitrarily: ties to the lower index, as documented
    top = torch.tensor(top_k_sorted(case["cls_row"][:, 1:].sum(dim=0), dominant - 1)) + 1  # CLS = 0
    chosen = torch.zeros(1 + TOKENS, dtype=torch.bool)
    chosen[0] = chosen[top] = True
    positions = torch.nonzero(~chosen).flatten()  # the remaining tokens in sequence order
    metric = case["keys"].mean(dim=0)[~chosen]
    metric = metric / metric.norm(dim=-1, keepdim=True)
    step = max(1, positions.numel() // contextual)
    target = torch.arange(0, positions.numel(), step)[:contextual]
    is_target = torch.isin(torch.arange(positions.numel()), target)
    assign = (metric[~is_target] @ metric[target].T).argmax(dim=1)
    one_hot = torch.zeros(int((~is_target).sum()), contextual, dtype=hidden.dtype)
    one_hot[torch.arange(one_hot.shape[0]), assign] = 1
    counts = one_hot.sum(dim=0).clamp(min=1)[:, None]
    rest = hidden[~chosen]
    merged = rest[target] + one_hot.T @ rest[~is_target] / counts
    groups = [[int(positions[t]) - 1] + (positions[~is_target][assign == c] - 1).tolist() for c, t in enumerate(target)]
    return sorted((top - 1).tolist()), groups, torch.cat([hidden[chosen], merged])


def visionzip_identical(seed: int, budget: int, dtype: torch.dtype = torch.float32) -> bool:
    """Same dominant set, contextual groups and output vectors as the official forward run in ``dtype``
    (float32: within 1e-5; a half dtype: ``score_dtype=model``, vectors bit for bit)."""
    case = clip_case(seed)
    selector = get_selector("visionzip", score_dtype="float32" if dtype == torch.float32 else "model")
    dominant, contextual = selector.split(budget)
    kept, groups, tokens = official_visionzip(
        {name: value.to(dtype) for name, value in case.items()}, dominant, contextual
    )
    signals = InputSignals(
        grid=(24, 24), cls_attention=case["cls_row"][:, 1:], vision_keys=case["keys"],
        vision_features=case["hidden"][1:], cls_feature=case["hidden"][0], model_dtype=dtype,
    )  # fmt: skip
    selection = selector.select(signals, budget)
    same_sets = selection.kept.tolist() == kept and [s.tolist() for s in selection.sources[dominant:]] == groups
    if dtype != torch.float32:
        return same_sets and torch.equal(selection.vision_tokens.to(dtype), tokens)
    return same_sets and torch.allclose(selection.vision_tokens, tokens, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_visionzip_reproduces_the_official_dominant_and_contextual_tokens(seed):
    """Dominant set, each contextual token's target and members, and every output vector, at 64/128/192."""
    assert [visionzip_identical(seed, budget) for budget in BUDGETS] == [True] * len(BUDGETS)
    assert FIDELITY["visionzip"].agreement_cases == len(CASES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_visionzip_model_dtype_reproduces_the_official_half_precision_forward(dtype):
    """score_dtype=model: dominant set, contextual groups and every output vector (bit for bit) as the official
    forward computes them in fp16/bf16, in 30 of 30 cases."""
    assert sum(visionzip_identical(seed, budget, dtype) for seed in SEEDS for budget in BUDGETS) == len(CASES)


def official_scope(features: torch.Tensor, saliency: torch.Tensor, k: int, alpha: float = 1.0) -> list[int]:
    """``SCOPE(visual_feature_vectors, num_selected_token, cls_attn)`` for one image: picks in pick order.

    Written from kinredon/SCOPE ``scope/clip_encoder.py::SCOPE`` (read at a01b98f6; the spec's commit
    is 6bf73069) with its defaults ALPHA=1.0, COMBINED=multi. Every tensor stays in the dtype of
    ``features`` and ``saliency``, as the official code runs in the model's (fp16/bf16 on GPU).

    Dense cosine ``S``; coverage ``cur`` starts at 0; the gain of column j is
    ``sum_i max(0, S[i, j] - cur[i])`` (picked columns zeroed), times ``saliency ** alpha``,
    picked columns at -inf, plain argmax; then ``cur = max(cur, S[pick])``.
    """
    dtype = features.dtype
    unit = features / features.norm(dim=-1, keepdim=True)
    similarity = unit @ unit.T
    picked = torch.zeros(features.shape[0], dtype=torch.bool)
    coverage = torch.zeros(features.shape[0], dtype=dtype)
    zero = torch.zeros(1, dtype=dtype)
    weight = saliency**alpha
    order = []
    for _ in range(k):
        gains = torch.maximum(zero, similarity.masked_fill(picked[None, :], 0) - coverage[:, None]).sum(dim=0) * weight
        best = int(gains.masked_fill(picked, float("-inf")).argmax())
        order.append(best)
        picked[best] = True
        coverage = torch.maximum(coverage, similarity[best])
    return order


@pytest.mark.parametrize("seed", SEEDS)
def test_scope_reproduces_the_official_greedy(seed):
    """Saliency x facility-location gain at 64/128/192; the picks are nested: one official run serves all three."""
    case = clip_case(seed)
    features, saliency = case["hidden"][1:], case["cls_row"][:, 1:].sum(dim=0)
    order = official_scope(features, saliency, max(BUDGETS))
    signals = InputSignals(grid=(24, 24), vision_features=features, cls_attention=case["cls_row"][:, 1:])
    for ties in ("tolerance", "argmax"):  # random cases have no near-ties: both rules give the official picks
        kept = [get_selector("scope", ties=ties).select(signals, budget).kept.tolist() for budget in BUDGETS]
        assert kept == [sorted(order[:budget]) for budget in BUDGETS], ties
    assert FIDELITY["scope"].agreement_cases == len(CASES)


@functools.lru_cache(maxsize=None)  # the official greedy in half precision is the slow part: run it once per case
def official_scope_in(dtype: torch.dtype, seed: int, saliency_from: str) -> list[int]:
    """The official SCOPE picks in ``dtype`` on the seed's CLIP features, the saliency from the random CLS row
    (``"clip"``) or from the official half-precision CLS attention of :func:`cls_half_case` (``"cls"``)."""
    features = clip_case(seed)["hidden"][1:].to(dtype)
    if saliency_from == "clip":
        saliency = clip_case(seed)["cls_row"][:, 1:].to(dtype).sum(dim=0)
    else:
        saliency = cls_half_case(seed, dtype)[0][:, 1:].sum(dim=0)
    return official_scope(features, saliency, max(BUDGETS))


def scope_half_agreement(dtype: torch.dtype, **options) -> int:
    """Kept sets identical to the official greedy run in ``dtype``, of the 30 random CLIP cases."""
    identical = 0
    for seed in SEEDS:
        case = clip_case(seed)
        features, cls_row = case["hidden"][1:], case["cls_row"][:, 1:]
        order = official_scope_in(dtype, seed, "clip")
        signals = InputSignals(grid=(24, 24), vision_features=features, cls_attention=cls_row, model_dtype=dtype)
        selector = get_selector("scope", **options)
        identical += sum(selector.select(signals, budget).kept.tolist() == sorted(order[:budget]) for budget in BUDGETS)
    return identical


# measured here: fp16 29 of 30 (float32 scoring 23), bf16 30 of 30 (float32 12); a half-precision matrix
# product's entries depend on its accumulation order (about 1 in 10^4 differ by one unit in the last place
# between CPU kernels, as between GPU ones), so the bounds leave one case of slack
SCOPE_HALF_AGREEMENT = {torch.float16: (28, 25), torch.bfloat16: (29, 20)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scope_model_dtype_reproduces_the_official_half_precision_greedy(dtype):
    """score_dtype=model computes SCOPE as the official code in fp16/bf16; float32 scoring diverges on ties."""
    at_least, float32_at_most = SCOPE_HALF_AGREEMENT[dtype]
    assert scope_half_agreement(dtype, score_dtype="model", ties="argmax") >= at_least
    assert scope_half_agreement(dtype, score_dtype="model") >= at_least  # no near-tie finer than half precision
    assert scope_half_agreement(dtype) <= float32_at_most


def official_cls_row(query: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(H, 1 + N) CLS-row probabilities as the official code's eager CLIP attention forms them in ``dtype``.

    The CLIPAttention forward patched in dvlab-research/VisionZip and kinredon/SCOPE (and HF's of
    LLaVA's pinned transformers, which FasterVLM reads): ``q_proj(x) * scale`` in the model dtype,
    ``bmm`` with the keys, ``softmax`` in that dtype.
    """
    scaled = query.to(dtype) * query.shape[-1] ** -0.5
    return torch.softmax((scaled[:, None, :] @ keys.to(dtype).transpose(1, 2))[:, 0], dim=-1)


CLS_SELECTORS = ("cls_attn", "visionzip", "scope")


@functools.lru_cache(maxsize=None)
def cls_half_case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, InputSignals]:
    """The official (H, 1 + N) probabilities in ``dtype`` and the signals an adapter in ``dtype`` passes."""
    generator = torch.Generator().manual_seed(3000 + seed)
    query = torch.randn(CLIP_HEADS, CLIP_HEAD_DIM, generator=generator).to(dtype)
    keys = (torch.randn(CLIP_HEAD_DIM, generator=generator) + torch.randn(
        CLIP_HEADS, 1 + TOKENS, CLIP_HEAD_DIM, generator=generator)).to(dtype)  # fmt: skip
    logits = (query.float()[:, None, :] @ keys.float().transpose(1, 2))[:, 0]  # the adapter's float32 probe
    scaled = (query * CLIP_HEAD_DIM**-0.5).float()  # the official order: the query scaled in the model dtype
    case = clip_case(seed)
    signals = InputSignals(
        grid=(24, 24), cls_attention=torch.softmax(logits * CLIP_HEAD_DIM**-0.5, dim=-1)[:, 1:],
        cls_logits=(scaled[:, None, :] @ keys.float().transpose(1, 2))[:, 0], vision_keys=keys.float(),
        vision_features=case["hidden"][1:], cls_feature=case["hidden"][0], model_dtype=dtype,
    )  # fmt: skip
    return official_cls_row(query, keys, dtype), signals


def cls_half_agreement(
    dtype: torch.dtype, with_logits: bool, score_dtype: str = "model", names: tuple[str, ...] = CLS_SELECTORS
) -> dict[str, int]:
    """Kept sets identical to the official half-precision CLS attention's, of 30 cases, per selector."""
    counts = dict.fromkeys(names, 0)
    for seed in SEEDS:
        probs, signals = cls_half_case(seed, dtype)
        if not with_logits:
            signals = dataclasses.replace(signals, cls_logits=None)
        visionzip = get_selector("visionzip", score_dtype=score_dtype)
        for budget in BUDGETS:
            expected = {
                "cls_attn": lambda: top_k_sorted(probs[:, 1:].mean(dim=0), budget),
                "visionzip": lambda: top_k_sorted(probs[:, 1:].sum(dim=0), visionzip.split(budget)[0] - 1),
                "scope": lambda: sorted(official_scope_in(dtype, seed, "cls")[:budget]),
            }
            for name in counts:
                selector = visionzip if name == "visionzip" else get_selector(name, score_dtype=score_dtype)
                counts[name] += selector.select(signals, budget).kept.tolist() == expected[name]()
    return counts


# measured here (cls_attn, visionzip's dominant set, scope, of 30): fp16 30/30/28 from the logits, 29/29/22 from
# the rounded float32 probabilities, 29/29/21 in float32; bf16 30/30/30, 18/14/14 and 16/9/3
CLS_HALF_AT_LEAST = {torch.float16: {"cls_attn": 30, "visionzip": 30, "scope": 27},
                     torch.bfloat16: {"cls_attn": 30, "visionzip": 30, "scope": 29}}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cls_logits_reproduce_the_official_half_precision_cls_attention(dtype):
    """score_dtype=model recomputes the CLS probabilities from the logits in the model dtype, as the official
    eager attention does; rounding float32 probabilities instead misses half-precision ties (bf16 above all)."""
    counts = cls_half_agreement(dtype, with_logits=True)
    assert all(counts[name] >= CLS_HALF_AT_LEAST[dtype][name] for name in counts), counts
    if dtype == torch.bfloat16:
        assert cls_half_agreement(dtype, with_logits=False, names=("cls_attn",))["cls_attn"] < len(CASES)
        assert cls_half_agreement(dtype, True, score_dtype="float32", names=("cls_attn",))["cls_attn"] < len(CASES)


def test_scope_model_dtype_refuses_gap_power():
    with pytest.raises(ValueError, match="gap_power=1"):
        get_selector("scope", score_dtype="model", gap_power=2.0)


def test_scope_argmax_takes_the_first_exact_maximum_and_tolerance_the_lower_near_tie():
    """Two candidates 1e-7 apart: the official plain argmax takes the larger, the tolerance rule the lower index."""
    from prune_audit.pruners.similarity import facility_location_greedy

    unit = torch.eye(3)  # three orthogonal tokens: each covers only itself, every gain is its weight
    weights = torch.tensor([1.0, 1.0 + 1e-6, 0.5])
    assert facility_location_greedy(unit, 1, candidate_weights=weights, tolerance=0.0)[0].tolist() == [1]
    assert facility_location_greedy(unit, 1, candidate_weights=weights)[0].tolist() == [0]


# --- VisPruner (Theia-4869/VisPruner aefa01ad, llava_arch.py::encode_images) ------------------------


def official_vispruner(
    attentions: torch.Tensor, features: torch.Tensor, budget: int, gpu_arithmetic: bool = False, ratio: float = 0.5
) -> list[int]:
    """``encode_images`` on one image in the dtype of its inputs: attentions (H, N), features (N, Dv).

    Written from the official code: head mean, descending argsort, ``int(T * r)`` important,
    then rounds of alternate A/B matching on the unit features, dropping the ``min(8, R - T_div)``
    A tokens with the highest best match. ``argsort`` leaves exact ties unspecified: stable here
    (ties to the lower position), as documented. ``gpu_arithmetic``: the feature norms and the
    A-B cosines accumulated in float32 and rounded once, as a GPU's half reductions and GEMMs
    compute them (CPU fp16 kernels round about 1 norm in 576 and 6 cosines in 10^4 differently).
    """
    order = torch.argsort(attentions.mean(dim=0), descending=True, stable=True)
    important_count = int(budget * ratio)
    diverse_count = budget - important_count
    important, residual = order[:important_count], order[important_count:]
    norms = features.float().norm(dim=-1, keepdim=True).to(features.dtype) if gpu_arithmetic else features.norm(
        dim=-1, keepdim=True)  # fmt: skip
    normalised = features / norms
    while diverse_count > 0:
        r = min(8, residual.shape[0] - diverse_count)
        if r <= 0:
            break
        tokens = normalised[residual]
        a, b = (tokens[::2].float(), tokens[1::2].float()) if gpu_arithmetic else (tokens[::2], tokens[1::2])
        scores = (a @ b.transpose(-1, -2)).to(tokens.dtype).max(dim=-1).values
        distinct = torch.argsort(scores, descending=True, stable=True)[r:]
        residual = torch.cat([residual[::2][distinct], residual[1::2]])
    return sorted(torch.cat([important, residual]).tolist())


def vispruner_agreement(dtype: torch.dtype, gpu_arithmetic: bool = True) -> int:
    """Kept sets identical to the official forward run in ``dtype`` (half: ``score_dtype=model``), of 30."""
    selector = get_selector("vispruner", score_dtype="float32" if dtype == torch.float32 else "model")
    identical = 0
    for seed, budget, _ in CASES:
        case = clip_case(seed)
        attentions, features = case["cls_row"][:, 1:], case["hidden"][1:]
        signals = InputSignals(grid=(24, 24), cls_attention=attentions, vision_features=features, model_dtype=dtype)
        expected = official_vispruner(attentions.to(dtype), features.to(dtype), budget, gpu_arithmetic)
        identical += selector.select(signals, budget).kept.tolist() == expected
    return identical


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_vispruner_reproduces_the_official_important_and_diverse_tokens(dtype):
    """30 of 30 in float32, and with score_dtype=model against the official code in fp16 / bf16 (GPU arithmetic)."""
    assert vispruner_agreement(dtype) == len(CASES) == FIDELITY["vispruner"].agreement_cases


def test_vispruner_float32_scoring_misses_the_half_precision_ties():
    float32 = get_selector("vispruner")
    case = clip_case(0)
    attentions, features = case["cls_row"][:, 1:], case["hidden"][1:]
    signals = InputSignals(
        grid=(24, 24), cls_attention=attentions, vision_features=features, model_dtype=torch.bfloat16
    )
    official = official_vispruner(attentions.bfloat16(), features.bfloat16(), 64, gpu_arithmetic=True)
    assert float32.select(signals, 64).kept.tolist() != official


def test_vispruner_odd_residual_gives_the_extra_member_to_a():
    """Budgets 63/65/67 at ratio 0.5 leave an odd residual (545, 543, 543), where the official indexing fails."""
    case = clip_case(1)
    signals = InputSignals(grid=(24, 24), cls_attention=case["cls_row"][:, 1:], vision_features=case["hidden"][1:])
    for budget in (63, 65, 67):
        kept = get_selector("vispruner").select(signals, budget).kept
        assert kept.numel() == budget == torch.unique(kept).numel()


# --- ToMe (facebookresearch/ToMe af95e4b1, tome/merge.py) -------------------------------------------


def official_tome(features: torch.Tensor, budget: int) -> tuple[list[list[int]], torch.Tensor]:
    """Rounds of ``bipartite_soft_matching`` + ``merge_wavg`` + ``merge_source`` on one image (batch of 1).

    Written from the official functions: metric normalised, A = even / B = odd positions, ``r``
    capped at half the tokens, the A tokens with the highest best score merge into their best B
    by ``scatter_reduce(sum)`` of ``x * size`` over the summed sizes, output ``[unmerged, B]``; the
    source matrix (one-hot rows, merged with ``amax``) says which cells each token carries.
    ``argsort`` is stable here (ties to the lower position), as documented.
    """
    x, size = features[None], torch.ones(1, features.shape[0], 1)
    source = torch.eye(features.shape[0])[None]
    while x.shape[1] > budget:
        r = min(x.shape[1] - budget, x.shape[1] // 2)
        metric = x / x.norm(dim=-1, keepdim=True)
        scores = metric[..., ::2, :] @ metric[..., 1::2, :].transpose(-1, -2)
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True, stable=True)[..., None]
        unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

        def merge(values: torch.Tensor, mode: str) -> torch.Tensor:
            src, dst = values[..., ::2, :], values[..., 1::2, :]
            n, t1, c = src.shape
            unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
            src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
            return torch.cat([unm, dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)], dim=1)

        x, size, source = merge(x * size, "sum"), merge(size, "sum"), merge(source, "amax")
        x = x / size
    groups = [torch.nonzero(row).flatten().tolist() for row in source[0]]
    return groups, x[0]


def tome_identical(seed: int, budget: int, dim: int) -> bool:
    features = features_of(seed, dim)
    groups, tokens = official_tome(features, budget)
    selection = get_selector("tome").select(InputSignals(grid=(24, 24), features=features), budget)
    same_groups = [group.tolist() for group in selection.sources] == groups
    return same_groups and torch.allclose(selection.llm_tokens, tokens, rtol=1e-5, atol=1e-5)


def test_tome_reproduces_the_official_merging_rounds():
    """Every output token's cells and vector (within 1e-5) as the official rounds, at 64/128/192."""
    assert sum(tome_identical(seed, budget, dim) for seed, budget, dim in CASES) == len(CASES)
    assert FIDELITY["tome"].agreement_cases == len(CASES)


# --- ties=topk: torch.topk's own order among exact ties, in the dtype the official code ranks in --------------


def official_half_topk(scores: torch.Tensor, k: int) -> list[int]:
    """The official selection: ``torch.topk`` on half-precision scores (its order among exact ties), as a mask."""
    return sorted(torch.topk(scores, k).indices.tolist())


def ties_agreement(dtype: torch.dtype, ties: str) -> dict[str, int]:
    """Kept sets identical to the official half-precision ``topk`` of 30 cases: cls_attn and VisionZip's dominant
    set on the official half CLS attention, FastV and PDrop on half text-attention rows (score_dtype=model)."""
    counts = dict.fromkeys(("cls_attn", "visionzip", "fastv", "pdrop"), 0)
    image = slice(PROMPT_PREFIX, PROMPT_PREFIX + TOKENS)
    for seed in SEEDS:
        probs, signals = cls_half_case(seed, dtype)
        case = attention_case(seed)
        half_rows = case["probs"].to(dtype)
        layer = LayerSignals(
            alive=torch.arange(TOKENS),
            grid=(24, 24),
            layer=2,
            num_layers=32,
            text_probs=half_rows[:, :, image].float(),
            model_dtype=dtype,
        )
        for budget in BUDGETS:
            cls_attn = get_selector("cls_attn", score_dtype="model", ties=ties)
            visionzip = get_selector("visionzip", score_dtype="model", ties=ties)
            dominant = visionzip.split(budget)[0] - 1
            zip_kept = visionzip.select(signals, budget).kept.tolist()
            counts["cls_attn"] += cls_attn.select(signals, budget).kept.tolist() == official_half_topk(
                probs[:, 1:].mean(dim=0), budget
            )
            counts["visionzip"] += zip_kept == official_half_topk(probs[:, 1:].sum(dim=0), dominant)
            for name in ("fastv", "pdrop"):  # head mean of the last prompt row over the image columns, in half
                kept = get_selector(name, score_dtype="model", ties=ties).prune(Stage(2, budget), layer, {})
                counts[name] += kept.tolist() == official_half_topk(half_rows.mean(dim=0)[-1, image], budget)
    return counts


# measured here, of 30 (cls_attn, visionzip, fastv, pdrop): ties=lower fp16 27/29/28/28, bf16 18/16/23/23
TIES_LOWER_AT_MOST = {torch.float16: 29, torch.bfloat16: 23}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ties_topk_reproduces_the_official_half_precision_topk(dtype):
    """With ties=topk and score_dtype=model the kept sets are the official torch.topk's in 30 of 30 cases each;
    the deterministic lower-index rule differs wherever half precision makes exact ties."""
    assert ties_agreement(dtype, "topk") == dict.fromkeys(("cls_attn", "visionzip", "fastv", "pdrop"), len(CASES))
    assert max(ties_agreement(dtype, "lower").values()) <= TIES_LOWER_AT_MOST[dtype]
    for name in ("cls_attn", "visionzip", "fastv", "pdrop"):
        assert "ties=topk" in FIDELITY[name].exact
