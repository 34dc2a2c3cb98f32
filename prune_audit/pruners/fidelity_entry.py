"""One row of the fidelity table (:mod:`prune_audit.pruners.fidelity`), its random-case agreement text and the
phrases several rows share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# the random-case comparison of tests/test_fidelity.py: 10 seeds x budgets 64/128/192, 576 tokens, 1024/4096-dim
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
    the model dtype (tests/test_fidelity_half_v3.py), and ``fp16`` / ``bf16`` of the cases given ``passed``."""
    return (
        f"score_dtype=model, ties=topk: fp16 and bf16 {RANDOM_CASES} of {RANDOM_CASES} random cases each (and 10 of "
        f"10 duplicated-key, 10 of 10 integer-logit cases) given {given} (test_fidelity_half_v3.py); given {passed}: "
        f"{fp16} (fp16) and {bf16} (bf16) of {RANDOM_CASES}"
    )
QWEN_TOWER = (
    "Qwen2.5-VL: the official Qwen path's attention each merged token receives (4-patch mean, heads and query "
    "patches averaged, windowed blocks unmasked as its flash-attention path recomputes them; models.qwen)"
)
