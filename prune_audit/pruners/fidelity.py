"""How closely each selector follows its official code: the row type each selector class fills in
(``Selector.fidelity``, next to its ``reference``), the phrases several rows share, and the table built from the
registry: the one source of ``docs/fidelity.md`` and ``prune-audit selectors --fidelity``.

Every row names the official repository and the commit its spec was read from, the
default here, the options that reproduce the official code (``exact``, valid
``--option`` strings), what still differs and why, and the measured agreement: kept
sets identical in N of M random cases against an independent re-implementation of
the official algorithm in ``tests/pruners/test_fidelity.py`` (or, where no random comparison
exists, the test that checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prune_audit.pruners.registry import list_selectors, selector_class

# the random-case comparison of tests/pruners/test_fidelity.py: 10 seeds x budgets 64/128/192, 576 tokens, 1024/4096-dim
RANDOM_CASES = 30


@dataclass(frozen=True)
class Fidelity:
    """One selector's row of the fidelity table.

    Attributes:
        commit: official repository commit the implementation was written from.
        default: what the selector does with its default options, in brief.
        exact: ``KEY=VALUE`` options that reproduce the official code (empty: the default does).
        differences: every remaining difference from the official code, each with its reason.
        agreement: the measured agreement, quoting the test that measures it.
        agreement_cases: N of the ``RANDOM_CASES`` random cases with identical kept sets, when measured.
        half_agreement: the agreement in fp16 and bf16 against the official arithmetic in that dtype, with the
            options that reach it, quoting the test (and naming the kernel rounding that prevents exactness).
        half_cases: ``{"fp16": N, "bf16": N}``: N of the ``RANDOM_CASES`` random cases identical in each dtype
            with those options, where a test asserts it.
    """

    commit: str
    default: str
    exact: tuple[str, ...]
    differences: tuple[str, ...]
    agreement: str
    agreement_cases: int | None = None
    half_agreement: str = "no half-precision path (nothing is computed in the model dtype)"
    half_cases: Mapping[str, int] = field(default_factory=dict)


def random_agreement(cases: int, test: str, extra: str = "") -> str:
    """The agreement text of ``cases`` identical kept sets out of ``RANDOM_CASES``, measured by ``test``."""
    tail = f"; {extra}" if extra else ""
    return f"kept sets identical in {cases} of {RANDOM_CASES} random cases ({test}){tail}"


MODEL_DTYPE_ATTENTION = (
    "score_dtype=model forms the attention rows as the official code's eager attention does in the model dtype "
    "(q.k rounded, divided by sqrt(d) as LLaVA-era LlamaAttention does and rounded, float32 softmax rounded: bit "
    "for bit the eager attention of a bf16 and an fp16 tiny LLaVA, "
    "test_fidelity.py::test_model_dtype_attention_is_the_eager_attention_of_a_half_precision_model), rounds the "
    "other signals and the final scores to it; reductions in between stay float32, as half-precision reductions "
    "on GPU accumulate in float32"
)
INPUT_DTYPE = (
    "score_dtype=model computes the CLS probabilities as the official eager attention does in the model dtype the "
    "adapter passes (query scaled in it, logits and probabilities rounded to it) and rounds the scores; reductions "
    "in between stay float32, as half-precision reductions on GPU accumulate in float32"
)
CLS_HALF = (
    "CLS attention in fp16 / bf16 against the official eager attention run in that dtype "
    "(test_fidelity.py::test_cls_logits_reproduce_the_official_half_precision_cls_attention): "
)

HALF_EXACT_CASES: Mapping[str, int] = {"fp16": RANDOM_CASES, "bf16": RANDOM_CASES}
HALF_ONCE = (
    "the float32 mean of the same half probabilities rounded once (a float32 signal; a half LLaVA passes the "
    "official half means too, model_layer_attention / model_layer_cls_attention, bit for bit those of the eager "
    "CLIP attention of an fp16 and a bf16 tiny LLaVA: test_fidelity_half_adapter.py)"
)
ROPE_ONCE = (
    "the float32 RoPE logits rounded once (the adapter forms them in the model dtype under score_dtype=model, "
    "q.k accumulated in float32 as a GPU; against the official run with this CPU's half GEMM, which may round some "
    "of the 423,801 differently (`python -m benchmarks.half_kernels`: none on a Xeon with AMX and avx512_fp16), "
    "still 30 of 30)"
)


def half_exact(given: str, passed: str, fp16: int, bf16: int) -> str:
    """The half agreement of a selector exact with ``score_dtype=model, ties=topk`` given the ``given`` signals in
    the model dtype (the selector's tests/pruners/test_<name>.py), and ``fp16`` / ``bf16`` of the cases given
    ``passed``."""
    return (
        f"score_dtype=model, ties=topk: fp16 and bf16 {RANDOM_CASES} of {RANDOM_CASES} random cases each (and 10 of "
        f"10 duplicated-key, 10 of 10 integer-logit cases) given {given} (test_<name>.py); given {passed}: "
        f"{fp16} (fp16) and {bf16} (bf16) of {RANDOM_CASES}"
    )


QWEN_TOWER = (
    "Qwen2.5-VL: the official Qwen path's attention each merged token receives (4-patch mean, heads and query "
    "patches averaged, windowed blocks unmasked as its flash-attention path recomputes them; models.qwen)"
)


#: the ties=topk difference of the top-k selectors that read half attention (CLS attention, FastV, PDrop, VisionZip)
TIES_TOPK_HALF = (
    "ties=topk ranks with torch.topk on the half scores (its order among exact ties, which half precision makes "
    "common): with score_dtype=model, kept sets equal the official torch.topk's in 30 of 30 fp16 and 30 of 30 "
    "bf16 cases, the lower-index rule in at most 29 and 23 "
    "(test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); the order among exact ties "
    "is the kernel's, so use it to reproduce a run on the same hardware and the default for deterministic audits"
)

#: the half agreement of the selectors ranking the last prompt row's attention (FastV, PDrop)
LAST_ROW_HALF = (
    "fp16 30 of 30, bf16 30 of 30 with score_dtype=model, ties=topk against the official torch.topk on the half "
    "attention rows (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); lower-index "
    "ties at most 29 and 23; on CPU the official half q.k^T GEMM may round some of the 18,432 last-row image "
    "probabilities per prompt differently from the probe's float32-accumulated product rounded once (a GPU's "
    "accumulation), as many as the CPU's kernels make (`python -m benchmarks.half_kernels`: on a Xeon with AMX, "
    "avx512_fp16 and avx512_bf16, fp16 none, bf16 0 to 4 per prompt), kept sets still 30 of 30 "
    "(test_fidelity.py::test_fastv_and_pdrop_keep_the_official_set_despite_the_cpu_fp16_gemm)"
)

NOT_YET_DONE: tuple[str, ...] = ()


def fidelity_entries() -> dict[str, Fidelity]:
    """Registered selector name -> its class's fidelity row, for every selector that has one (plugins may not)."""
    classes = {name: selector_class(name) for name in list_selectors()}
    return {name: cls.fidelity for name, cls in classes.items() if cls.fidelity is not None}


COLUMNS = (
    "selector", "paper", "official repository (commit read)", "default here", "reference-exact options",
    "remaining differences (why)", "measured agreement", "fp16 / bf16 agreement",
)  # fmt: skip


def fidelity_rows() -> list[dict[str, Any]]:
    """One row per registered selector that has a fidelity entry, in name order."""
    rows = []
    for name, entry in fidelity_entries().items():
        reference = selector_class(name).reference
        rows.append(
            {
                "selector": name,
                "paper": reference.paper,
                "official repository (commit read)": f"{reference.repository} ({entry.commit})",
                "default here": entry.default,
                "reference-exact options": ", ".join(entry.exact) or "the defaults",
                "remaining differences (why)": "; ".join(entry.differences),
                "measured agreement": entry.agreement,
                "fp16 / bf16 agreement": entry.half_agreement,
            }
        )
    return rows


def fidelity_markdown() -> str:
    """The text of ``docs/fidelity.md``."""
    lines = [
        "# Fidelity: each selector against its official code",
        "",
        "Generated from `prune_audit/pruners/fidelity.py` (printed by `prune-audit selectors --fidelity --markdown`);",
        "`tests/test_fidelity_doc.py` checks that this file matches. Reference-exact options are passed as",
        "`--option KEY=VALUE`. Measured agreement: kept sets compared with independent re-implementations of the",
        "official algorithms written in `tests/pruners/test_fidelity.py` from the official code's math, on random cases",
        "at realistic sizes (576 tokens, 1024/4096-dim features, budgets 64/128/192). The commits are those the",
        "selectors spec (`shared/specs/selectors.md`, section 0) was written from; DART's set order was re-read in",
        "the fork named in its row. The fp16 / bf16 column compares kept sets with the official code's arithmetic",
        "in that dtype, re-derived step by step (the dtype of every intermediate, `torch.topk` for the ranking) in",
        "each selector's `tests/pruners/test_<name>.py` and `tests/pruners/test_fidelity.py`, with the options named; `ties=topk` reproduces",
        "`torch.topk`'s order among exact ties on the same hardware, the default lower-index rule is deterministic",
        "everywhere. Where a CPU kernel's rounding keeps a selector from exact agreement the row names it and its size.",
        "",
        "Multi-crop families (LLaVA-NeXT, LLaVA-OneVision: a base view plus anyres tiles): the official LLaVA-NeXT",
        "code of VisionZip (3151f6d), CDPruner (9541616) and FasterVLM (f5d5f12) selects in every crop separately",
        "with the same count per crop. Every input selector takes `budget_scope`: `image` (default) spends one budget",
        "over all of an image's visual tokens; `crop` (the official convention) splits it evenly over the crops",
        "(`budget // K`, the first `budget % K` crops one more) and runs the selector on each crop's tokens alone",
        "(`prune_audit/pruners/crop_scope.py`; test: `tests/models/test_llava_next.py::test_per_crop_budget_equals_an_",
        "independent_per_crop_top_k`). Remaining differences: the official code selects among a tile's 576 patches,",
        "padding included, and keeps its padding picks (these ports and HiPrune's lay the kept tokens out as the `spatial`",
        "merge does: no unpadding, no `image_newline`); here a tile offers only its unpadded tokens, a crop with fewer",
        "tokens than its share keeps them all (the rest is not moved), and a plain selection keeps the stock layout",
        "with every newline.",
        "On LLaVA-NeXT the CLS selectors read each crop's own CLS row, as those ports do, and HiPrune runs only",
        "with `budget_scope=crop` (its official LLaVA-NeXT code, 6e83a12, selects in each crop's own grid; here a",
        "crop's unpadded tokens are its grid). Uniform, pool, ToMe and E2S run on each of the image's two regular",
        "grids (base view, tile grid), a project choice without an official counterpart: the input ones split an",
        "`image`-scoped budget over the grids in proportion to their tokens, pool and ToMe merge within a grid (a",
        "merged token takes its first cell's place among the row newlines), E2S has novelty blocks on each grid;",
        "pool is refused on LLaVA-OneVision (no pre-projector features after `anyres_max`'s resize;",
        "docs/models.md, LLaVA-NeXT). VScan runs on LLaVA-NeXT only with `budget_scope=crop`, as its official path",
        "(a82450e): scans and merging in each crop's padded grid, padding patches included, then unpadding (a kept",
        "padding patch is dropped); it is the one in-LLM selector with the option.",
        "VisionZip runs there only with `budget_scope=crop`: each crop's own",
        "CLS state, CLS attention and keys, laid out as its official LLaVA-NeXT code lays them (base view, tiles'",
        "dominant tokens, tiles' CLS, tiles' contextual tokens, no newlines; a tile whose share is at least its",
        "unpadded tokens keeps them all, without CLS or contextual tokens; `prune_audit/pruners/crop_merge.py`;",
        "test: `tests/models/test_llava_next.py::test_visionzip_runs_per_crop_on_llava_next_as_its_official_code`).",
        "CDPruner runs there with `--clip-text`; under `budget_scope=crop` its relevance is min-max normalised over",
        "all the image's tokens before each crop's DPP, as its official LLaVA-NeXT code normalises over all crops",
        "(test: `tests/models/test_llava_next.py::test_cdpruner_runs_on_llava_next_with_a_clip_text_tower`).",
        "`budget_scope=crop` is",
        "refused in one line on one-crop families. A LLaVA-OneVision token",
        "of a tile grid `anyres_max` resized counts in the crop of the patch under its cell's centre (a convention).",
        "InternVL3's dynamic tiles (the 448-px tiles of the best aspect-ratio grid, then the thumbnail; transformers",
        "5.24 `GotOcr2ImageProcessor`, as OpenGVLab's `dynamic_preprocess`) are crops too: `budget_scope=crop` gives",
        "each tile and the thumbnail an even share of its 256 tokens. No official pruning code for the InternVL tiles",
        "was read: per tile is this project's convention there. Uniform, pool, ToMe and E2S run on each tile's and",
        "the thumbnail's 16 x 16 grid (their tokens are numbered tile by tile), the budget split evenly (equal grids),",
        "pool averaging one tile's pixel-shuffled pre-projector tokens before the projector, ToMe merging projected",
        "tokens of one tile, E2S with novelty blocks on each tile; a one-tile image is one grid, as before tiling.",
        "Video clips: the image selectors with a per-frame run (`Selector.per_frame`: "
        + ", ".join(name for name in list_selectors() if selector_class(name).per_frame)
        + ") select on each",
        "temporal step of a clip (two sampled frames on the Qwen families, one on LLaVA-OneVision; h x w tokens) alone, the clip's budget split evenly over the",
        "steps as `budget_scope=crop` splits an image's over its crops, and count their own FLOPs per step",
        "(`prune_audit/pruners/frame_scope.py`, manifest `selector.per_frame`; tests:",
        "`tests/pruners/test_frame_scope.py::test_per_frame_kept_sets_equal_each_step_selected_alone`, and on a tiny",
        "Qwen2.5-VL `tests/test_clip_per_frame.py`). No official per-frame code of these selectors exists: per frame",
        "is this project's convention. Other image selectors are refused on clips in one line.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in fidelity_rows():
        lines.append("| " + " | ".join(str(row[column]).replace("|", "\\|") for column in COLUMNS) + " |")
    if NOT_YET_DONE:
        lines += ["", "## Not yet done", ""] + [f"- {item}" for item in NOT_YET_DONE]
    return "\n".join(lines) + "\n"


__all__ = [
    "COLUMNS",
    "Fidelity",
    "NOT_YET_DONE",
    "RANDOM_CASES",
    "fidelity_entries",
    "fidelity_markdown",
    "fidelity_rows",
    "half_exact",
    "random_agreement",
]
