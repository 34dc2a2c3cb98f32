"""The :class:`~prune_audit.pruners.signals.LayerSignals` of one batch row at a pruning stage.

Attention, key and value signals are read with the probe of the stage's own layer on its
input, or, for a selector whose ``signal_layer`` is ``"previous"``, with the probe of
the layer before on *its* input: the same tokens (nothing is pruned between the two),
so the probe reproduces what that layer computed, as FastV / SparseVLM / DART's
official code read it from ``output_attentions`` / the returned key states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from prune_audit.errors import PruneAuditError
from prune_audit.models.kinds import TEXT_AFTER
from prune_audit.pruners.signals import LayerSignals

if TYPE_CHECKING:
    from prune_audit.models.executor import Batch, DecoderStack, LayerPlan, TokenRow

ATTENTION_SIGNALS = frozenset({"text_logits", "text_probs", "visual_probs"})
VISUAL_ROW_SIGNALS = frozenset({"visual_probs"})
"""Attention signals whose query rows are the alive visual tokens (the probe reads them besides the text rows)."""
KEY_SIGNALS = frozenset({"key_norms", "text_key_norms"})
VALUE_SIGNALS = frozenset({"values", "text_values"})
ROPE_SIGNALS = frozenset({"rope_ones_logits"})


def _f32(tensor: Tensor) -> Tensor:
    return tensor.detach().float().cpu()


def layer_signals(
    stack: DecoderStack,
    batch: Batch,
    previous: Tensor | None,
    row: int,
    columns: Tensor,
    layer: int,
    plan: LayerPlan,
    visual: Tensor,
    text: Tensor,
) -> LayerSignals:
    """Signals at the input of ``layer`` for batch row ``row``; only the fields the plan's selector requires.

    Args:
        previous: (B, L, D) input of layer ``layer - 1`` in ``batch``'s layout, or None at layer 0.
        columns: (m,) the row's valid layout columns.
        visual: (n,) positions in ``columns`` of the alive visual tokens.
        text: (T,) positions in ``columns`` of the text tokens after the image.
    """
    requires = plan.requires
    hidden = batch.hidden[row, columns]
    kinds = batch.kinds[row, columns]
    signals = LayerSignals(
        alive=kinds[visual].cpu(), grid=plan.grids[row], layer=layer, num_layers=len(stack.layers),
        model_dtype=hidden.dtype, grid_parts=plan.grid_parts[row] if plan.grid_parts else (),
        video_grid=plan.video_grids[row] if plan.video_grids else None,
    )  # fmt: skip
    if batch.origin is not None:
        origin = batch.origin[row, columns].cpu()
        signals.sequence_index, signals.text_sequence_index = origin[visual.cpu()], origin[text.cpu()]

    def previous_input() -> Tensor:
        if previous is None:
            raise PruneAuditError(f"layer {layer} has no previous layer; prune at layer 1 or later")
        return previous[row, columns]

    if requires & (ATTENTION_SIGNALS | KEY_SIGNALS | ROPE_SIGNALS | VALUE_SIGNALS):
        source_layer, source = (layer - 1, previous_input()) if plan.signal_layer == "previous" else (layer, hidden)
        cos, sin = stack.rotary(source[None], batch.positions[:, row : row + 1, columns])
        probe = stack.probe(source_layer)
        if requires & ATTENTION_SIGNALS:
            # the identity rotation where the selector's official code skips RoPE (VScan's Qwen layer_prune)
            turn = (cos[0], sin[0]) if plan.rotates_attention else (torch.ones_like(cos[0]), torch.zeros_like(sin[0]))
            rows = torch.cat([text, visual]) if requires & VISUAL_ROW_SIGNALS else text
            logits, probs = probe.probabilities(
                source, rows, *turn, plan.attention_in_model_dtype, plan.model_attention
            )
            texts = slice(0, text.numel())
            signals.text_logits = _f32(logits[:, texts][:, :, visual])
            signals.text_probs = _f32(probs[:, texts][:, :, visual])
            if requires & VISUAL_ROW_SIGNALS:
                signals.visual_probs = _f32(probs[:, text.numel() :][:, :, visual])
        if requires & KEY_SIGNALS:
            norms = probe.keys(source, cos[0], sin[0]).float().abs().sum(dim=(0, 2))
            signals.key_norms, signals.text_key_norms = _f32(norms[visual]), _f32(norms[text])
        if requires & VALUE_SIGNALS:
            values = probe.values(source)
            signals.values, signals.text_values = _f32(values[:, visual]), _f32(values[:, text])
        if requires & ROPE_SIGNALS:
            signals.rope_ones_logits = _f32(
                probe.rope_ones_logits(text, visual, cos[0], sin[0], plan.attention_in_model_dtype)
            )
    if requires & {"hidden_states", "text_hidden_states"}:
        signals.hidden_states, signals.text_hidden_states = _f32(hidden[visual]), _f32(hidden[text])
    if requires & {"normed_hidden_states", "text_normed_hidden_states"}:
        normed = stack.norm(hidden)
        signals.normed_hidden_states, signals.text_normed_hidden_states = _f32(normed[visual]), _f32(normed[text])
    if "previous_hidden_states" in requires:
        signals.previous_hidden_states = _f32(previous_input()[visual])
    for name, value in plan.vision[row].items():  # the vision-layer signals the selector reads on this model
        if not isinstance(value, Tensor):  # a tower fact (VISION_TOWER_FACTS)
            setattr(signals, name, value)
            continue
        per_cell = value.float().cpu()  # (Lv, N) over the grid cells
        alive = signals.alive
        values = per_cell.new_full((per_cell.shape[0], alive.numel()), float("nan"))
        cells = alive >= 0
        values[:, cells] = per_cell[:, alive[cells]]
        setattr(signals, name, values)
    if requires & {"embeddings", "text_embeddings"}:
        embeddings = batch.embeddings[row, columns]
        signals.embeddings, signals.text_embeddings = _f32(embeddings[visual]), _f32(embeddings[text])
    return signals


def text_demand(stack: DecoderStack, row: TokenRow) -> Tensor:
    """(N,) layer-0 attention of the text after the image to each visual token of the unpruned ``row``.

    Probe of decoder layer 0 over the full prompt; probabilities (softmax over every visible
    key) averaged over heads and over the text rows after the image (coverage's demand).
    """
    cos, sin = stack.rotary(row.embeddings[None], row.positions[:, None])
    text = torch.nonzero(row.kinds == TEXT_AFTER).flatten()
    _, probs = stack.probe(0).probabilities(row.embeddings, text, cos[0], sin[0])
    visual = torch.nonzero(row.kinds >= 0).flatten()
    return probs[:, :, visual].mean(dim=(0, 1))
