"""CDPruner: the fast greedy MAP against naive log-determinants and the one-row-per-pick greedy, and the official
normalisation and relevance in half precision (Theia-4869/CDPruner 9541616c, llava_arch.py::encode_images)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from rederivation import (  # noqa: F401 (tiny_llava_path: fixture)
    BUDGETS,
    CASES,
    FIDELITY,
    HALF_DTYPES,
    LLM_DIM,
    SEEDS,
    TOKENS,
    agreement,
    dtype_name,
    duplicate_rows,
    tiny_llava_path,
)
from selector_cases import (
    SPECULATION_CASES,
    clustered_features,
    cosine_matrix,
    first_within_tolerance,
    random_generator,
)

from prune_audit.pruners import InputSignals, get_selector, similarity
from prune_audit.pruners.cdpruner import greedy_dpp_map
from prune_audit.pruners.similarity import TIE_TOLERANCE, unit_rows


def naive_dpp_greedy(kernel: torch.Tensor, k: int) -> list[int]:
    """Each step: argmax_i det L[S + i] by explicit determinants (float64)."""
    picks: list[int] = []
    for _ in range(k):
        determinants = torch.full((kernel.shape[0],), -math.inf, dtype=torch.float64)
        for i in range(kernel.shape[0]):
            if i not in picks:
                index = torch.tensor(picks + [i])
                determinants[i] = torch.linalg.det(kernel[index][:, index])
        picks.append(first_within_tolerance(determinants))
    return picks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cdpruner_fast_greedy_equals_naive_log_det_greedy(seed):
    factor = torch.randn(12, 9, generator=random_generator(seed), dtype=torch.float64)
    kernel = factor @ factor.T
    fast = greedy_dpp_map(lambda j: kernel[j].float(), torch.diagonal(kernel).float(), 5)
    assert fast.tolist() == naive_dpp_greedy(kernel, 5)


@pytest.mark.parametrize("theta", [None, 0.5])
def test_cdpruner_selector_uses_relevance_scaled_cosine_kernel(theta):
    generator = random_generator(3)
    features = torch.randn(12, 8, generator=generator)
    raw = torch.randn(12, generator=generator)
    relevance = (raw - raw.min() + 1e-6) / (raw.max() - raw.min())
    if theta is not None:
        relevance = torch.exp(theta / (2 * (1 - theta)) * relevance)
    kernel = relevance.double()[:, None] * cosine_matrix(features) * relevance.double()[None, :]
    selection = get_selector("cdpruner", theta=theta).select(
        InputSignals(grid=(3, 4), features=features, text_relevance=raw), 5
    )
    assert selection.kept.tolist() == sorted(naive_dpp_greedy(kernel, 5))


def one_row_per_pick_dpp(kernel_row, diagonal: torch.Tensor, k: int) -> tuple[list[int], int]:
    """Fast greedy MAP as it was before the speculative rows: one kernel row and one correction per pick.

    Returns the picks and the first step whose two best gains are within ``TIE_TOLERANCE``
    (relative) of each other (``k`` if none): a near-tie at float32 row noise, where the pick
    depends on the last bits of the rows (on AVX-512 MKL a row's bits depend on how many rows
    share its matrix product).
    """
    floor = 1e-6 * float(diagonal.max())
    gains = torch.where(diagonal > floor, diagonal, 0.0)
    vectors = torch.zeros(k, diagonal.numel())
    picks: list[int] = []
    first_near_tie = k
    for step in range(k):
        scores = gains.clone()
        scores[picks] = -math.inf
        top = torch.topk(scores, min(2, scores.numel())).values
        if first_near_tie == k and top.numel() == 2 and top[0] > floor and top[0] - top[1] < TIE_TOLERANCE * top[0]:
            first_near_tie = step
        best = int(torch.argmax(scores))
        picks.append(best)
        if gains[best] > floor:
            vectors[step] = (kernel_row(best) - vectors[:step, best] @ vectors[:step]) / math.sqrt(float(gains[best]))
            gains = gains - vectors[step] ** 2
            gains = torch.where(gains > floor, gains, 0.0)
    return picks, first_near_tie


@pytest.mark.parametrize("seed, tokens, dim, budget", SPECULATION_CASES)
@pytest.mark.parametrize("rows", [8, 32, 128])
def test_cdpruner_speculative_rows_keep_the_one_row_per_pick_order(seed, tokens, dim, budget, rows, monkeypatch):
    """Clustered features; a budget above the width (700 / 2, 2048 / 2) exhausts the kernel's rank.

    Identical picks up to the first near-tie (two best gains within TIE_TOLERANCE): past it the
    order depends on the rows' last bits, which need not survive a change of product shape.
    """
    monkeypatch.setattr(similarity, "SPECULATIVE_ROWS", rows)
    unit = unit_rows(clustered_features(seed, tokens, dim))
    relevance = get_selector("cdpruner").relevance(torch.randn(tokens, generator=random_generator(10 + seed)))
    diagonal = relevance**2 * (unit * unit).sum(dim=1)
    expected, near_tie = one_row_per_pick_dpp(lambda j: relevance[j] * relevance * (unit @ unit[j]), diagonal, budget)
    fast = greedy_dpp_map(lambda j: relevance[j, None] * relevance * (unit[j] @ unit.T), diagonal, budget)
    assert fast.tolist()[:near_tie] == expected[:near_tie] and near_tie > budget // 2


def test_cdpruner_exhausted_kernel_gives_lowest_indices_without_nan():
    # rank-1 kernel: after the first (most relevant) pick every conditional gain is 0
    features = torch.ones(10, 4)
    raw = torch.zeros(10)
    raw[7] = 1.0
    kept = get_selector("cdpruner").select(InputSignals(grid=(2, 5), features=features, text_relevance=raw), 4).kept
    assert kept.tolist() == [0, 1, 2, 7]


def test_cdpruner_rejects_theta_outside_unit_interval():
    with pytest.raises(ValueError, match="theta"):
        get_selector("cdpruner", theta=1.0)


# --- half precision ---------------------------------------------------------------------------------------------------


CLIP_EMBED = 768  # CLIP ViT-L/14's projection width: image and text embeddings of CDPruner's relevance


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


# --- official float32 and half-precision normalisation (tests/pruners/rederivation.py::official_cdpruner) -------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cdpruner_model_dtype_reproduces_the_official_half_precision_normalisation(dtype):
    """The official code normalises fp16/bf16 projector outputs and its relevance before widening them;
    score_dtype=model does too.

    Measured: 30 of 30 in both dtypes with score_dtype=model; float32 normalisation 26 (fp16) and 9 (bf16).
    """
    assert agreement("cdpruner", dtype, score_dtype="model") == len(CASES) == FIDELITY["cdpruner"].agreement_cases
    assert agreement("cdpruner", dtype) < len(CASES)
