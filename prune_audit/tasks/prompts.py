"""A task's instruction composed with its question text, once.

A task owns the instruction its official evaluation puts after the question (LLaVA-1.5's question
files and ``model_vqa_science.py``, lmms-eval's task ``post_prompt``); a model family owns only the
conversation wrapper around the composed text (``VisionLanguageModel.prompt``). Question files
differ in whether they already carry the instruction (LLaVA's GQA and POPE files do, GQA's own
question JSON and the official POPE files do not), so the composition keeps a text that already
carries it and refuses one that carries another task's instruction, which would contradict it.
"""

from __future__ import annotations

from prune_audit.data.captions import PROMPT as DETAILED_DESCRIPTION
from prune_audit.data.gqa import INSTRUCTION as SHORT_ANSWER
from prune_audit.data.scienceqa import INSTRUCTION as OPTION_LETTER
from prune_audit.errors import PruneAuditError

INSTRUCTIONS: tuple[str, ...] = (SHORT_ANSWER, OPTION_LETTER, DETAILED_DESCRIPTION)
"""The built-in tasks' instructions: a question text carrying one of them asks for that kind of answer."""


def compose_prompt(text: str, instruction: str, where: str) -> str:
    """``text`` followed by ``instruction`` on its own line (the text alone when it already carries it, the
    instruction alone for an empty text); ``where`` names the question in the refusal of a text that carries
    another instruction."""
    text = text.rstrip()
    if not instruction or instruction in text:
        return text
    contradicting = next((other for other in INSTRUCTIONS if other != instruction and other in text), None)
    if contradicting is not None:
        raise PruneAuditError(
            f"{where} already asks {contradicting!r}, which contradicts this task's {instruction!r}; pass the task's "
            f"own question files (docs/tasks.md)"
        )
    return f"{text}\n{instruction}" if text else instruction


__all__ = ["DETAILED_DESCRIPTION", "INSTRUCTIONS", "OPTION_LETTER", "SHORT_ANSWER", "compose_prompt"]
