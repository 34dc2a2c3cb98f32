"""Attention-row probes: eager attention probabilities for a few query rows only.

The models run with SDPA, which returns no attention weights, and selectors need
only a handful of rows (the CLS row of one CLIP layer, the text rows of one decoder
layer). The probes recompute those rows from the layer's own projections, exactly as
the layer's eager path would: decoder layers apply ``input_layernorm``, the per-head
query/key norms where the layer has them (Qwen3), RoPE with the positions the layer
receives, repeat K/V heads for GQA and the ``1/sqrt(d)`` scale;
the softmax is taken in float32 over every key the row can see (selectors spec §1.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

RopeFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def single_tensor_rope(apply_rotary_pos_emb: Callable) -> RopeFn:
    """A family's ``apply_rotary_pos_emb(q, k, cos, sin)`` applied to one tensor."""

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    return apply


def _head_norm(attention: nn.Module, name: str, states: Tensor) -> Tensor:
    """(1, L, heads, d) projections through the attention's per-head ``q_norm``/``k_norm`` when it has one
    (Qwen3 normalises each head's queries and keys before RoPE), else unchanged."""
    norm = getattr(attention, name, None)
    return states if norm is None else norm(states)


@dataclass
class DecoderProbe:
    """Query/key/value access to one decoder layer of a Llama-style language model.

    Attributes:
        layer: the decoder layer (``input_layernorm`` and ``self_attn`` with
            ``q_proj``/``k_proj``, ``head_dim``, ``scaling``).
        apply_rope: ``(x (1, heads, L, d), cos (1, L, d), sin (1, L, d)) -> x`` as the layer applies it.
    """

    layer: nn.Module
    apply_rope: RopeFn

    def keys(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(Hkv, L, d) post-RoPE keys of one sequence; ``hidden`` is (L, D), cos/sin (L, d)."""
        attention = self.layer.self_attn
        normed = self.layer.input_layernorm(hidden[None])
        keys = attention.k_proj(normed).view(1, hidden.shape[0], -1, attention.head_dim)
        keys = _head_norm(attention, "k_norm", keys).transpose(1, 2)
        return self.apply_rope(keys, cos[None], sin[None])[0]

    def values(self, hidden: Tensor) -> Tensor:
        """(Hkv, L, d) values of one sequence (no RoPE, no head norm touches them); ``hidden`` is (L, D)."""
        attention = self.layer.self_attn
        normed = self.layer.input_layernorm(hidden[None])
        return attention.v_proj(normed).view(hidden.shape[0], -1, attention.head_dim).transpose(0, 1)

    def queries(self, hidden: Tensor, rows: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(H, R, d) post-RoPE queries of ``rows`` (R,) of one sequence."""
        attention = self.layer.self_attn
        normed = self.layer.input_layernorm(hidden[rows][None])
        queries = attention.q_proj(normed).view(1, rows.numel(), -1, attention.head_dim)
        queries = _head_norm(attention, "q_norm", queries).transpose(1, 2)
        return self.apply_rope(queries, cos[rows][None], sin[rows][None])[0]

    def dot_products(self, hidden: Tensor, rows: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(H, R, L) float32 unscaled ``q.k`` of ``rows`` to every key.

        Args:
            hidden: (L, D) input of the layer for one sequence without padding.
            rows: (R,) query indices into the sequence.
            cos, sin: (L, d) rotary tables for the positions the layer receives.
        """
        queries = self.queries(hidden, rows, cos, sin).float()
        keys = self.keys(hidden, cos, sin).float()
        groups = queries.shape[0] // keys.shape[0]
        keys = keys.repeat_interleave(groups, dim=0)  # GQA: head h reads K/V head h // groups
        return queries @ keys.transpose(1, 2)

    def logits(self, hidden: Tensor, rows: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(H, R, L) float32 pre-softmax logits ``q.k * scaling`` of ``rows`` to every key (see :meth:`dot_products`)."""
        return self.dot_products(hidden, rows, cos, sin) * self.layer.self_attn.scaling

    def rope_ones_logits(
        self, rows: Tensor, columns: Tensor, cos: Tensor, sin: Tensor, in_model_dtype: bool = False
    ) -> Tensor:
        """(R, C) float32 ``q.k / sqrt(d)`` of all-ones queries at ``rows`` and keys at ``columns`` under this
        layer's RoPE; cos/sin (L, d) as in :meth:`dot_products` (SparseVLM v2's position "gravity").

        ``in_model_dtype``: as SparseVLM v2.0 forms them in the model dtype, ``q.k`` rounded (accumulated in
        float32, as a GPU's half GEMM), then divided by sqrt(d) and rounded."""
        head_dim = self.layer.self_attn.head_dim
        ones = cos.new_ones(1, 1, cos.shape[0], head_dim)
        rotated = self.apply_rope(ones, cos[None], sin[None])[0, 0]  # (L, d) in the model dtype
        dots = rotated[rows].float() @ rotated[columns].float().T
        if not in_model_dtype:
            return dots / math.sqrt(head_dim)
        return (dots.to(rotated.dtype).float() / math.sqrt(head_dim)).to(rotated.dtype).float()

    def probabilities(
        self,
        hidden: Tensor,
        rows: Tensor,
        cos: Tensor,
        sin: Tensor,
        in_model_dtype: bool = False,
        recipe: str = "eager",
    ) -> tuple[Tensor, Tensor]:
        """Logits and causal softmax of ``rows`` over all earlier keys, both (H, R, L) float32.

        ``in_model_dtype`` (``score_dtype="model"``): as the official code forms them in the dtype of
        ``hidden``, ``q.k`` rounded to it (float32 accumulation, as half-precision GEMMs on GPU), then by
        ``recipe`` (:data:`~prune_audit.pruners.base.MODEL_ATTENTIONS`): ``"eager"`` (LLaVA-era
        ``LlamaAttention``) divides by ``sqrt(d)`` and rounds, takes the softmax in float32 and rounds;
        ``"scaled"`` (SparseVLM's ``scaled_dot_product_attention``) multiplies by ``1/sqrt(d)`` in the
        model dtype and takes the softmax of the half logits, on the model's device as the official code
        does. No-op in float32.
        """
        visible = torch.arange(hidden.shape[0], device=hidden.device)[None, :] <= rows[:, None]
        if not in_model_dtype or hidden.dtype == torch.float32:
            logits = self.logits(hidden, rows, cos, sin)
            return logits, torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        dtype, head_dim = hidden.dtype, self.layer.self_attn.head_dim
        dot_products = self.dot_products(hidden, rows, cos, sin).to(dtype)
        if recipe == "scaled":
            logits = dot_products * (1 / math.sqrt(head_dim))
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            return logits.float(), probs.float()
        logits = (dot_products.float() / math.sqrt(head_dim)).to(dtype).float()
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).to(dtype).float()
        return logits, probs


def clip_cls_row(layer: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """CLS-row attention and keys of one CLIP encoder layer.

    Args:
        layer: a ``CLIPEncoderLayer`` (``layer_norm1``, ``self_attn`` with q/k projections).
        hidden: (B, 1 + N, Dv) input of that layer, CLS at index 0.

    Returns:
        ``(probs, keys, logits)``: (B, H, 1 + N) float32 softmax of the CLS query over all
        tokens (CLIP vision attention is not causal), (B, H, 1 + N, d) the layer's keys, and
        (B, H, 1 + N) float32 the CLS logits as the official eager code forms them in the
        model's dtype: the query scaled in that dtype, then ``q . k`` accumulated in float32
        (``score_dtype="model"`` rounds them to the model dtype before its softmax).
    """
    attention = layer.self_attn
    batch, length, _ = hidden.shape
    normed = layer.layer_norm1(hidden)
    queries = attention.q_proj(normed[:, :1]).view(batch, 1, -1, attention.head_dim).transpose(1, 2)
    keys = attention.k_proj(normed).view(batch, length, -1, attention.head_dim).transpose(1, 2)
    # HF CLIP scales inside the attention function, not in q_proj
    logits = queries.float() @ keys.float().transpose(2, 3) * attention.scale
    official = (queries * attention.scale).float() @ keys.float().transpose(2, 3)
    return torch.softmax(logits, dim=-1)[:, :, 0], keys, official[:, :, 0]


def clip_logits(layer: nn.Module, hidden: Tensor) -> Tensor:
    """(B, H, 1 + N, 1 + N) float32 attention logits of one CLIP encoder layer on its input (products
    accumulated in float32, then scaled).

    Args:
        layer: a ``CLIPEncoderLayer``; hidden: (B, 1 + N, Dv) its input, CLS at index 0.
    """
    attention = layer.self_attn
    batch, length, _ = hidden.shape
    normed = layer.layer_norm1(hidden)
    queries = attention.q_proj(normed).view(batch, length, -1, attention.head_dim).transpose(1, 2)
    keys = attention.k_proj(normed).view(batch, length, -1, attention.head_dim).transpose(1, 2)
    return queries.float() @ keys.float().transpose(2, 3) * attention.scale


def clip_attention(layer: nn.Module, hidden: Tensor) -> Tensor:
    """(B, H, 1 + N, 1 + N) float32 attention probabilities of one CLIP encoder layer on its input."""
    return torch.softmax(clip_logits(layer, hidden), dim=-1)


def clip_attention_block(layer: nn.Module, hidden: Tensor, key_bias: Tensor | None) -> tuple[Tensor, AttentionHeads]:
    """The attention half of one CLIP encoder layer with a bias per key, and what its heads computed (the block
    a tower selector's step reads: ToMe's head-mean keys, FlowCut's CLS row and values).

    Args:
        layer: a ``CLIPEncoderLayer``; hidden: (L, Dv) its input (one image, CLS first).
        key_bias: (L,) added to every query's logit of each key (ToMe's proportional attention: ``log(size)``),
            or None.

    Returns:
        ``(attended, heads)``: (L, Dv) the self-attention output before the residual, and the layer's
        :class:`AttentionHeads`.
    """
    attention = layer.self_attn
    length = hidden.shape[0]
    normed = layer.layer_norm1(hidden[None])
    heads = [
        projection(normed).view(1, length, -1, attention.head_dim).transpose(1, 2)
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
    ]
    queries, keys, values = heads
    logits = queries.float() @ keys.float().transpose(2, 3) * attention.scale
    if key_bias is not None:
        logits = logits + key_bias.float()
    probs = torch.softmax(logits, dim=-1)
    mixed = probs.to(values.dtype) @ values  # (1, H, L, d)
    attended = attention.out_proj(mixed.transpose(1, 2).reshape(1, length, -1))
    return attended[0], AttentionHeads(probs[0, :, 0], keys[0], values[0])


@dataclass
class AttentionHeads:
    """What one CLIP layer's attention heads computed on its (L, Dv) input, CLS first.

    Attributes:
        cls_probs: (H, L) float32 the CLS query's attention probabilities over every token.
        keys: (H, L, d) the keys; values: (H, L, d) the values (the layer's dtype).
    """

    cls_probs: Tensor
    keys: Tensor
    values: Tensor


__all__ = [
    "DecoderProbe",
    "clip_attention",
    "clip_logits",
    "clip_attention_block",
    "AttentionHeads",
    "clip_cls_row",
    "single_tensor_rope",
    "RopeFn",
]
