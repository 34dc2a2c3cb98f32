"""The context-length check: a question's prompt plus the tokens it adds must fit the model's positions.

A decoder answers past its ``max_position_embeddings`` without a word (rotary tables extend to any position;
the demo then answers "arrow arrow ..."), or runs out of memory on a very long prompt. So every question is
checked before it is answered: ``run`` checks its whole question list before writing anything
(``runner.plan``), the Python API each call's questions, and ``VisionLanguageModel.answer`` each batch.

A prompt counts the largest position id of its unpruned prompt plus one: its token count for the
one-dimensional families, fewer for Qwen's M-RoPE ids (the text after the image advances by the image's
larger side, not by its token count). Pruning never raises a position, so the unpruned prompt bounds every
selector's. A scored answer adds one position per token. Greedy decoding adds its limit where the caller chose
it (``--max-new-tokens``, ``max_new_tokens=``), refused when it does not fit; a task's default limit is instead
cut at the model's last position (:func:`generation_limits`), so a long default (captions: 1024) still runs on
a small model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prune_audit.answer_modes import AnswerMode, Continuation, Greedy
from prune_audit.errors import PruneAuditError
from prune_audit.models.answers import continuation_token_ids

if TYPE_CHECKING:
    from prune_audit.models.base import VisionLanguageModel
    from prune_audit.models.prepared import Prepared

SHOWN_CHARACTERS = 40
"""How much of a question's text a message quotes when the caller gives no name for it."""


def max_positions(vlm: VisionLanguageModel) -> int:
    """Positions the language model was trained for: its text config's ``max_position_embeddings``."""
    return int(vlm.loop.stack.config.max_position_embeddings)


def prompt_positions(vlm: VisionLanguageModel, item: Prepared) -> int:
    """Positions the unpruned prompt of ``item`` takes: its largest position id plus one."""
    return int(vlm.full_positions(item).max()) + 1


def added_positions(vlm: VisionLanguageModel, mode: AnswerMode, *, chosen_limit: bool) -> int:
    """Positions ``mode`` needs after the prompt: a scored answer's tokens; greedy decoding's limit when the caller
    chose it (``chosen_limit``), else one token (decoding stops at the model's last position); none else."""
    if isinstance(mode, Greedy):
        return mode.max_new_tokens if chosen_limit else 1
    if isinstance(mode, Continuation):
        return len(continuation_token_ids(vlm.tokenizer, mode.text))
    return 0


def check_context(
    vlm: VisionLanguageModel,
    prepared: Sequence[Prepared],
    mode: AnswerMode,
    names: Sequence[str] | None = None,
    *,
    chosen_limit: bool = True,
) -> None:
    """Refuse, in one line naming the question and the limit, the first of ``prepared`` whose prompt positions plus
    those ``mode`` adds (:func:`added_positions`) exceed the model's; ``names[i]`` names question ``i`` (default:
    its text)."""
    limit, added = max_positions(vlm), added_positions(vlm, mode, chosen_limit=chosen_limit)
    for index, item in enumerate(prepared):
        prompt = prompt_positions(vlm, item)
        if prompt + added <= limit:
            continue
        name = names[index] if names is not None else f"question {_shown(item.question)!r}"
        greedy = isinstance(mode, Greedy)
        parts = f"{prompt} for its prompt" + (f" + {added} {'new' if greedy else 'answer'} tokens" if added else "")
        fix = "shorten the question" + " or lower --max-new-tokens (max_new_tokens)" * (greedy and chosen_limit)
        raise PruneAuditError(
            f"{name} needs {prompt + added} positions ({parts}) but {vlm.model_id} has "
            f"{limit} (max_position_embeddings); {fix}"
        )


def generation_limits(vlm: VisionLanguageModel, prepared: Sequence[Prepared], max_new_tokens: int) -> list[int]:
    """Per question, the tokens greedy decoding may add: ``max_new_tokens``, cut where the model's positions end."""
    limit = max_positions(vlm)
    return [max(1, min(max_new_tokens, limit - prompt_positions(vlm, item))) for item in prepared]


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."


__all__ = ["added_positions", "check_context", "generation_limits", "max_positions", "prompt_positions"]
