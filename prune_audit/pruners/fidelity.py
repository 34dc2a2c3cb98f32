"""How closely each selector follows its official code: the one source of ``docs/fidelity.md``
and ``prune-audit selectors --fidelity``.

Every row names the official repository and the commit its spec was read from, the
default here, the options that reproduce the official code (``exact``, valid
``--option`` strings), what still differs and why, and the measured agreement: kept
sets identical in N of M random cases against an independent re-implementation of
the official algorithm in ``tests/test_fidelity.py`` (or, where no random comparison
exists, the test that checks it).
"""

from __future__ import annotations

from prune_audit.pruners.fidelity_entry import CLS_HALF as _CLS_HALF, half_exact as _half_exact
from prune_audit.pruners.fidelity_entry import HALF_EXACT_CASES as _HALF, HALF_ONCE as _ONCE, ROPE_ONCE as _ROPE_ONCE
from prune_audit.pruners.fidelity_entry import INPUT_DTYPE as _INPUT_DTYPE
from prune_audit.pruners.fidelity_entry import MODEL_DTYPE_ATTENTION as _MODEL_DTYPE_ATTENTION
from prune_audit.pruners.fidelity_entry import QWEN_TOWER as _QWEN_TOWER
from prune_audit.pruners.fidelity_entry import RANDOM_CASES, Fidelity, random_agreement as _random


FIDELITY: dict[str, Fidelity] = {
    "cdpruner": Fidelity(
        "9541616c",
        "conditional DPP, linear relevance (theta off), fast greedy MAP, plain float32 argmax",
        ("score_dtype=model",),
        (
            "no early stop and gains below 1e-6 x max diag count as 0 (the official code has no guard and yields NaN "
            "once the kernel's rank is exhausted)",
            "kernel rows computed on demand, no N x N matrix (memory at high resolution)",
            "unit rows and relevance in float32 by default (the official code normalises the projector outputs, "
            "computes the CLIP relevance and min-max normalises it in the model dtype, then computes the kernel and "
            "the greedy in float32); score_dtype=model does the same: the unit rows in the model dtype, the raw "
            "relevance as the adapter computes it in the CLIP dtype (model_text_relevance: unit embeddings, cosines "
            "and their mean rounded) normalised in the model dtype, every step rounded",
        ),
        _random(30, "test_fidelity.py::test_plain_argmax_reproduces_the_official_greedy",
                "ties=tolerance: 30 of 30; fp16 and bf16 features: score_dtype=model 30 of 30 each, float32 26 and 9 of "
                "30 (test_fidelity.py::test_cdpruner_model_dtype_reproduces_the_official_half_precision_normalisation)"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases (and 10 of 10 each with a quarter of the tokens duplicated) "
        "with score_dtype=model against the official unit features, CLIP relevance and "
        "min-max normalisation written out in half on CPU, the kernel and greedy in float32 "
        "(test_fidelity_half.py::test_cdpruner_model_dtype_reproduces_the_official_half_precision_relevance); from "
        "the float32 raw relevance rounded once (no model_text_relevance) 28 and 23 of 30, float32 throughout 29 and "
        "8 of 30; the adapter's model_text_relevance is checked on a half tiny LLaVA with its CLIP text tower",
        {"fp16": 30, "bf16": 30},
    ),
    "cls_attn": Fidelity(
        "f5d5f120",
        "head mean of the CLS row at CLIP layer -2, top-k, float32 scores",
        ("score_dtype=model", "ties=topk"),
        ("ties=topk ranks with torch.topk on the half scores (its order among exact ties, which half precision makes common): with score_dtype=model, kept sets equal the official torch.topk's in 30 of 30 fp16 and 30 of 30 bf16 cases, the lower-index rule in at most 29 and 23 (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); the order among exact ties is the kernel's, so use it to reproduce a run on the same hardware and the default for deterministic audits", "ties to the lower index (torch.topk leaves them unspecified)", _INPUT_DTYPE),
        _random(30, "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k",
                "score_dtype=model: the top-k of the rounded head mean on an fp16 case where float32 differs "
                "(test_input_selectors.py), and on the adapter's bf16 signals (test_fidelity.py); " + _CLS_HALF
                + "score_dtype=model 30 of 30 in both, float32 29 and 16 of 30"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model, ties=topk against the official torch.topk of the "
        "head mean of the official half CLS attention (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); lower-index ties "
        "at most 29 and 23 of 30, float32 29 and 16 of 30",
        {"fp16": 30, "bf16": 30},
    ),
    "coverage": Fidelity(
        "-",
        "demand-weighted facility location on centred projector cosine",
        (),
        ("unofficial: written from the CoverPruner abstract; not a reproduction",),
        "no official code to compare with",
    ),
    "dart": Fidelity(
        "vendored in Chenfei-Liao/VTC-Bench 983e443e; fork xqy1111111/DART 02476570",
        "pivots visited in ascending sequence order; key norms of layer K-1 (signal_layer=previous); average rule",
        ("budget_rule=paper", "pivot_order=set", "score_dtype=model", "ties=topk"),
        (
            "default pivot order is ascending (the official Python-set order depends on where the image sits "
            "in the prompt); pivot_order=set reproduces it",
            "ties to the lower index by default; ties=topk ranks the key norms and each pivot's remaining "
            "candidates with torch.topk as the official code does (its order among exact ties is the kernel's: "
            "use it to reproduce a run on the same hardware, the default for deterministic audits)",
            "score_dtype=model rounds the key norms and normed hidden states to the model dtype and computes the "
            "dissimilarities as the official -F.cosine_similarity in it (norms, unit vectors and products rounded, "
            "the sum accumulated in float32 and rounded once); float32 cosines rounded afterwards differ by an "
            "ulp in about half of the values",
        ),
        _random(30, "test_fidelity.py::test_dart_set_order_reproduces_the_official_iteration",
                "pivot_order=sequence (default): 0 of 30"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases, and 10 of 10 each with a quarter of the rows duplicated, "
        "with budget_rule=paper, pivot_order=set, score_dtype=model, ties=topk against the official cosine "
        "written out in half on CPU (test_fidelity_half.py::test_dart_model_dtype_reproduces_the_official_half_"
        "precision_cosine); float32 cosines rounded afterwards 15 and 0 of 30",
        {"fp16": 30, "bf16": 30},
    ),
    "divprune": Fidelity(
        "799e2d95",
        "greedy max-min cosine distance, plain float32 argmax",
        (),
        (
            "float32 by default (the official code computes in the model dtype, fp16 in practice, whose ties make "
            "the picks depend on rounding; score_dtype=model does the same)",
            "running minimum, no N x N matrix; picked tokens are never re-picked (only differs once all distances are 0)",
        ),
        _random(30, "test_fidelity.py::test_plain_argmax_reproduces_the_official_greedy",
                "ties=tolerance: 25 of 30; fp16 features: score_dtype=model 30 of 30, float32 2 of 30 "
                "(measured once; the test runs 6 of those cases)"),  # fmt: skip
        30,
        "fp16 6 of 6 (1024-dim cases: fp16 matrix products are slow on CPU; all 30 measured once: 30 of 30), bf16 30 "
        "of 30 with score_dtype=model against the official greedy run in that dtype on CPU "
        "(test_fidelity.py::test_divprune_model_dtype_reproduces_the_official_half_precision_picks, "
        "test_fidelity.py::test_divprune_model_dtype_reproduces_the_official_bf16_picks); float32 2 and 0 of 30",
        {"bf16": 30},
    ),
    "e2s": Fidelity(
        "not public",
        "evidence from the pruned layer, section-5 schedule, average rule",
        ("budget_rule=paper",),
        (
            "written from the paper: the choices it leaves open are documented in the selector (spec section 12)",
            "every row of the paper's Table 3 (schedule ablation at 128) is a schedule_preset "
            "(table3_122_48_42, table3_132_40_32, table3_142_32_22, table3_147_38_12, table3_152_44_2)",
        ),
        "no official code to compare with; hand-computed cases in test_llm_selectors.py; each Table-3 preset "
        "realises its row and an average of 128 "
        "(test_fidelity.py::test_every_e2s_table3_row_is_a_preset_averaging_128)",
        half_agreement="no official code to compare with; score_dtype=model rounds the signals and scores to the "
        "model dtype as the other in-LLM selectors do",
    ),
    "fastv": Fidelity(
        "d1659729",
        "attention of layer K-1 (signal_layer=previous), last prompt row, K=2, average-matched count",
        ("budget_rule=paper", "score_dtype=model", "ties=topk"),
        (
            "ties=topk ranks with torch.topk on the half scores (its order among exact ties, which half precision makes common): with score_dtype=model, kept sets equal the official torch.topk's in 30 of 30 fp16 and 30 of 30 bf16 cases, the lower-index rule in at most 29 and 23 (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); the order among exact ties is the kernel's, so use it to reproduce a run on the same hardware and the default for deterministic audits",
            "prefill-only pruning (the official code without KV cache re-ranks at every generated token)",
            "ties to the lower index",
            _MODEL_DTYPE_ATTENTION,
        ),
        _random(30, "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k",
                "and identical to the top-k of layer K-1's eager attention in 2 of 2 prompts on the tiny LLaVA "
                "(test_fidelity.py::test_fastv_ranks_with_the_attention_of_the_layer_before_the_cut)"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model, ties=topk against the official torch.topk on the half "
        "attention rows (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); lower-index ties at most 29 and 23; "
        "on CPU the official half q.k^T GEMM may round some of the 18,432 last-row image probabilities per prompt differently from the probe's float32-accumulated product rounded once (a GPU's accumulation), as many as the CPU's kernels make (`python -m benchmarks.half_kernels`: on a Xeon with AMX, avx512_fp16 and avx512_bf16, fp16 none, bf16 0 to 4 per prompt), kept sets still 30 of 30 (test_fidelity_half.py::test_fastv_and_pdrop_keep_the_official_set_despite_the_cpu_fp16_gemm)",
        {"fp16": 30, "bf16": 30},
    ),
    "pdrop": Fidelity(
        "6444f304",
        "layers 2/8/16, geometric ratio solved to the budget average",
        ("budget_rule=official", "score_dtype=model", "ties=topk"),
        (
            "ties=topk ranks with torch.topk on the half scores (its order among exact ties, which half precision makes common): with score_dtype=model, kept sets equal the official torch.topk's in 30 of 30 fp16 and 30 of 30 bf16 cases, the lower-index rule in at most 29 and 23 (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); the order among exact ties is the kernel's, so use it to reproduce a run on the same hardware and the default for deterministic audits",
            "the official default (8/16/24, ratio 0.5) realises an average of 270 only, so the default solves "
            "the ratio for the requested budget (maintainer guidance, PyramidDrop issue #29)",
            "training-mode multi-query scoring not ported (inference only); ties to the lower index",
            _MODEL_DTYPE_ATTENTION,
        ),
        _random(30, "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k", "one stage; schedule identical to the official default "
                "(test_schedule.py::test_official_rule_gives_the_code_default_and_refuses_other_budgets)"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model, ties=topk against the official torch.topk on the half "
        "attention rows (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); lower-index ties at most 29 and 23; "
        "on CPU the official half q.k^T GEMM may round some of the 18,432 last-row image probabilities per prompt differently from the probe's float32-accumulated product rounded once (a GPU's accumulation), as many as the CPU's kernels make (`python -m benchmarks.half_kernels`: on a Xeon with AMX, avx512_fp16 and avx512_bf16, fp16 none, bf16 0 to 4 per prompt), kept sets still 30 of 30 (test_fidelity_half.py::test_fastv_and_pdrop_keep_the_official_set_despite_the_cpu_fp16_gemm)",
        {"fp16": 30, "bf16": 30},
    ),
    "pool": Fidelity(
        "-",
        "adaptive average pooling of the pre-projector feature grid to the largest grid within the budget",
        (),
        (
            "VTC-Bench's baseline downsamples the image and runs the vision tower on it; pooling the full-resolution "
            "features is its token-level counterpart (one vision pass, same grid geometry); grid=window pools k x k "
            "windows, downsampling by an integer factor",
            "every output token is a merged token carrying its window's cells (merged_stages), so retention counts "
            "them and an object only pooled with other cells is diluted, not lost",
        ),
        "pooled tokens equal torch.nn.functional.adaptive_avg_pool2d of the feature grid "
        "(test_new_selectors.py::test_pool_equals_adaptive_average_pooling)",
    ),
    "random": Fidelity("-", "seeded uniform subset (control)", (), ("control, no reference",), "not applicable"),
    "scope": Fidelity(
        "6bf73069",
        "saliency^alpha x facility-location gain, alpha=1, near-ties (relative 1e-5) to the lower index, float32 scores",
        ("ties=argmax", "score_dtype=model"),
        (
            "near-ties (relative 1e-5) go to the lower index by default; ties=argmax takes the official plain argmax "
            "(no near-tie occurred in the random cases, so both agree there); gap_power is an extension (1 = reference)",
            "float32 by default (the official code computes the saliency, cosines, coverage gaps and gains in the "
            "model dtype, fp16/bf16 in practice, whose rounding creates ties); score_dtype=model rounds each of them "
            "to the model dtype as it does, the sums accumulated at higher precision as half-precision reductions on "
            "GPU are; a half-precision matrix product's last bit depends on its kernel's accumulation order (about "
            "1 cosine in 10^4), so agreement with a given GPU run can only be near-exact",
        ),
        _random(30, "test_fidelity.py::test_scope_reproduces_the_official_greedy",
                "1024-dim CLIP features, dense official greedy, ties=tolerance and ties=argmax alike; against the "
                "official greedy run in fp16: score_dtype=model 29 of 30, float32 23 of 30; in bf16: score_dtype=model "
                "30 of 30, float32 12 of 30 (test_fidelity.py::test_scope_model_dtype_reproduces_the_official_half_precision_greedy); "
                "and naive facility-location cases (test_input_selectors.py); " + _CLS_HALF
                + "score_dtype=model 28 and 30 of 30, float32 21 and 3 of 30"),  # fmt: skip
        30,
        "with score_dtype=model, ties=argmax against the official greedy run in that dtype on CPU: fp16 29 of 30, "
        "bf16 30 of 30 (test_fidelity.py::test_scope_model_dtype_reproduces_the_official_half_precision_greedy, "
        "asserted with one case of slack); float32 23 and 12 of 30; the remaining fp16 case is kernel rounding: "
        "a half-precision matrix product's last bit depends on its accumulation order (about 1 cosine in 10^4 "
        "differs by an ulp between kernels)",
    ),
    "sparsevlm": Fidelity(
        "26a5f488",
        "raters from input embeddings; layer l's attention prunes its output (signal_layer=previous); average rule; "
        "no token recycling",
        ("budget_rule=paper", "recycle=true", "score_dtype=model", "ties=topk"),
        (
            "recycling is off by default so that pure-pruning records stay comparable with the other selectors; "
            "recycle=true inserts the reference's DPC-kNN cluster tokens after the kept ones (merged tokens and "
            "their grid sources are recorded in merged_stages and count towards retention)",
            "recycle=true: the density tie-break noise (rand x 1e-6, unseeded in the official code) is drawn from a "
            "generator seeded with 0, so runs are reproducible; clustering runs in float32, also under "
            "score_dtype=model (the official code clusters in the model dtype, where its 1e-6 noise rounds away below "
            "fp16's resolution, density ties fall to the GPU topk's unspecified order and the merged sums are atomic "
            "half-precision adds whose order varies between runs, so no deterministic computation reproduces them); "
            "ties in relevance among the pruned tokens are ordered by the lower index (torch.topk leaves them "
            "unspecified)",
            "exactly keep tokens (the official code caps at n - 1); ties to the lower index by default; ties=topk "
            "ranks with torch.topk on the half scores as the official code (its order among exact ties is the "
            "kernel's: use it to reproduce a run on the same hardware, the default for deterministic audits)",
            "score_dtype=model computes as the official code does in the model dtype: raters from the rounded input "
            "embeddings (V T^T, its softmax, the visual mean and its mean each rounded), the attention by the "
            "official utils.scaled_dot_product_attention (model_attention=scaled, default: q.k rounded with float32 "
            "accumulation as on GPU, times 1/sqrt(d) in the model dtype, softmax of the half logits on the model's "
            "device; model_attention=eager keeps LlamaAttention's eager recipe, / sqrt(d) and a float32 softmax "
            "rounded, as before the option existed: in fp16 the two scalings differ in about 0.1 % of the logits), "
            "the head mean rounded, then the rater mean rounded",
        ),
        _random(30, "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k",
                "one stage; first-stage kept sets identical to the top-k of the previous layer's eager rater attention "
                "in 2 of 2 prompts on the tiny LLaVA (test_fidelity.py); paper rule realises "
                "202.75 / 140.81 / 79.19 (test_schedule.py); recycle=true: kept sets, cluster members and merged "
                "vectors (bit for bit) identical to a re-implementation of the official cluster_and_merge in 30 of "
                "30 random stages at 576 tokens x 4096 dims with distinct relevances "
                "(test_recycling.py::test_recycling_reproduces_the_official_cluster_and_merge; with float ties in "
                "relevance 29 of 30: one tie reorders the points summed into one cluster), paper rule with "
                "recycling realises 206.50 / 145.41 / 82.25 (test_recycling.py)"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases, and 10 of 10 each with a quarter of the keys duplicated "
        "(whole attention columns tied) and with integer keys (many equal probabilities), first stage with score_dtype=model, ties=topk against the official "
        "raters and attn_postprocess_topk written out in half on CPU from the official half attention "
        "(test_fidelity_half.py::test_sparsevlm_model_dtype_reproduces_the_official_half_precision_scores); "
        "score_dtype=model with lower-index ties 19 and 5 of 30, float32 scores 16 and 0 of 30; the probe's "
        "model_attention=scaled rows are the official scaled_dot_product_attention of a half tiny LLaVA bit for "
        "bit with q.k accumulated in float32 as on GPU "
        "(test_fidelity_half.py::test_scaled_attention_is_the_official_sparsevlm_attention_of_a_half_model); on CPU "
        "the official half q @ k^T GEMM may round a few dot products differently, as many as the CPU's kernels make "
        "(`python -m benchmarks.half_kernels`); kept sets still 30 of 30 against it (test_fidelity_half.py::test_fastv_"
        "and_pdrop_keep_the_official_set_despite_the_cpu_fp16_gemm)",
        {"fp16": 30, "bf16": 30},
    ),
    "tome": Fidelity(
        "af95e4b1",
        "rounds of bipartite soft matching at the projector output (r <= n / 2 per round) to the budget, "
        "size-weighted averages, official output order",
        ("location=tower",),
        (
            "merges the projector outputs to the budget in rounds, the usual VLM baseline; location=tower merges "
            "inside the vision tower as the official blocks (CLS protected, head-mean keys, proportional attention)",
            "at the projector the similarity metric is the token itself (no keys there)",
            "location=tower: r per layer as even as possible to end at the budget (the official constant r, as a "
            "per-layer list), front-loaded where halving caps a layer; budgets below halving in every layer refused",
            "exact ties go to the lower index (argsort leaves them unspecified)",
            "every output token carries its merge_source cells (merged_stages): retention counts them and an object "
            "carried only by a merged token is diluted, not lost; order=raster sorts the output by first cell",
        ),
        _random(30, "test_fidelity.py::test_tome_reproduces_the_official_merging_rounds",
                "each output token's cells, and its vector within 1e-5; location=tower: 30 of 30 through 23 layers "
                "(test_methods_v3.py::test_tome_tower_merging_reproduces_the_official_blocks)"),
        30,
    ),
    "uniform": Fidelity("-", "spatially even lattice subsample (control)", (), ("control, no reference",), "not applicable"),
    "v2drop": Fidelity(
        "219e03ed",
        "largest hidden-state variation at layers 3/17/22, paper shapes solved to the budget average",
        ("budget_rule=official", "score_dtype=model", "ties=topk"),
        (
            "paper and average rules keep 0 tokens at the last stage as the paper states (the code keeps 1; "
            "budget_rule=official does)",
            "ties to the lower index by default; ties=topk ranks with torch.topk on the half variations as the "
            "official code (its order among exact ties is the kernel's: use it to reproduce a run on the same "
            "hardware, the default for deterministic audits)",
            "score_dtype=model computes as the official code in the model dtype: the states rounded, their "
            "difference rounded, its norm torch's half-precision reduction (float32 accumulation in the kernel's "
            "order, rounded once)",
        ),
        _random(30, "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k", "one stage; official schedule identical to the code's default (test_schedule.py)"),
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases and 10 of 10 each with duplicated rows, with score_dtype=model, "
        "ties=topk against the official torch.norm of the half difference on CPU "
        "(test_fidelity_half.py::test_v2drop_model_dtype_reproduces_the_official_half_precision_variation); "
        "lower-index ties 5 and 0 of 30, float32 5 and 0 of 30",
        {"fp16": 30, "bf16": 30},
    ),
    "visionzip": Fidelity(
        "3151f6df",
        "CLS + dominant tokens by CLS attention, contextual merge (54+10 / 108+20 / 162+30), float32 scores",
        ("score_dtype=model", "ties=topk"),
        (
            "ties=topk ranks with torch.topk on the half scores (its order among exact ties, which half precision makes common): with score_dtype=model, kept sets equal the official torch.topk's in 30 of 30 fp16 and 30 of 30 bf16 cases, the lower-index rule in at most 29 and 23 (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); the order among exact ties is the kernel's, so use it to reproduce a run on the same hardware and the default for deterministic audits",
            "ties to the lower index",
            _INPUT_DTYPE + "; under score_dtype=model the head-mean keys, their unit normalisation, the "
            "member-to-target cosines and the merged vectors are computed in the model dtype as well",
            "the contextual tokens' grid sources (target and members) are recorded in merged_stages and count "
            "towards retention (records schema 4), so an object merged into a contextual token is not lost; "
            "visualize hatches their cells",
        ),
        _random(30, "test_fidelity.py::test_visionzip_reproduces_the_official_dominant_and_contextual_tokens",
                "dominant set, every contextual token's target and members, and every output vector within 1e-5; "
                "1024-dim CLIP states, 16 heads x 64-dim keys; score_dtype=model: rounded saliency, keys and cosines "
                "on an fp16 case where float32 differs (test_input_selectors.py); " + _CLS_HALF
                + "dominant set with score_dtype=model 30 of 30 in both, float32 29 and 9 of 30; the whole forward "
                "against the official one run in fp16 / bf16: dominant set, contextual groups and every output vector "
                "bit for bit with score_dtype=model in 30 of 30 each, float32 scoring the same sets in 0 of 30 "
                "(test_fidelity.py::test_visionzip_model_dtype_reproduces_the_official_half_precision_forward)"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model, ties=topk: dominant set against the official "
        "torch.topk on the half CLS attention (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); with "
        "score_dtype=model the whole forward (dominant set, contextual groups, output vectors) bit for bit in 30 "
        "of 30 each (test_fidelity.py::test_visionzip_model_dtype_reproduces_the_official_half_precision_forward)",
        {"fp16": 30, "bf16": 30},
    ),
    "vispruner": Fidelity(
        "aefa01ad",
        "important_ratio 0.5 of the budget by head-mean CLS attention, the rest by removing duplicates 8 per round, "
        "float32 scores",
        ("score_dtype=model",),
        (
            "ties to the lower index in the attention ranking and to the lower position in the duplicate ranking "
            "(argsort leaves them unspecified)",
            "an odd number of residual tokens (e.g. budget 63 or 65 at ratio 0.5) splits A = even positions, one "
            "longer than B; the official batched indexing needs |A| == |B| and fails there",
            _INPUT_DTYPE + "; under score_dtype=model the head mean, the unit features and the A-B cosines are "
            "rounded to the model dtype as well",
        ),
        _random(30, "test_fidelity.py::test_vispruner_reproduces_the_official_important_and_diverse_tokens",
                "1024-dim CLIP states; against the official code run in fp16 / bf16 with a GPU's float32 accumulation "
                "(norms and cosines rounded once): score_dtype=model 30 of 30 each, float32 scoring 0 of 30; CPU fp16 "
                "kernels round some norms and cosines differently (18 of 30 there)"),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model against the official forward in that dtype with a "
        "GPU's float32 accumulation (norms and cosines rounded once) "
        "(test_fidelity.py::test_vispruner_reproduces_the_official_important_and_diverse_tokens); against the CPU "
        "fp16 kernels 18 of 30: they round some norms and cosines differently (kernel rounding)",
        {"fp16": 30, "bf16": 30},
    ),
    "hiprune": Fidelity(
        "6e83a124",
        f"alpha 0.1, object layer 9 of 23 CLIP layers (scaled), flat offsets; {_QWEN_TOWER}: block 16 of 32, the last",
        ("score_dtype=model", "ties=topk"),
        (
            "ties to the lower index and registers ranked outside anchors and buffers unless ties=topk (official: topk of the row minus 1 there, the same set without ties); attention in float32 unless score_dtype=model (official: fp16)",
            "anchors capped at budget // 5 so anchors and buffers fit (the official code fails there; alpha near 1)",
            "Qwen: the official sum over query patches can exceed 1, so its minus 1 can re-pick a cell (fewer distinct tokens); here never",
            "neighbours=grid keeps buffers inside the grid (the official +-1 wraps across rows)",
            "object layer round(9 Lv / 23) on a tower running Lv layers (Qwen: round(16 Lv / 32) of its Lv blocks)",
        ),
        _random(30, "test_methods_v3.py::test_hiprune_reproduces_the_official_anchors_buffers_and_registers", "23 x 576 attention, budgets 64/128/192; Qwen path: test_methods_qwen.py 40 of 40 unrepeated"), 30,  # fmt: skip
        half_agreement=_half_exact("the official half mean(1).mean(1)", _ONCE + " (head and query)", 27, 11), half_cases=_HALF,
    ),
    "sparsevlm2": Fidelity(
        "9e1f649e",
        "branch v2.0 (USE_VERSION=2_0): rater attention divided by the all-ones RoPE logits, 14 of 32 heads by their "
        "rater attention, layers 2/6/15 (outputs pruned), average rule on the v2.0 counts, no merging, positions kept",
        ("budget_rule=paper", "score_dtype=model", "ties=topk"),
        (
            "exactly keep tokens (the reference caps at n - 1); lower-index ties, float32 (ties=topk, score_dtype=model)",
            "14 priority heads of LLaVA-1.5-7B's 32 scaled with the model's heads (round(14 H / 32))",
            "a RoPE logit of exactly 0 (degenerate signals only) leaves its pair uncorrected (official: divides by 0)",
            "no FlashAttention switch: the v2.0 FlashAttention module forms the same softmax rows for scoring",
        ),
        _random(30, "test_methods_v3.py::test_sparsevlm2_reproduces_the_official_gravity_corrected_priority_head_"
                "ranking", "32 heads, the library's RoPE probe against the official all-ones RoPE"), 30,
        half_agreement=_half_exact("its scaled attention and RoPE logits in half", _ROPE_ONCE, 25, 9), half_cases=_HALF,
    ),
    "vscan": Fidelity(
        "a82450e1",
        "6 x 6 window scan of CLIP layer 6, global scan of layer 23, merging; LLM layer 16; 96 then 32 for 64; float32; Qwen2.5-VL (VScan/qwen/): greedy 4 x 4 window limits on the received attention (4-patch mean, window order undone; models.qwen) of the first full-attention block, global scan of the last, merging; LLM stage at half depth (14 of 28) with a third of the vision-stage tokens",  # fmt: skip
        ("score_dtype=model", "ties=topk"),
        (
            "lower-index ties, float32 (ties=topk, score_dtype=model: topk order, fp16); global scan excludes the local tokens",
            "local_count=fill lets the global scan fill the stage (the same at 96/192/288); official: fewer elsewhere",
            "grids other than 24 x 24 scan their full blocks (official: asserts 576); shallow layer scaled as HiPrune's",
            "merged tokens keep their kept token's slot and carry their cells", "Qwen: T_l = round(B llm_share) = T_v / 3 where the official keeps int(0.333 T_v) (one fewer when it truncates), T_v from the budget where the official takes int(0.167 N); a side under 4 merged tokens is one window (official: divides by 0)",
            "Qwen: the LLM stage's attention has M-RoPE applied as the layer applies it unless attention_rope=skipped (the official Qwen layer_prune leaves q and k unrotated; the LLaVA one rotates)", "LLaVA-NeXT (budget_scope=crop only, as its llava_arch.encode_images): scans and merging in each crop's padded grid, a kept padding patch dropped at unpadding with what merged into it; T_v is the image's, split evenly over the crops (official: 96 per crop); the LLM stage ranks every alive visual token by the last prompt token's attention and keeps T_l (the official layer_prune keeps LLaVA-1.5's lengths: it ranks only the image span's first min(96, span) tokens, the base view's kept ones, by the row at prompt_len + 95, inside the span, keeps 32 of them and leaves the tiles' tokens and newlines)",
        ),
        _random(30, "test_methods_v3.py::test_vscan_vision_stage_reproduces_the_official_scans_and_merging", "kept sets and merged 4096-dim features (atol 1e-5), vision stages 96/192/288; Qwen path: test_methods_qwen.py 36 of 36 (7B-like: 16 heads, 4 x 4 windows, 6..20-token sides, 3584-dim features); LLaVA-NeXT per crop: test_families_registry.py::test_vscan_runs_per_crop_on_llava_next_as_its_official_code, 2 of 2 tiny images (kept sets exact, merged inputs atol 1e-5)"), 30,  # fmt: skip
        half_agreement=_half_exact("the official half CLS head mean at the vision stage (the LLM stage, eager as FastV's: 30 of 30 too)", _ONCE + " (head)", 30, 30) + "; Qwen path in bf16 (the 7B's dtype), 16 x 20 tokens: 30 of 30 (and 10 + 10 tie cases) given the official thrice-rounded bf16 reductions, 0 of 30 given the adapter's float32 signal rounded once (20-25 distinct bf16 values among 320 tokens: the official set is mostly the kernel's order among ties; no half twin on Qwen)", half_cases=_HALF,  # fmt: skip
    ),
}

NOT_YET_DONE: tuple[str, ...] = ()

__all__ = ["Fidelity", "FIDELITY", "RANDOM_CASES", "NOT_YET_DONE"]
