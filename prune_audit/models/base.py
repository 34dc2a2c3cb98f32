"""The model-family-independent part of a pruned vision-language model.

A family adapter (``llava.py``, ``qwen.py``, ...) declares what it provides (signals, positions, token grids,
prompt templates, its offline ``build_tiny``), turns an image and a question into a :class:`Prepared` prompt,
runs its vision tower, and says how positions work. This class holds those family hooks and the public API:
which selectors run, the pruned prefill through :class:`~prune_audit.models.executor.LanguageLoop` (assembled
by ``models.prefill_assembly``), and the answer modes of ``models.answers``: the yes/no and option-letter
reductions of the first token, and greedy decoding that reuses the pruned KV cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from prune_audit.compute.budget import Schedules
from prune_audit.compute.shape import ModelShape
from prune_audit.errors import PruneAuditError
from prune_audit.models.answering import AnswerModes
from prune_audit.models.answers import answer_token_ids
from prune_audit.models.executor import DecoderStack, LanguageLoop, Prefill, TokenRow, pack
from prune_audit.models.parts import config_hash
from prune_audit.models.prefill_assembly import layer_plan, select_input, token_row, vision_layer_requests
from prune_audit.models.prepared import ForcedStages, Prepared, VisionOutput, check_request, check_resized
from prune_audit.models.selector_support import SelectorSupport
from prune_audit.models.timing import PartClock
from prune_audit.models.video_sampling import VIDEO_SAMPLING_KEYS
from prune_audit.pruners.base import InputSelector, LayerSelector, Selection, Selector, Stage
from prune_audit.pruners.composed import ComposedSelector, RunSelector, budget_parts, selector_parts
from prune_audit.pruners.registry import list_selectors, selector_class
from prune_audit.pruners.signals import VIDEO_GRID, VISION_TOWER_FACTS


class VisionLanguageModel(SelectorSupport, AnswerModes, ABC):
    """A loaded VLM that answers questions under any registered selector (in each answer mode: ``AnswerModes``)."""

    family: str = ""
    #: InputSignals fields this family can provide (``text_relevance`` also needs clip_text)
    input_signals: frozenset[str] = frozenset()
    #: InputSignals read from a CLS-row probe / from every vision layer's attention (compute accounting)
    cls_probe_signals: frozenset[str] = frozenset()
    layer_probe_signals: frozenset[str] = frozenset()
    #: whether the tower sees an image as several crops whose tokens ``crop_tokens`` lists (``budget_scope="crop"``)
    several_crops: bool = False
    #: selectors ``refused_selectors`` refuses on the whole image that run on each crop's own grid under
    #: ``budget_scope="crop"`` (as their official code does on this family)
    crop_grid_selectors: frozenset[str] = frozenset()
    #: one-grid selectors that run on each of the image's regular grids (``grid_parts``) -> how (for messages)
    per_grid_selectors: Mapping[str, str] = MappingProxyType({})
    #: the dimensions the compute accounting reads (``models.shape``), set by the family
    shape: ModelShape
    #: why the other InputSignals are missing, for error messages
    missing_signals_reason: str = ""
    #: the family's name in messages
    display_name: str = ""
    #: accepted ``prompt_template`` values; the first is the default
    prompt_templates: tuple[str, ...] = ()
    #: position ids after input-level selection: 'compact' (renumbered) or 'keep_original' (each token keeps its id)
    input_positions: str = "compact"
    #: how an image's visual tokens lie: "one grid" (rows x cols) or "several grids" (anyres base view and tiles)
    token_grids: str = "one grid"
    #: selectors refused whatever signals are present -> what the family lacks for them
    refused_selectors: Mapping[str, str] = MappingProxyType({})
    #: the box convention of its grounding answers (``data.boxes.BOX_CONVENTIONS``: prompt, box syntax and frame, as
    #: its official grounding evaluation has them); None: the family has none, and grounding questions are refused
    grounding: str | None = None
    #: whether :meth:`prepare_for` resizes the image for an input selector that acts on it
    #: (``InputSelector.resizes_image``): the processor then sets the token grid of the resized image
    resizes_images: bool = False
    #: whether :meth:`prepare_video` reads video clips (the Qwen2.5-VL adapter's video path)
    takes_video: bool = False
    #: the keys a checkpoint may declare in ``video_sampling.json`` (``models.video_sampling``): qwen-vl-utils' pixels
    video_sampling_keys: tuple[str, ...] = VIDEO_SAMPLING_KEYS

    # ----- loading ------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def transformers_class(cls) -> type:
        """The transformers ``*ForConditionalGeneration`` class of this family's checkpoints."""

    @classmethod
    @abstractmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, **sizes: Any
    ) -> Path:
        """Save a random-weight checkpoint of this family (config, weights, image processor, tokenizer) to
        ``save_dir`` and return it, offline: the tests' and the demo's models. ``words`` join the tokenizer's
        vocabulary; ``sizes`` are the family builder's other keywords (widths, image size), tiny by default."""

    @classmethod
    @abstractmethod
    def from_model(
        cls, model, source: str, *, prompt_template: str | None, system_prompt: str | None, clip_text: str | None
    ) -> VisionLanguageModel:
        """The adapter around a loaded ``model``; reads the processor parts from ``source``."""

    @classmethod
    def resolve_template(cls, prompt_template: str | None) -> str:
        """``prompt_template`` or the family default; one-line error when the family has no such template."""
        template = prompt_template or cls.prompt_templates[0]
        if template not in cls.prompt_templates:
            raise PruneAuditError(
                f"unknown {cls.display_name} prompt template {template!r}; choose {' or '.join(cls.prompt_templates)}"
            )
        return template

    @classmethod
    def check_clip_text(cls, clip_text: object) -> None:
        """Refuse a CLIP text tower for families without a CLIP vision space (LLaVA overrides)."""
        if clip_text is not None:
            raise PruneAuditError(
                f"clip_text applies to LLaVA's CLIP vision tower; {cls.display_name} has no CLIP space"
            )

    def __init__(
        self, model, tokenizer, stack: DecoderStack, *, model_id: str, prompt_template: str, system_prompt: str | None
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.loop = LanguageLoop(stack)
        self.model_id = model_id
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt
        # {task name: instruction} where this checkpoint's own evaluation differs from the task's (models.task_instructions)
        self.task_instructions: dict[str, str] = {}
        # how this checkpoint samples clips, where not the family's default (models.video_sampling_keys)
        self.video_sampling: dict[str, int] = {}
        self._schedules = Schedules()
        self.yes_ids = answer_token_ids(tokenizer, "yes")
        self.no_ids = answer_token_ids(tokenizer, "no")
        if not self.yes_ids or not self.no_ids:
            raise PruneAuditError(f"the tokenizer of {model_id} has no single token for 'yes' or 'no'")

    # ----- family hooks -------------------------------------------------------------
    @abstractmethod
    def prepare(self, image, question: str) -> Prepared:
        """Process one PIL image and question into a prompt (its ``geometry`` is :meth:`token_geometry`'s)."""

    def read_clip(self, frames: Any, video_fps: float) -> Any:
        """The ``data.video.Clip`` of ``frames`` (a frame folder, or PIL images of one size) at ``video_fps``,
        sampled and resized as the family's own video pipeline reads a clip; a family without a video path
        (``takes_video`` false) refuses in one line."""
        raise self.no_video_path()

    def prepare_video(self, clip: Any, question: str) -> Prepared:
        """One (clip, question) prompt through the family's video path (``data.video.Clip``); a family without one
        (``takes_video`` false) refuses in one line."""
        raise self.no_video_path()

    def no_video_path(self) -> PruneAuditError:
        """The one-line refusal of a clip by a family that reads none."""
        return PruneAuditError(
            f"{self.display_name} has no video path here; use a checkpoint of a family that reads clips (docs/models.md "
            "lists them)"
        )

    def prepare_for(self, image, question: str, selector: RunSelector | None = None, budget: Any = None) -> Prepared:
        """:meth:`prepare` as a run of ``selector`` at ``budget`` needs the prompt: as given here; a family that
        ``resizes_images`` resizes the image first for an input part acting on it (:meth:`image_resizer`)."""
        return self.prepare(image, question)

    def image_resizer(self, selector: RunSelector | None) -> InputSelector | None:
        """The input part of ``selector`` when it acts on the image on this family (``resizes_image`` honoured
        by :meth:`prepare_for`; the prefill then keeps every token of the resized image), else None."""
        part = selector_parts(selector)[0]
        return part if part is not None and part.resizes_image and self.resizes_images else None

    @abstractmethod
    def token_geometry(self, image_size: tuple[int, int]) -> Any:
        """Which original pixels each visual token of an image of ``image_size`` (width, height) sees.

        The family's declaration of its preprocessing, read from its loaded processor and config through
        the pure functions of ``data.geometry`` / ``data.multigrid``: a ``TokenGeometry``, or a
        ``MultiGridGeometry`` for families giving an image several grids. Needs no image and no weights
        (``import --geometry`` loads the processor only).
        """

    @abstractmethod
    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        """Run the vision tower once for the batch; fill the requested InputSignals fields."""

    @abstractmethod
    def full_positions(self, prepared: Prepared) -> Tensor:
        """(P, L) position ids of the unpruned prompt."""

    @abstractmethod
    def _layer_positions(self, selector: LayerSelector | None) -> str:
        """Position mode the in-LLM loop uses for ``selector``."""

    def text_relevance(self, prepared: Prepared, vision: VisionOutput) -> tuple[Tensor, Tensor]:
        """(N,) CDPruner relevance in float32 and (N,) as the official code computes it in the model dtype."""
        raise PruneAuditError(f"{self.family} has no CLIP text relevance")

    def project(self, vision_tokens: Tensor) -> Tensor:
        """(M, Dv) pre-projector tokens -> (M, D) language-model inputs (merging selectors)."""
        raise PruneAuditError(f"merging selectors are not supported on {self.family}")

    def _family_description(self) -> dict[str, Any]:
        return {}

    def tower_crops(self, prepared: Prepared) -> dict[str, Any]:
        """How the vision tower ran on ``prepared`` when not on one image of its grid: ``crops`` and ``crop_grid``
        (:class:`~prune_audit.compute.cost.QuestionTokens`; LLaVA-NeXT overrides)."""
        return {}

    @abstractmethod
    def prompt(self, question: str) -> str:
        """The full prompt text (template, system text) with one image placeholder and ``question``."""

    @cached_property
    def _special_tokens(self) -> frozenset[str]:
        """The tokenizer's special tokens (its named ones and every added token marked special), read once."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {})
        return frozenset(
            token
            for token in (
                *getattr(self.tokenizer, "all_special_tokens", ()),
                *(added.content for added in decoder.values() if added.special),
            )
            if token
        )

    def check_question(self, question: str) -> None:
        """Refuse, in one line, a question holding one of the tokenizer's special tokens (the image placeholder
        ``<image>``, chat-template markers): the processor would take it for part of the template, so the prompt
        would not be the one the template builds. Planning and the Python API call it before anything runs."""
        found = sorted(token for token in self._special_tokens if token in question)
        if found:
            raise PruneAuditError(
                f"the question {question[:80]!r} holds {found[0]!r}, a special token of {self.model_id}'s prompt "
                f"template; remove it from the question (the template places the image itself)"
            )

    # ----- direct forwards: the demo trainer and evaluator (``demo/``) ---------------
    # The families the demo recipes train (llava, qwen2_5_vl) implement them, and Qwen2-VL inherits them
    # (tested equal to the stock forward); the others refuse in one line (``without_direct_forwards``).
    @property
    def vision_state_width(self) -> int:
        """Width of the pooled and per-token states :meth:`vision_states` returns."""
        raise self._no_direct_forwards()

    def image_inputs(self, images: Sequence[Any]) -> dict[str, Tensor]:
        """Keyword inputs of :meth:`image_features` / :meth:`vision_states` for PIL images."""
        raise self._no_direct_forwards()

    def array_inputs(self, images: Tensor) -> dict[str, Tensor]:
        """:meth:`image_inputs` of (B, H, W, 3) uint8 images already at the tower's size."""
        raise self._no_direct_forwards()

    def image_features(self, **inputs: Tensor) -> Tensor | list[Tensor]:
        """Per image its (N, D) projected features, the language model's image inputs, in grid order."""
        raise self._no_direct_forwards()

    def vision_states(self, **inputs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The vision tower once, differentiable: (B, N, D) projected features, (B, Dv) pooled state and
        (B, N, Dv) per-token states."""
        raise self._no_direct_forwards()

    def shared_prefix_logits(
        self,
        features: Tensor,
        prefix_ids: Tensor,
        image_positions: Tensor,
        suffixes: Sequence[Tensor],
        per_image: int,
        grid: tuple[int, int] | None = None,
        every_position: bool = False,
    ) -> Tensor:
        """(B * per_image, V) logits after each suffix sharing one image prefix, or (B * per_image, T, V) at
        ``every_position`` (:func:`~prune_audit.models.shared_prefix.shared_prefix_logits`)."""
        raise self._no_direct_forwards()

    def first_token_logits(self, input_ids: Tensor, attention_mask: Tensor, features: Sequence[Tensor]) -> Tensor:
        """(B, V) logits at the last position of left-padded (B, L) prompts through the stock forward, row b's
        image tokens filled by the (k_b, D) ``features[b]``."""
        raise self._no_direct_forwards()

    def _no_direct_forwards(self) -> PruneAuditError:
        return PruneAuditError(
            f"{self.display_name} has no direct forwards for the demo trainer and evaluator; "
            f"the demo recipes train llava or qwen2_5_vl"
        )

    # ----- public API ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return self.loop.num_layers

    def describe(self) -> dict[str, Any]:
        """Everything a run manifest needs to reproduce the model side of a run."""
        return {
            "model": {"id": self.model_id, "config_hash": config_hash(self.model.config.to_dict())},
            "family": self.family,
            "prompt": {"template": self.prompt_template, "system": self.system_prompt},
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "attn_implementation": self.model.config._attn_implementation,
            "num_layers": self.num_layers,
            "answer_tokens": {"yes": self.yes_ids, "no": self.no_ids},
            **self._family_description(),
        }

    def supported_selectors(self) -> list[str]:
        """Registered selectors whose signals this model can provide."""
        return [name for name in list_selectors() if self._missing(selector_class(name)) == set()]

    # ----- internals ----------------------------------------------------------------
    def _missing(self, cls: type[Selector]) -> set[str]:
        """What this loaded model lacks for ``cls`` (:meth:`missing_for` on the signals it has)."""
        return self.missing_for(cls, self._available_input_signals())

    def _available_input_signals(self) -> frozenset[str]:
        return self.input_signals

    def _clip_signals(self, prepared: Sequence[Prepared]) -> frozenset[str]:
        """The input signals a batch of prompts adds to the family's: a video clip's temporal grid when every prompt
        is a clip (``Prepared.video_grid``), none otherwise."""
        clips = bool(prepared) and all(item.video_grid is not None for item in prepared)
        return frozenset({VIDEO_GRID}) if clips else frozenset()

    def signals_for(self, selector: Selector | type[Selector]) -> frozenset[str]:
        """The signals ``selector`` (a class, or an instance whose options may change them) reads on this model
        (``Selector.requires_on`` its input signals)."""
        return Selector.requires_on(selector, self._available_input_signals())

    def positions_for(self, selector: RunSelector | None) -> str:
        """Position mode ('compact' or 'keep_original') the language model sees under ``selector`` (None: forced
        in-LLM stages; a composed selector: its in-LLM part's, on the input part's tokens)."""
        if isinstance(selector, ComposedSelector):
            return self._layer_positions(selector.llm)
        if isinstance(selector, InputSelector):
            return self.input_positions
        return self._layer_positions(selector)

    def crop_tokens(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """Per crop the tower ran on (``budget_scope="crop"``): its (M_c,) ascending visual tokens and their
        (rows, cols) grid; one crop here."""
        return [(torch.arange(item.num_visual), item.grid)]

    def grid_parts(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """Per regular grid of the image: its (M_g,) ascending visual tokens and (rows, cols); one grid here."""
        return [(torch.arange(item.num_visual), item.grid)]

    def check_selector(self, selector: RunSelector, prepared: Sequence[Prepared] = ()) -> None:
        """Raise a one-line PruneAuditError when this model cannot provide the selector's signals (a composed
        selector: each part's) on ``prepared`` (clips add their temporal grid: ``_clip_signals``)."""
        if isinstance(selector, ComposedSelector):
            for part in selector.parts:
                self.check_selector(part, prepared)
            return
        per_crop = getattr(selector, "budget_scope", "image") == "crop"
        # a merging selector runs per crop only where its official code does (VisionZip on LLaVA-NeXT)
        if per_crop and (
            not self.several_crops
            or getattr(selector, "merges", False)
            and selector.name not in self.crop_grid_selectors
        ):
            why = (
                f"{selector.name} merges tokens"
                + " (per grid under budget_scope=image)" * (selector.name in self.per_grid_selectors)
                if self.several_crops
                else f"{self.family} sees each "
                "image as one crop (it applies to LLaVA-NeXT, LLaVA-OneVision and tiled InternVL)"
            )
            raise PruneAuditError(
                f"budget_scope=crop splits the budget over an image's crops, and {why}; drop --option budget_scope=crop"
            )
        # the instance: its options may change what it reads (ToMe location=tower, PruMerge signal_layer)
        if per_crop and self.runs_per_crop(selector, self._available_input_signals()):
            return
        reason = self.refusal(selector, self._available_input_signals() | self._clip_signals(prepared))
        if reason is None:
            return
        raise PruneAuditError(
            f"selector {selector.name!r} {reason}; selectors that work here: {', '.join(self.supported_selectors())}"
        )

    def prefill(
        self,
        prepared: Sequence[Prepared],
        selector: RunSelector | None = None,
        budget: Any = None,
        *,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        forced_kept: Sequence[Sequence[int]] | None = None,
        forced_stages: Sequence[ForcedStages] | None = None,
        use_cache: bool = False,
    ) -> tuple[Prefill, list[Selection | None]]:
        """The pruned prefill behind :meth:`answer`: (B, V) float32 last-position logits,
        per-row provenance, and the input-level selection of each row (None in-LLM).

        A composed selector (``budget``: one per part) selects from the encoder output with its input-level part,
        then prunes the reduced sequence with its in-LLM part, whose schedule is solved on the tokens fed."""
        if not prepared:
            raise PruneAuditError("no questions to answer")
        check_request(len(prepared), selector, budget, generator, forced_kept, forced_stages)
        if selector is not None:
            self.check_selector(selector, prepared)
        input_part, llm_part = selector_parts(selector)
        if (resizer := self.image_resizer(selector)) is not None:  # it acted in prepare_for: every token is fed
            check_resized(prepared, resizer.name, budget_parts(selector, budget)[0])
            input_part = None
        input_budget, llm_budget = budget_parts(selector, budget)
        input_level = forced_kept is not None or input_part is not None
        requires = self.signals_for(input_part) if input_part is not None and forced_kept is None else frozenset()
        vision_layer = vision_layer_requests(self, llm_part) if llm_part is not None else frozenset()
        clock = PartClock(self.device)
        with torch.no_grad():
            vision = self._vision(prepared, requires | vision_layer)
            clock.lap("vision")
            selections: list[Selection | None] = [None] * len(prepared)
            rows = []
            for b, (item, output) in enumerate(zip(prepared, vision)):
                if input_level:
                    item_generator = generator[b] if isinstance(generator, (list, tuple)) else generator
                    selections[b] = select_input(
                        self,
                        item,
                        output,
                        input_part,
                        input_budget,
                        item_generator,
                        requires,
                        None if forced_kept is None else forced_kept[b],
                    )
                rows.append(self.input_row(item, output, selections[b]))
            plan = None
            if llm_part is not None or forced_stages is not None:
                plan = layer_plan(self, prepared, llm_part, llm_budget, forced_stages, selections)
                travels = vision_layer | (VISION_TOWER_FACTS if vision_layer else frozenset())
                plan.vision = [
                    {name: value for name, value in output.signals.items() if name.removeprefix("model_") in travels}
                    for output in vision
                ]
            carry = plan is not None and bool(plan.requires & {"embeddings", "text_embeddings"})
            clock.lap("selection")
            try:
                result = self.loop.prefill(pack(rows, carry_embeddings=carry), plan, use_cache=use_cache)
            except ValueError as error:
                if isinstance(error, PruneAuditError) or selector is None:
                    raise
                raise PruneAuditError(f"selector {selector.name!r} failed at budget {budget}: {error}") from None
            clock.lap("prefill")
            result.latency_parts = clock.read()
            return result, selections

    def input_row(self, item: Prepared, output: VisionOutput, selection: Selection | None) -> TokenRow:
        """The language-model input of one prompt with the selection applied (family hook: the one-grid layout of
        :func:`~prune_audit.models.prefill_assembly.token_row`; LLaVA-NeXT adds its row newlines)."""
        return token_row(self, item, output, selection)

    def schedule(self, selector: LayerSelector, num_visual: int, budget: int) -> list[Stage]:
        """The in-LLM selector's stages on this model for ``num_visual`` tokens at ``budget`` (``compute.budget``)."""
        return self._schedules.solve(selector, self.num_layers, num_visual, budget)


__all__ = ["VisionLanguageModel"]


DIRECT_FORWARDS = (
    "vision_state_width",
    "image_inputs",
    "array_inputs",
    "image_features",
    "vision_states",
    "shared_prefix_logits",
    "first_token_logits",
)


def without_direct_forwards(adapter: type[VisionLanguageModel]) -> type[VisionLanguageModel]:
    """Class decorator: ``adapter`` refuses the demo's direct forwards in one line although its parent
    implements them, because they assume the parent's one crop and stock vision outputs."""
    for name in DIRECT_FORWARDS:
        setattr(adapter, name, VisionLanguageModel.__dict__[name])
    return adapter
