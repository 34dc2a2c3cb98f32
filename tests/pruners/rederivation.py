"""Pieces shared by the tests that re-derive several selectors' official code at LLaVA-1.5 shapes.

576 visual tokens (24 x 24), CLIP-L's 16 heads over 1 + 576 positions and 23 layers up to the feature layer,
32 decoder heads x 128, 10 seeds x budgets 64/128/192. Half precision: the official attention of SparseVLM's and
FastV's text rows, CLIP's half attention, the agreement count of HiPrune's and VScan's two-row scans. Float32 and
half: the official DivPrune and CDPruner greedies, CLIP layer-22 cases (VisionZip, SCOPE, VisPruner, cls_attn) and
SCOPE's official greedy on them, the tiny LLaVAs the adapter tests run.
"""

from __future__ import annotations

import functools

import pytest
import torch

from prune_audit.pruners import InputSignals, get_selector
from prune_audit.pruners.fidelity import fidelity_entries

FIDELITY = fidelity_entries()  # each selector class's row, by name

GRID, TOKENS = (24, 24), 576
BUDGETS = (64, 128, 192)
SEEDS = range(10)
# 30 cases: 10 seeds x 3 budgets, the feature size alternating 1024 / 4096
CASES = [(seed, budget, 1024 if seed % 2 else 4096) for seed in range(10) for budget in BUDGETS]
HALF_DTYPES = [torch.float16, torch.bfloat16]
PREFIX = 35  # LLaVA-1.5's system prompt + "USER:" before the image
TEXT = 40  # question and template suffix after the image
LLM_DIM, HEADS, HEAD_DIM = 4096, 32, 128
VISION_LAYERS = 23  # CLIP-L layers run up to LLaVA-1.5's feature layer
CLIP_HEADS, CLIP_HEAD_DIM, CLIP_WIDTH = 16, 64, 1024
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


@pytest.fixture(scope="module")
def tiny_llava_path(tmp_path_factory):
    from tiny_models import WORDS

    from prune_audit.models.llava import LlavaModel

    return LlavaModel.build_tiny(tmp_path_factory.mktemp("fidelity_half") / "llava", words=WORDS, text_layers=2, seed=3)


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


TIE_KINDS = ("duplicated", "quantised")


def clip_half_attention(
    generator: torch.Generator, dtype: torch.dtype, ties: str = "", rows: int = TOKENS + 1
) -> torch.Tensor:
    """(16, rows, 577) the first ``rows`` query rows of one CLIP layer's eager attention in ``dtype``: the
    softmax of half logits, in half (LLaVA-1.5's CLIPAttention), CLS first.

    ``ties="duplicated"``: a quarter of the key columns repeat others (exactly equal received attention);
    ``"quantised"``: integer logits, so many probabilities and their means coincide."""
    length = TOKENS + 1
    logits = 2 * torch.randn(CLIP_HEADS, rows, length, generator=generator)
    if ties == "duplicated":
        targets = torch.randperm(length, generator=generator)[: length // 4]
        logits[:, :, targets] = logits[:, :, torch.randint(length, (targets.numel(),), generator=generator)]
    elif ties == "quantised":
        logits = logits.round()
    probs = torch.softmax(logits.to(dtype), dim=-1)
    assert probs.dtype == dtype
    return probs


def pair_half_agreement(case, official, kept, counts, dtype: torch.dtype) -> dict[str, int]:
    """Cases identical to ``official``'s kept set, over ``SEEDS`` x ``counts``: with the exact options from the
    official half signals (exact), from the float32 signals rounded once (rounded_once) and float32 throughout
    with lower-index ties (float32); and one count per seed of each tie kind with the exact options.

    ``case(seed, dtype[, ties])`` gives ``(official, once)`` (2, 576) pairs of the two rows the selector reads,
    ``official(shallow, deep, count)`` the official kept set, ``kept(pair, dtype, count, **options)`` ours."""
    identical = dict.fromkeys(("exact", "rounded_once", "float32", *TIE_KINDS), 0)
    for seed in SEEDS:
        halves, once = case(seed, dtype)
        for count in counts:
            expected = official(halves[0], halves[1], count)
            identical["exact"] += kept(halves, dtype, count, **EXACT) == expected
            identical["rounded_once"] += kept(once, dtype, count, **EXACT) == expected
            identical["float32"] += kept(once, dtype, count) == expected
        for ties in TIE_KINDS:
            halves, _ = case(seed, dtype, ties)
            count = counts[seed % len(counts)]
            identical[ties] += kept(halves, dtype, count, **EXACT) == official(halves[0], halves[1], count)
    return identical


# --- float32 and half cases of the input selectors; tiny LLaVAs ----------------------------------------------------


def features_of(seed: int, dim: int) -> torch.Tensor:
    """(576, dim) LLaVA-like features: a shared direction plus per-token noise (so cosines spread)."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(dim, generator=generator)
    return 0.5 * shared + torch.randn(TOKENS, dim, generator=generator)


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


def official_cls_row(query: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(H, 1 + N) CLS-row probabilities as the official code's eager CLIP attention forms them in ``dtype``.

    The CLIPAttention forward patched in dvlab-research/VisionZip and kinredon/SCOPE (and HF's of
    LLaVA's pinned transformers, which FasterVLM reads): ``q_proj(x) * scale`` in the model dtype,
    ``bmm`` with the keys, ``softmax`` in that dtype.
    """
    scaled = query.to(dtype) * query.shape[-1] ** -0.5
    return torch.softmax((scaled[:, None, :] @ keys.to(dtype).transpose(1, 2))[:, 0], dim=-1)


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
