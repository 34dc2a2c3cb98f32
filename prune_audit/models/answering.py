"""Answering a batch in an answer mode: the part of :class:`~prune_audit.models.base.VisionLanguageModel`
that turns a pruned prefill into answers (yes/no and option letters from the first token, greedy
decoding that reuses the pruned KV cache), kept apart so that the model base stays about pruning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from prune_audit.models.accounting import question_cost
from prune_audit.models.answers import (
    YES_NO,
    Answer,
    AnswerMode,
    Continuation,
    Greedy,
    OptionLetters,
    Reduction,
    answer_record,
    continuation_token_ids,
    greedy_generations,
    letter_token_ids,
    reduce_letters,
    reduce_yes_no,
    score_continuation,
)
from prune_audit.models.context import check_context, generation_limits
from prune_audit.models.timing import PartClock

if TYPE_CHECKING:
    from prune_audit.models.executor import Prefill
    from prune_audit.models.prepared import ForcedStages, Prepared
    from prune_audit.pruners.base import Selector


class AnswerModes:
    """Mixin of ``VisionLanguageModel``: ``answer`` in every answer mode, ``generate``, ``check_answer_mode``.

    Uses the model's ``prefill``, ``loop``, ``tokenizer``, ``model``, ``model_id``, ``device``, ``yes_ids``
    and ``no_ids``.
    """

    def answer(
        self,
        prepared: Sequence[Prepared],
        selector: Selector | None = None,
        budget: int | None = None,
        *,
        mode: AnswerMode = YES_NO,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        forced_kept: Sequence[Sequence[int]] | None = None,
        forced_stages: Sequence[ForcedStages] | None = None,
    ) -> list[Answer]:
        """Answers for a batch under ``selector`` at ``budget`` (None: unpruned), in answer ``mode``
        (default: the first token's yes/no probabilities).

        ``generator`` is one generator shared in row order, or one per question (then a
        random selection does not depend on batching). ``forced_kept[b]`` replaces
        input-level selection by explicit grid indices; ``forced_stages[b]`` lists
        ``(layer, kept grid indices)`` in-LLM stages. ``latency_parts`` holds each part's batch time
        divided by the batch size (``vision``, ``selection``, ``prefill`` and, for :class:`Greedy` and
        :class:`Continuation`, ``decode``); ``latency_ms`` is their sum; ``cost`` the analytic FLOPs and KV bytes.
        A question whose prompt (with its scored answer) overruns the model's positions is refused first, and greedy
        decoding stops at the model's last position (``models.context``).
        """
        check_context(self, prepared, mode, chosen_limit=False)  # a chosen generation limit: its caller checks it
        prefill, selections = self.prefill(
            prepared,
            selector,
            budget,
            generator=generator,
            forced_kept=forced_kept,
            forced_stages=forced_stages,
            use_cache=isinstance(mode, (Greedy, Continuation)),
        )
        clock = PartClock(self.device)
        reductions = self._reduce(prefill, prepared, mode)
        clock.lap("decode")
        parts = {part: ms / len(prepared) for part, ms in prefill.latency_parts.items()}
        if isinstance(mode, (Greedy, Continuation)):  # a first-token answer's reduction is not a part (no decoding)
            parts["decode"] = clock.read()["decode"] / len(prepared)
        latency = sum(parts.values())
        forced = forced_kept is not None or forced_stages is not None
        answers = []
        for b, reduced in enumerate(reductions):
            answer = answer_record(prepared[b].num_visual, prefill, b, selections[b], reduced, latency, parts)
            cost = question_cost(self, prepared[b], answer, selector, budget, selections[b], forced)
            answers.append(replace(answer, cost=cost))
        return answers

    def _reduce(self, prefill: Prefill, prepared: Sequence[Prepared], mode: AnswerMode) -> Sequence[Reduction]:
        if isinstance(mode, OptionLetters):
            letter_ids = [letter_token_ids(self.tokenizer, letter, self.model_id) for letter in mode.letters]
            return reduce_letters(prefill.logits, letter_ids, mode.letters)
        if isinstance(mode, Greedy):
            with torch.no_grad():
                limits = generation_limits(self, prepared, mode.max_new_tokens)
                return greedy_generations(self.loop, prefill, self.eos_ids(), self.tokenizer, limits)
        if isinstance(mode, Continuation):
            with torch.no_grad():
                return score_continuation(
                    self.loop, prefill, continuation_token_ids(self.tokenizer, mode.text), mode.text
                )
        return reduce_yes_no(prefill.logits, self.yes_ids, self.no_ids)

    def check_answer_mode(self, mode: AnswerMode) -> None:
        """Refuse, in one line, an answer mode this model's tokenizer cannot carry out (an option letter without
        a single token); planning calls it before anything is written."""
        if isinstance(mode, OptionLetters):
            for letter in mode.letters:
                letter_token_ids(self.tokenizer, letter, self.model_id)

    def generate(
        self,
        prepared: Prepared,
        selector: Selector | None = None,
        budget: int | None = None,
        max_new_tokens: int = 16,
        *,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        forced_kept: Sequence[int] | None = None,
        forced_stages: ForcedStages | None = None,
    ) -> str:
        """Greedy decoding under pruning; the pruned KV cache is reused for every new token."""
        [answer] = self.answer(
            [prepared],
            selector,
            budget,
            mode=Greedy(max_new_tokens),
            generator=generator,
            forced_kept=None if forced_kept is None else [forced_kept],
            forced_stages=None if forced_stages is None else [forced_stages],
        )
        return answer.answer

    def eos_ids(self) -> list[int]:
        """Token ids that end greedy decoding: the generation config's and the tokenizer's end-of-sequence."""
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
        return [*ids, *([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])]


__all__ = ["AnswerModes"]
