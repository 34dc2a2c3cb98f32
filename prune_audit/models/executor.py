"""The language-model loop that prunes visual tokens between decoder layers.

Stock ``forward``/``generate`` cannot drop tokens between layers, so the adapters
run the decoder layers themselves. A batch is a left-padded set of rows; every token
carries its kind (grid index for a visual token, or one of the negative codes below)
and its own position ids, so pruning is a per-row gather followed by re-packing, and
positions either stay the original ones or are renumbered (``compact``). Every layer
gets an explicit boolean attention mask (causal, padding, and a token always sees
itself so padded rows never produce NaN); non-contiguous positions without a mask
silently corrupt results in transformers 5.x.

A merging selector (``LayerSelector.merge``) also inserts tokens: they go after the
last kept visual token of the row (before the text after the image, as SparseVLM's
reference inserts its recycled tokens), count as visual tokens for later stages and
carry the kind ``merged_kind(j)``, ``j`` indexing the row's merged-token sources.
Under ``compact`` positions they are renumbered with every other token (the
reference); under ``keep_original`` (Qwen's M-RoPE ids, or LLaVA when asked) a merged
token takes the floor of its members' mean position in every plane. A merge with ``replaces``
(VScan) instead writes its tokens over kept ones, keeping their layout slots and positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from prune_audit.errors import PruneAuditError
from prune_audit.models.batch import Batch, TokenRow, attention_mask, compact_positions, gather_rows, pack
from prune_audit.models.insertion import Insertion, insertion_for, replace_in_place, with_insertions
from prune_audit.models.kinds import MERGED, PAD, TEXT_AFTER, TEXT_BEFORE, merged_index, prunable
from prune_audit.models.layer_signals import ATTENTION_SIGNALS, layer_signals
from prune_audit.models.probe import DecoderProbe, RopeFn, single_tensor_rope
from prune_audit.pruners.base import LayerSelector, Stage


@dataclass
class DecoderStack:
    """What the loop needs from a decoder-only language model.

    ``rotary(hidden (B, L, D), positions (P, B, L)) -> (cos, sin)`` each (B, L, d);
    ``apply_rope`` is the family's own ``apply_rotary_pos_emb`` restricted to one tensor.
    """

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    rotary: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
    apply_rope: RopeFn
    config: Any
    #: ``(layer index, output hidden (B, L, D), batch) -> hidden`` after each prefill layer: what a family adds
    #: to the residual stream there (Qwen3-VL's deepstack features, by each visual token's kind)
    after_layer: Callable[[int, Tensor, Batch], Tensor] | None = None

    @classmethod
    def one_dimensional(cls, model: nn.Module, text_config: Any) -> DecoderStack:
        """The stack of a ``*ForConditionalGeneration`` whose ``model.language_model`` is a Llama-layout decoder
        with one row of position ids and Llama's rotary application (LLaVA-1.5, InternVL3, LLaVA-OneVision)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        language = model.model.language_model
        return cls(
            embed_tokens=language.embed_tokens,
            layers=language.layers,
            norm=language.norm,
            lm_head=model.lm_head,
            rotary=lambda hidden, positions: language.rotary_emb(hidden, positions[0]),
            apply_rope=single_tensor_rope(apply_rotary_pos_emb),
            config=text_config,
        )

    def probe(self, layer: int) -> DecoderProbe:
        return DecoderProbe(self.layers[layer], self.apply_rope)


@dataclass
class LayerPlan:
    """How the loop prunes inside the language model, per batch row.

    ``stages[b]`` are row b's stages; at each one the kept set comes from
    ``forced[b][i]`` (explicit grid indices) when given, else from ``selector.prune``.
    ``vision[b]``: row b's vision-tower signals an in-LLM selector reads (name -> (Lv, N) over
    the grid cells, :data:`~prune_audit.pruners.signals.VISION_LAYER_SIGNALS`).
    """

    stages: list[list[Stage]]
    grids: list[tuple[int, int]]
    positions: str = "keep_original"
    selector: LayerSelector | None = None
    forced: list[list[Tensor]] | None = None
    states: list[dict[str, Any]] = field(default_factory=list)
    merged: list[list[list[int]]] = field(default_factory=list)  # per row: grid sources of merged token j
    vision: list[dict[str, Tensor]] = field(default_factory=list)
    grid_parts: list[tuple[tuple[int, int], ...]] = field(default_factory=list)  # per row: LayerSignals.grid_parts
    video_grids: list[tuple[int, int, int] | None] = field(default_factory=list)  # per row: LayerSignals.video_grid

    def __post_init__(self) -> None:
        if not self.states:
            self.states = [{} for _ in self.stages]
        if not self.merged:
            self.merged = [[] for _ in self.stages]

    @property
    def requires(self) -> frozenset[str]:
        return self.selector.requires if self.selector is not None and self.forced is None else frozenset()

    @property
    def attention_in_model_dtype(self) -> bool:
        """True when the selector scores attention as the official code forms it in the model dtype."""
        return self.selector is not None and self.selector.score_dtype == "model"

    @property
    def model_attention(self) -> str:
        """How the probe forms the attention in the model dtype (``MODEL_ATTENTIONS``): the selector's recipe."""
        return self.selector.model_attention if self.selector is not None else "eager"

    @property
    def rotates_attention(self) -> bool:
        """False when the selector's attention signals leave q and k unrotated (``attention_rope="skipped"``)."""
        return self.selector is None or self.selector.attention_rope == "applied"

    @property
    def signal_layer(self) -> str:
        """``"previous"`` when the selector scores a stage at layer l with layer l-1's attention and keys."""
        return self.selector.signal_layer if self.selector is not None else "current"


@dataclass
class Prefill:
    """Result of a prefill: last-position logits and the provenance of every row.

    ``kept_stages[b][s]``: grid indices whose own token survives stage s;
    ``merged_stages[b][s]``: for every merged token alive after stage s (layout order),
    the ascending grid indices it carries.
    """

    logits: Tensor  # (B, V) float32
    kept_stages: list[list[list[int]]]
    stage_layers: list[list[int]]
    tokens_per_layer: list[list[int]]
    prefill_tokens: list[int]
    decode: DecodeState | None = None
    merged_stages: list[list[list[list[int]]]] = field(default_factory=list)
    latency_parts: dict[str, float] = field(default_factory=dict)  # batch milliseconds of each part (models.timing)


@dataclass
class DecodeState:
    """KV cache and per-layer key validity for greedy decoding after a pruned prefill."""

    cache: Any
    key_valid: list[Tensor]  # per layer (B, K_l)
    next_position: Tensor  # (P, B) position of the next token under keep_original
    positions: str
    planes: int


class LanguageLoop:
    """Runs the decoder layers of one model with pruning stages and optional KV cache."""

    def __init__(self, stack: DecoderStack):
        self.stack = stack

    @property
    def num_layers(self) -> int:
        return len(self.stack.layers)

    @torch.no_grad()
    def prefill(self, batch: Batch, plan: LayerPlan | None = None, use_cache: bool = False) -> Prefill:
        """Run every decoder layer, pruning at the input of each stage layer of ``plan``.

        Stages are applied before the layer runs, so a stage at layer l sees the signals
        at the input of l and layers l.. process only the survivors.
        """
        from transformers import DynamicCache

        plan = plan or LayerPlan(stages=[[] for _ in range(batch.size)], grids=[(0, 0)] * batch.size)
        cache = DynamicCache(config=self.stack.config) if use_cache else None
        alive_stages: list[list[list[int]]] = [[] for _ in range(batch.size)]
        stage_layers: list[list[int]] = [[] for _ in range(batch.size)]
        counts: list[list[int]] = [[] for _ in range(batch.size)]
        key_valid: list[Tensor] = []
        key_kinds: list[Tensor] = []  # each layer's token kinds, its cache's columns (the decode stage reads them)
        previous: Tensor | None = None
        rope, mask = self.stack.rotary(batch.hidden, batch.positions), attention_mask(batch.valid)
        visual = batch.visual_counts()
        for index, layer in enumerate(self.stack.layers):
            due = [[s for s in stages if s.layer == index] for stages in plan.stages]
            if any(due):
                batch, previous = self._prune(batch, previous, index, due, plan, alive_stages)
                for b, stages in enumerate(due):
                    stage_layers[b].extend([index] * len(stages))
                rope, mask = self.stack.rotary(batch.hidden, batch.positions), attention_mask(batch.valid)
                visual = batch.visual_counts()
            for b, count in enumerate(visual):
                counts[b].append(count)
            previous = batch.hidden
            hidden = layer(
                batch.hidden,
                attention_mask=mask,
                position_embeddings=rope,
                cache=cache,
                use_cache=use_cache,
            )
            if self.stack.after_layer is not None:
                hidden = self.stack.after_layer(index, hidden, batch)
            batch = replace(batch, hidden=hidden)
            key_valid.append(batch.valid)
            key_kinds.append(batch.kinds)
        logits = self.stack.lm_head(self.stack.norm(batch.hidden[:, -1])).float()
        prefill_tokens = key_valid[0].sum(dim=1).tolist()  # after a stage at layer 0 (VScan's vision stage)
        if use_cache and plan.selector is not None and plan.selector.decode_keeps_final:
            key_valid = final_cache_keys(key_valid, key_kinds, batch, plan)
        decode = self._decode_state(batch, cache, key_valid, plan.positions) if use_cache else None
        kept_stages = [[[kind for kind in alive if kind >= 0] for alive in row] for row in alive_stages]
        merged_stages = [
            [[plan.merged[b][merged_index(kind)] for kind in alive if kind < MERGED] for alive in row]
            for b, row in enumerate(alive_stages)
        ]
        return Prefill(logits, kept_stages, stage_layers, counts, prefill_tokens, decode, merged_stages)

    @staticmethod
    def _decode_state(batch: Batch, cache: Any, key_valid: list[Tensor], positions: str) -> DecodeState:
        # the next token follows the largest position of its row in every plane (as Qwen's rope deltas do)
        last = batch.positions.masked_fill(~batch.valid[None], -1).amax(dim=(0, 2)) + 1
        planes = batch.positions.shape[0]
        return DecodeState(cache, key_valid, last[None].expand(planes, -1).clone(), positions, planes)

    @torch.no_grad()
    def decode_step(self, state: DecodeState, token_ids: Tensor) -> Tensor:
        """Feed one token per row (B,) through every layer; returns (B, V) float32 logits."""
        hidden = self.stack.embed_tokens(token_ids)[:, None]
        for index, layer in enumerate(self.stack.layers):
            valid = torch.cat([state.key_valid[index], torch.ones_like(state.key_valid[index][:, :1])], dim=1)
            if state.positions == "compact":
                position = state.key_valid[index].sum(dim=1)[None].expand(state.planes, -1)
            else:
                position = state.next_position
            rope = self.stack.rotary(hidden, position[..., None])
            state.key_valid[index] = valid
            hidden = layer(
                hidden,
                attention_mask=valid[:, None, None, :],
                position_embeddings=rope,
                cache=state.cache,
                use_cache=True,
            )
        state.next_position = state.next_position + 1
        return self.stack.lm_head(self.stack.norm(hidden[:, -1])).float()

    def _prune(
        self,
        batch: Batch,
        previous: Tensor | None,
        layer: int,
        due: list[list[Stage]],
        plan: LayerPlan,
        alive_stages: list[list[list[int]]],
    ) -> tuple[Batch, Tensor | None]:
        keep_columns, insertions = [], []
        for b in range(batch.size):
            columns, insertion = batch.row_indices(b), None
            for stage in due[b]:
                if insertion is not None:
                    raise PruneAuditError(f"a merging stage at layer {layer} must be the last stage at that layer")
                columns, insertion = self._stage_columns(batch, previous, b, columns, layer, stage, plan, alive_stages)
            keep_columns.append(columns)
            insertions.append(insertion)
        if any(insertion is not None for insertion in insertions):
            batch, keep_columns = with_insertions(batch, keep_columns, insertions)
            previous = None  # layer l-1's input has no merged tokens; the loop resets it before layer l runs
        pruned = gather_rows(batch, keep_columns)
        if previous is not None:
            previous = gather_rows(replace(batch, hidden=previous, embeddings=None), keep_columns).hidden
        if plan.positions == "compact":
            pruned = compact_positions(pruned)
        return pruned, previous

    def _stage_columns(
        self,
        batch: Batch,
        previous: Tensor | None,
        row: int,
        columns: Tensor,
        layer: int,
        stage: Stage,
        plan: LayerPlan,
        alive_stages: list[list[list[int]]],
    ) -> tuple[Tensor, Insertion | None]:
        """Layout columns of ``row`` that survive ``stage`` (text always survives), and the tokens it inserts."""
        kinds = batch.kinds[row, columns]
        visual = torch.nonzero(prunable(kinds)).flatten()
        alive = kinds[visual]
        stage_index = len(alive_stages[row])
        merge = None
        if plan.forced is not None:
            wanted = plan.forced[row][stage_index].to(alive.device)
            missing = sorted(set(wanted.tolist()) - set(alive.tolist()))
            if missing:
                raise PruneAuditError(
                    f"forced kept set of stage {stage_index} (layer {layer}) holds grid indices {missing[:8]} "
                    f"that are no longer alive; forced stages must be nested"
                )
            survivors = torch.nonzero(torch.isin(alive, wanted)).flatten()
        else:
            text = torch.nonzero(kinds == TEXT_AFTER).flatten()
            signals = layer_signals(self.stack, batch, previous, row, columns, layer, plan, visual, text)
            survivors = plan.selector.prune(stage, signals, plan.states[row]).to(alive.device)
            merge = plan.selector.merge(stage, signals, plan.states[row], survivors.cpu())
        keep = torch.ones(columns.numel(), dtype=torch.bool, device=columns.device)
        keep[visual] = False
        keep[visual[survivors]] = True
        insertion = None
        if merge is not None and merge.num_tokens and merge.replaces is not None:
            replace_in_place(batch, row, columns[visual], alive, merge, plan.merged[row])
        elif merge is not None and merge.num_tokens:
            insertion = insertion_for(batch, row, columns[visual], alive, merge, plan.merged[row])
            # after the last kept visual token = before the first kept text-after token
            insertion.at = int((keep & ((kinds != TEXT_AFTER) & (kinds != PAD))).sum())
        alive_stages[row].append(alive[survivors].tolist() + ([] if insertion is None else insertion.kinds.tolist()))
        return columns[keep], insertion


def final_cache_keys(key_valid: list[Tensor], key_kinds: list[Tensor], batch: Batch, plan: LayerPlan) -> list[Tensor]:
    """The decode stage of a selector with ``decode_keeps_final`` (MustDrop): each layer's (B, K_l) valid keys with
    the visual tokens the last stage dropped masked, from the layer whose attention scores the row's first stage on
    (``signal_layer="previous"``: the layer before it), or from layer 0 under ``decode_keeps_final_everywhere``
    (PruneVid). Masking the cache's columns is attending to the official
    sliced cache (``index_select`` of the last stage's survivors): the positions under ``compact`` count the valid
    keys, as the official per-layer cache length does; the products (and the KV bytes) stay those of the cache.

    Args:
        key_valid, key_kinds: per layer, the (B, K_l) valid keys and kinds of its cache's columns after prefill.
        batch: the batch after the last layer (its alive visual kinds are the last stage's survivors).
    """
    previous = plan.signal_layer == "previous"
    everywhere = plan.selector is not None and plan.selector.decode_keeps_final_everywhere  # PruneVid's: layer 0 on
    masked = [valid.clone() for valid in key_valid]  # one valid tensor may stand for several layers
    for row, stages in enumerate(plan.stages):
        if not stages:
            continue
        survivors = batch.kinds[row][prunable(batch.kinds[row]) & batch.valid[row]]
        for layer in range(0 if everywhere else max(stages[0].layer - previous, 0), len(masked)):
            kinds = key_kinds[layer][row]
            masked[layer][row] &= ~(prunable(kinds) & ~torch.isin(kinds, survivors))
    return masked


__all__ = [
    "ATTENTION_SIGNALS", "TEXT_BEFORE", "TEXT_AFTER", "PAD", "MERGED", "DecoderStack", "TokenRow", "Batch",
    "pack", "gather_rows", "attention_mask", "LayerPlan", "Prefill", "DecodeState", "LanguageLoop", "final_cache_keys",
]  # fmt: skip
