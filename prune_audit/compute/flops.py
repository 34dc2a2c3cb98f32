"""Analytic FLOPs of every part of a pruned prefill, and its KV-cache bytes.

Conventions (those of ``torch.utils.flop_counter.FlopCounterMode``, so the two agree to the
FLOP): a (m, k) @ (k, n) product costs ``2 m k n``; a convolution ``2 x outputs x inputs per
output``; bias additions, norms, activations, softmax, RoPE and residual additions count zero.
Attention costs ``QK^T`` plus ``PV`` over every key, causal or not, as a dense kernel computes
them. Each formula names the tensors it counts; docs/compute.md derives them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prune_audit.compute.shape import ClipTextShape, LanguageShape, VisionShape
from prune_audit.flop_convention import matmul


def attention(queries: int, keys: int, heads: int, head_dim: int) -> int:
    """FLOPs of ``softmax(QK^T) V`` for ``queries`` rows over ``keys`` keys in ``heads`` heads of ``head_dim``."""
    return 2 * matmul(queries, head_dim, keys) * heads


# ----- vision ---------------------------------------------------------------------------------


def window_lengths(vision: VisionShape, patch_grid: tuple[int, int]) -> list[int]:
    """Patches in each attention window of a windowed layer (Qwen2.5-VL's ``get_window_index``).

    The merged-token grid is cut into ``window x window`` tiles from the top-left corner; the last
    row and column of tiles hold the remainder. Each merged token carries ``merge**2`` patches.
    """
    rows, columns = patch_grid[0] // vision.merge, patch_grid[1] // vision.merge

    def tiles(side: int) -> list[int]:
        return [vision.window] * (side // vision.window) + ([side % vision.window] if side % vision.window else [])

    return [r * c * vision.merge**2 for r in tiles(rows) for c in tiles(columns)]


def vision_layer_blocks(vision: VisionShape, patch_grid: tuple[int, int]) -> list[list[int]]:
    """For each encoder layer run, the lengths of the blocks it attends within (one block: global)."""
    tokens = vision.class_tokens + patch_grid[0] * patch_grid[1]
    windows = window_lengths(vision, patch_grid) if vision.window else [tokens]
    return [
        [tokens] if layer in vision.full_attention_layers or not vision.window else windows
        for layer in range(vision.layers)
    ]


def vision_tower(vision: VisionShape, patch_grid: tuple[int, int]) -> int:
    """Patch embedding and the encoder layers up to the feature layer, for one image of ``patch_grid`` patches."""
    patches = patch_grid[0] * patch_grid[1]
    tokens = vision.class_tokens + patches
    width = vision.width
    total = matmul(patches, vision.patch_inputs, width)
    for blocks in vision_layer_blocks(vision, patch_grid):
        total += 4 * matmul(tokens, width, width)  # q, k, v, out projections
        total += sum(attention(block, block, 1, width) for block in blocks)  # heads x head dim = width
        total += vision.mlp_matrices * matmul(tokens, width, vision.mlp_width)
    return total


def merging_tower(
    vision: VisionShape,
    patch_grid: tuple[int, int],
    merges: Sequence[int],
    after_mlp: bool = False,
    next_cls_row: bool = False,
) -> int:
    """ToMe's rerun of a global-attention tower (``location=tower``, ``models.llava``'s merging tower): the
    patch embedding, then per layer the q, k, v, out projections and attention over the tokens alive before
    its merge and the MLP over those after it (``merges[l]`` tokens merged between attention and MLP; with
    ``after_mlp`` merged after the MLP, which then runs on those alive before, MustDrop's step). ``next_cls_row``:
    the CLS row of the next layer on the final tokens (:func:`cls_row`; MustDrop's layer-23 key set)."""
    patches = patch_grid[0] * patch_grid[1]
    tokens, width = vision.class_tokens + patches, vision.width
    total = matmul(patches, vision.patch_inputs, width)
    for merged in merges:
        total += 4 * matmul(tokens, width, width) + attention(tokens, tokens, 1, width)
        total += vision.mlp_matrices * matmul(tokens - merged * (not after_mlp), width, vision.mlp_width)
        tokens -= merged
    return total + (cls_row(width, tokens) if next_cls_row else 0)


def projector(vision: VisionShape, tokens: int) -> int:
    """The projector on ``tokens`` language-model visual tokens."""
    return sum(matmul(tokens, inputs, outputs) for inputs, outputs in vision.projector)


def cls_probe(vision: VisionShape, patch_grid: tuple[int, int]) -> int:
    """CLS-row attention of one encoder layer, the feature layer's or the last (``models.probe.clip_cls_row``), over
    every patch and the class tokens (:func:`cls_row`)."""
    return cls_row(vision.width, vision.class_tokens + patch_grid[0] * patch_grid[1])


def cls_row(width: int, tokens: int) -> int:
    """``models.probe.clip_cls_row`` over ``tokens`` tokens of ``width``: the CLS query, every key, and the CLS
    logits twice (in float32 and as the official code forms them)."""
    return matmul(1, width, width) + matmul(tokens, width, width) + 2 * matmul(1, width, tokens)


def step_attention(vision: VisionShape, patch_grid: tuple[int, int], steps: int) -> int:
    """A clip's step attention (FastVID's, ``models.qwen`` ``_step_attention``) on ``steps`` temporal steps of
    ``patch_grid`` patches each: the last block's queries and keys of every patch, then each step's mean query
    against its merged tokens' mean keys (every head, ``width`` = heads x head dim)."""
    patches = steps * patch_grid[0] * patch_grid[1]
    merged = patch_grid[0] * patch_grid[1] // vision.merge**2
    return matmul(patches, vision.width, 2 * vision.width) + matmul(steps, vision.width, merged)


def vision_layer_probes(vision: VisionShape, patch_grid: tuple[int, int]) -> int:
    """Every encoder layer's attention recomputed on its input (``models.probe.clip_attention``, HiPrune's
    and VScan's per-layer signals): queries and keys of every token and the full logits matrix."""
    tokens = vision.class_tokens + patch_grid[0] * patch_grid[1]
    per_layer = 2 * matmul(tokens, vision.width, vision.width) + matmul(tokens, vision.width, tokens)
    return vision.layers * per_layer


def clip_text_relevance(clip: ClipTextShape, chunks: int, visual_tokens: int) -> int:
    """CDPruner's text relevance: the CLIP text tower on ``chunks`` padded chunks, both projections and the
    (N, chunks) cosine matrix twice (in float32 and as the official code forms it in the CLIP dtype)."""
    context, width = clip.context, clip.width
    per_layer = 4 * matmul(context, width, width) + attention(context, context, 1, width)
    per_layer += 2 * matmul(context, width, clip.mlp_width)
    return (
        chunks * clip.layers * per_layer
        + matmul(chunks, width, clip.projection)
        + matmul(visual_tokens, clip.vision_width, clip.projection)
        + 2 * matmul(visual_tokens, clip.projection, chunks)
    )


# ----- language model -------------------------------------------------------------------------


def _projection_flops_per_token(language: LanguageShape) -> int:
    """Q, K, V, O projections and the gated MLP for one token (everything linear in the length)."""
    d, heads, kv = language.head_dim, language.heads, language.kv_heads
    attention_projections = matmul(1, language.hidden, heads * d) + 2 * matmul(1, language.hidden, kv * d)
    attention_projections += matmul(1, heads * d, language.hidden)
    return attention_projections + 3 * matmul(1, language.hidden, language.intermediate)


def decoder_layer(language: LanguageShape, length: int, keys: int | None = None) -> int:
    """One decoder layer on ``length`` tokens attending over ``keys`` keys (default: the ``length`` tokens)."""
    keys = length if keys is None else keys
    return length * _projection_flops_per_token(language) + attention(length, keys, language.heads, language.head_dim)


def lm_head(language: LanguageShape, rows: int = 1) -> int:
    """The LM head on ``rows`` positions (the prefill reads the last position only)."""
    return matmul(rows, language.hidden, language.vocab)


def language_prefill(language: LanguageShape, lengths: Sequence[int]) -> int:
    """Every decoder layer at its realised sequence length ``lengths[l]``, plus the LM head at the last position."""
    return sum(decoder_layer(language, length) for length in lengths) + lm_head(language)


def decoder_probe(
    language: LanguageShape,
    queries: int,
    keys: int,
    attention_rows: bool,
    key_norms: bool,
    rope_columns: int = 0,
    values: bool = False,
) -> int:
    """A decoder layer's probe (``models.probe.DecoderProbe``): ``queries`` query rows over ``keys`` keys
    when attention is read, the keys once more when their norms are read, the all-ones RoPE logits
    of the query rows to ``rope_columns`` visual tokens (SparseVLM v2), and the values of the ``keys`` tokens
    when they are read (FlowCut)."""
    d = language.head_dim
    key_projection = matmul(keys, language.hidden, language.kv_heads * d)
    total = matmul(queries, d, rope_columns)
    if attention_rows:
        total += matmul(queries, language.hidden, language.heads * d) + key_projection
        total += matmul(queries, d, keys) * language.heads
    if key_norms:
        total += key_projection
    if values:  # the value projection has the key projection's shape
        total += key_projection
    return total


def decode_token(language: LanguageShape, cached: Sequence[int]) -> int:
    """One generated token after the prefill: each layer's new row attends over its ``cached[l]`` keys plus itself."""
    return sum(decoder_layer(language, 1, keys + 1) for keys in cached) + lm_head(language)


def kv_bytes(language: LanguageShape, lengths: Sequence[int], dtype_bytes: int) -> int:
    """KV-cache bytes after the prefill: keys and values of ``lengths[l]`` tokens in each layer."""
    return sum(2 * length * language.kv_heads * language.head_dim * dtype_bytes for length in lengths)


def flop_equivalent_tokens(language: LanguageShape, flops: float) -> float:
    """The sequence length ``n`` whose dense prefill through every decoder layer plus the LM head costs ``flops``.

    Solves ``layers (a n^2 + b n) + head = flops`` with ``a`` the attention and ``b`` the per-token
    FLOPs of one layer; 0 when ``flops`` does not exceed the LM head.
    """
    a = attention(1, 1, language.heads, language.head_dim)
    b = _projection_flops_per_token(language)
    per_layer = (flops - lm_head(language)) / language.layers
    if per_layer <= 0:
        return 0.0
    return (-b + math.sqrt(b * b + 4 * a * per_layer)) / (2 * a)


__all__ = [
    "matmul", "attention", "window_lengths", "vision_layer_blocks", "vision_tower", "merging_tower", "projector", "cls_probe", "cls_row",
    "vision_layer_probes", "clip_text_relevance", "decoder_layer", "lm_head", "language_prefill", "decoder_probe", "decode_token",
    "kv_bytes", "flop_equivalent_tokens",
]  # fmt: skip
