"""The Python pruning API: load a model once, then answer, choose, generate and score answers under any selector.

>>> from prune_audit import load, pruned
>>> vlm = load("demo")                                              # doctest: +SKIP
>>> with pruned(vlm, "fastv", budget=64) as model:                  # doctest: +SKIP
...     out = model.generate(image, "Describe this image.", max_new_tokens=32)
...     out.text, out.kept_stages, out.sequence_probability

``load`` is the loader of ``prune-audit run`` (``models.load_vlm`` after the same device and
thread checks); ``pruned`` builds the selector as ``--selector NAME --option KEY=VALUE`` does
(every option checked against its declared domain) and answers through the pruned prefill and
KV cache of ``VisionLanguageModel.answer``, grouped per image budget as ``run`` groups them.
Every refused input is one :class:`~prune_audit.errors.PruneAuditError` line naming the cause
and the fix, as on the command line; no run directory is written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.errors import PruneAuditError

if TYPE_CHECKING:
    import torch

    from prune_audit.answer_modes import AnswerMode
    from prune_audit.compute.budget import Budget
    from prune_audit.compute.cost import PrefillCost
    from prune_audit.models import Answer, Prepared, VisionLanguageModel
    from prune_audit.pruners.composed import RunSelector

ImageInput = Any
"""A ``PIL.Image.Image`` (converted to RGB) or the path of an image file (opened as ``run`` opens it)."""


@dataclass(frozen=True)
class PrunedResult:
    """What every answer carries besides the answer itself: the provenance of the visual tokens and the cost.

    Attributes:
        text: the answer as text ("yes"/"no", the chosen letter, or the generated text).
        confidence: the answer's probability in its mode (two-way yes/no probability of the answer, the letter's
            probability over the offered letters, the generated sequence's probability, a scored answer's
            probability).
        kept_stages: per stage, the kept grid indices after it (row-major on the model's token grid; one stage for
            input-level selectors, none for the unpruned model).
        merged_stages: per stage, the grid indices each merged token alive after it carries (empty lists without
            merging).
        stage_layers: per stage, the decoder layer whose input its kept set is (0 for input-level selection).
        grid: (rows, cols) of the image's visual token grid; grid indices lie in ``[0, rows * cols)``.
        visual_tokens_avg: realised visual tokens averaged over the decoder layers.
        cost: analytic FLOPs and KV-cache bytes of the prefill (docs/compute.md).
        latency_ms: wall time of the question (batch time / batch size), by part in ``latency_parts``.
    """

    text: str
    confidence: float
    kept_stages: list[list[int]]
    merged_stages: list[list[list[int]]]
    stage_layers: list[int]
    grid: tuple[int, int]
    visual_tokens_avg: float
    cost: PrefillCost
    latency_ms: float
    latency_parts: dict[str, float]


@dataclass(frozen=True)
class YesNoResult(PrunedResult):
    """A yes/no answer from the first token: ``p_yes``/``p_no`` over the full vocabulary (case and space
    variants summed) and ``p_yes_2way = p_yes / (p_yes + p_no)``."""

    p_yes: float
    p_no: float
    p_yes_2way: float


@dataclass(frozen=True)
class ChoiceResult(PrunedResult):
    """An option letter from the first token: ``letter_probs`` is each offered letter's full-vocabulary
    probability, in ``letters`` order."""

    letters: tuple[str, ...]
    letter_probs: tuple[float, ...]


@dataclass(frozen=True)
class GenerationResult(PrunedResult):
    """Greedy decoding over the pruned KV cache: ``sequence_probability`` (= ``confidence``) is the product of
    ``token_probs``; ``stopped`` is False when cut at ``max_new_tokens``."""

    sequence_probability: float
    token_probs: tuple[float, ...]
    stopped: bool


@dataclass(frozen=True)
class ScoreResult(PrunedResult):
    """A given answer (``text``) scored by teacher forcing through the pruned KV cache: ``log_probability`` sums
    its tokens' log-probabilities (``token_probs``), ``confidence`` is ``exp(log_probability)``, and ``is_greedy``
    says greedy decoding would produce every one of its tokens (lmms-eval's loglikelihood answer)."""

    log_probability: float
    token_probs: tuple[float, ...]
    is_greedy: bool


def load(
    model: str | Path = "demo",
    *,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    prompt_template: str | None = None,
    clip_text: str | Path | None = None,
) -> VisionLanguageModel:
    """A model loaded as ``prune-audit run --model`` loads it.

    Args:
        model: a local checkpoint folder, a hub id (read from the local cache when offline), or a bundled demo:
            ``"demo"`` (LLaVA architecture) and ``"demo-qwen"`` (Qwen2.5-VL) answer yes or no to every prompt (POPE
            only); their task twins ``"demo-tasks"`` and ``"demo-qwen-tasks"`` also caption, answer GQA and
            ScienceQA and read the demo's words (TextVQA), and ``"demo-tasks"`` grounds its expressions (RefCOCO).
        device: auto (CUDA when available), cpu, cuda or cuda:N.
        dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16.
        threads: torch's CPU threads (default: $OMP_NUM_THREADS, else the usable cores), as ``--threads``.
        prompt_template, clip_text: as ``--prompt-template`` and ``--clip-text``.
    """
    from prune_audit.demo import DEMO_MODELS
    from prune_audit.demo.assets import is_demo_name
    from prune_audit.models import load_vlm
    from prune_audit.runner.model import check_device
    from prune_audit.threads import configure_threads

    for name, value in (("model", model), ("device", device), ("dtype", dtype)):
        if not isinstance(value, (str, Path)) or not str(value).strip():
            raise PruneAuditError(f"{name} must be a non-empty string, got {value!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        raise PruneAuditError(f"threads must be a whole number of CPU threads or None, got {threads!r}")
    check_device(device)
    configure_threads(threads)
    source = DEMO_MODELS[str(model)] if is_demo_name(str(model)) else model
    return load_vlm(source, device=device, dtype=dtype, prompt_template=prompt_template, clip_text=clip_text)


@contextmanager
def pruned(
    vlm: VisionLanguageModel, selector: str = "none", budget: Budget = None, *, seed: int = 0, **options: Any
) -> Iterator[PrunedModel]:
    """``vlm`` under ``selector`` at ``budget``; the model is usable inside the ``with`` block only.

    Args:
        vlm: a model from :func:`load`.
        selector: a registered selector (``prune-audit selectors``), a composed one (``"visionzip+fastv"``:
            input-level part, then in-LLM part), or "none" for the unpruned model.
        budget: visual tokens to keep (in-LLM selectors: the layer average), a share of each image's tokens
            ("11%"), or "all"; None only with selector "none"; a composed selector one per part ("128,64").
        seed: seed of random selectors: row ``i`` of each call draws from its own generator seeded by
            ``(seed, i)``, so a call's answers do not depend on its batch size.
        options: the selector's options (``--option KEY=VALUE``), typed or as strings; each is checked against
            its declared domain (a composed selector's as ``**{"fastv.budget_rule": "paper"}``).
    """
    from prune_audit.models import VisionLanguageModel

    if not isinstance(vlm, VisionLanguageModel):
        raise PruneAuditError(f"pruned() takes a model from prune_audit.load(), got {type(vlm).__name__}")
    model = PrunedModel(vlm, *_selector_and_budget(selector, budget, options), seed=_whole_number("seed", seed))
    try:
        yield model
    finally:
        model._open = False


def _selector_and_budget(name: str, budget: Budget, options: dict[str, Any]) -> tuple[RunSelector | None, Budget]:
    """The selector built from ``options`` (strings parsed as ``--option``) and the checked budget; a composed
    selector (``"visionzip+fastv"``) takes one budget per part, as ``"128,64"`` or ``(128, 64)``."""
    from prune_audit.compute.budget import check_budget_for, check_budget_parts, parse_budget
    from prune_audit.pruners.composed import is_composed, parse_selector, part_count
    from prune_audit.pruners.registry import list_selectors

    if not isinstance(name, str):
        raise PruneAuditError(f"selector must be a registered name (str), got {name!r}")
    parts = budget if isinstance(budget, tuple) else (budget,)
    if any(isinstance(part, bool) or not (part is None or isinstance(part, (int, str))) for part in parts):
        raise PruneAuditError(
            f"budget must be a whole number of tokens, a share such as '11%', or 'all'; got {budget!r}"
        )
    budget = parse_budget(budget) if isinstance(budget, str) else budget
    if name == "none" and options:
        raise PruneAuditError("options need a selector; the unpruned model (selector 'none') has none")
    if name != "none" and not is_composed(name) and name not in list_selectors():
        raise PruneAuditError(f"unknown selector {name!r}; valid selectors: {', '.join(list_selectors())}")
    check_budget_for(name, budget)
    if name == "none":
        return None, None
    try:
        selector = parse_selector(name, [f"{key}={value}" for key, value in options.items()])
    except PruneAuditError:
        raise
    except ValueError as error:  # the registry's one-line messages, raised as ValueError
        raise PruneAuditError(str(error)) from None
    check_budget_parts(budget, part_count(selector), name)
    return selector, budget


def _whole_number(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PruneAuditError(f"{name} must be a whole number, got {value!r}")
    return value


class PrunedModel:
    """A loaded model under one selector and budget (from :func:`pruned`).

    Every method takes one image and one text (returning one result) or equal-length sequences of both (returning
    a list, answered in batches of ``batch_size``); one image with a list of texts asks each text of that image.
    """

    def __init__(self, vlm: VisionLanguageModel, selector: RunSelector | None, budget: Budget, *, seed: int) -> None:
        self.vlm, self.selector, self.budget, self.seed = vlm, selector, budget, seed
        self._open = True
        if selector is not None:
            vlm.check_selector(selector)

    def answer(
        self, images: ImageInput | Sequence[ImageInput], questions: str | Sequence[str], *, batch_size: int = 16
    ) -> YesNoResult | list[YesNoResult]:
        """Yes/no answers from the first token (POPE's answer mode)."""
        from prune_audit.answer_modes import YES_NO

        return self._ask(images, questions, YES_NO, batch_size)

    def choose(
        self,
        images: ImageInput | Sequence[ImageInput],
        questions: str | Sequence[str],
        *,
        letters: Sequence[str] = ("A", "B", "C", "D"),
        batch_size: int = 16,
    ) -> ChoiceResult | list[ChoiceResult]:
        """The most probable of ``letters`` as the first token (ScienceQA's answer mode); the questions list the
        options themselves."""
        from prune_audit.answer_modes import OptionLetters

        if isinstance(letters, str) or not letters or any(not isinstance(x, str) or not x.strip() for x in letters):
            raise PruneAuditError(
                f"letters must be a non-empty sequence of option letters such as ('A', 'B'), got {letters!r}"
            )
        if len(set(letters)) != len(letters):
            raise PruneAuditError(f"letters repeat an option letter: {letters!r}; list each once")
        mode = OptionLetters(tuple(letters))
        self.vlm.check_answer_mode(mode)
        return self._ask(images, questions, mode, batch_size)

    def generate(
        self,
        images: ImageInput | Sequence[ImageInput],
        prompts: str | Sequence[str],
        *,
        max_new_tokens: int = 16,
        batch_size: int = 16,
    ) -> GenerationResult | list[GenerationResult]:
        """Greedy decoding of at most ``max_new_tokens`` tokens, reusing the pruned KV cache."""
        from prune_audit.answer_modes import Greedy, check_max_new_tokens

        return self._ask(images, prompts, Greedy(check_max_new_tokens(max_new_tokens)), batch_size)

    def score(
        self,
        images: ImageInput | Sequence[ImageInput],
        questions: str | Sequence[str],
        answers: str | Sequence[str],
        *,
        batch_size: int = 16,
    ) -> ScoreResult | list[ScoreResult]:
        """Each answer's log-probability given its image and question, teacher-forced through the pruned KV cache
        (the answer's leading whitespace removed, tokenized alone); ``answers`` pairs with ``questions``."""
        from prune_audit.answer_modes import Continuation

        answer_list = [answers] if isinstance(answers, str) else list(answers) if isinstance(answers, Sequence) else []
        if not answer_list or any(not isinstance(answer, str) for answer in answer_list):
            raise PruneAuditError("pass the answers to score as a string or a list of strings, one per question")
        count = len(questions) if isinstance(questions, Sequence) and not isinstance(questions, str) else 1
        if len(answer_list) != count:
            raise PruneAuditError(f"{len(answer_list)} answers for {count} questions; pass one answer per question")
        return self._ask(images, questions, [Continuation(answer) for answer in answer_list], batch_size)

    # ----- internals ----------------------------------------------------------------
    def _ask(self, images: Any, texts: Any, mode: AnswerMode | list[AnswerMode], batch_size: int) -> Any:
        """``mode`` is one answer mode for every question, or one per question."""
        from prune_audit.models.context import check_context
        from prune_audit.runner.answering import answer_grouped

        if not self._open:
            raise PruneAuditError("this pruned model was used after its `with pruned(...)` block; call it inside")
        if _whole_number("batch_size", batch_size) < 1:
            raise PruneAuditError(f"batch_size must be at least 1, got {batch_size}")
        single = isinstance(texts, str)
        pairs = _pairs(images, texts)
        for _, text in pairs:
            self.vlm.check_question(text)
        modes = mode if isinstance(mode, list) else [mode] * len(pairs)
        results: list[PrunedResult] = []
        for start in range(0, len(pairs), batch_size):
            batch = pairs[start : start + batch_size]
            prepared = [self.vlm.prepare_for(_rgb(image), text, self.selector, self.budget) for image, text in batch]
            for item, row_mode in zip(prepared, modes[start:]):  # a generation limit is the caller's choice here
                check_context(self.vlm, [item], row_mode)
            rows = range(start, start + len(batch))
            answers = answer_grouped(
                self.vlm,
                self.selector,
                self.budget,
                prepared,
                modes[start : start + len(batch)],
                [self._generator(row) for row in rows],
            )
            results += [
                _result(answer, item, row_mode) for answer, item, row_mode in zip(answers, prepared, modes[start:])
            ]
        return results[0] if single else results

    def _generator(self, row: int) -> torch.Generator:
        import torch

        from prune_audit.runner.answering import question_seed

        return torch.Generator().manual_seed(question_seed(self.seed, "api", row))


def _pairs(images: Any, texts: Any) -> list[tuple[Any, str]]:
    """(image, text) per question: one and one, one image and many texts, or two sequences of one length."""
    text_list = [texts] if isinstance(texts, str) else list(texts) if isinstance(texts, Sequence) else None
    if not text_list or any(not isinstance(text, str) or not text.strip() for text in text_list):
        raise PruneAuditError("pass the questions as a non-empty string or a non-empty list of non-empty strings")
    image_list = list(images) if isinstance(images, (list, tuple)) else [images] * len(text_list)
    if len(image_list) != len(text_list):
        raise PruneAuditError(
            f"{len(image_list)} images for {len(text_list)} questions; pass one image per question "
            f"(or one image for all)"
        )
    return list(zip(image_list, text_list))


def _rgb(image: ImageInput) -> Any:
    """An RGB ``PIL.Image`` from a path or an image (16-bit and range-less modes handled as ``run`` does)."""
    from PIL import Image

    from prune_audit.data.images import open_rgb, to_rgb

    if isinstance(image, (str, Path)):
        return open_rgb(image)
    if isinstance(image, Image.Image):
        return to_rgb(image, "given as a PIL image")
    raise PruneAuditError(f"an image must be a PIL image or the path of an image file, got {type(image).__name__}")


def _result(answer: Answer, prepared: Prepared, mode: AnswerMode) -> PrunedResult:
    """The typed result of one answer in ``mode``."""
    from prune_audit.answer_modes import ContinuationScore, Generation, LetterChoice, YesNo

    common = {
        "text": answer.answer,
        "confidence": answer.confidence,
        "kept_stages": answer.kept_stages,
        "merged_stages": answer.merged_stages,
        "stage_layers": answer.stage_layers,
        "grid": prepared.grid,
        "visual_tokens_avg": answer.visual_tokens_avg,
        "cost": answer.cost,
        "latency_ms": answer.latency_ms,
        "latency_parts": dict(answer.latency_parts),
    }
    reduced = answer.reduced
    if isinstance(reduced, YesNo):
        return YesNoResult(**common, p_yes=reduced.p_yes, p_no=reduced.p_no, p_yes_2way=reduced.p_yes_2way)
    if isinstance(reduced, LetterChoice):
        return ChoiceResult(**common, letters=mode.letters, letter_probs=reduced.letter_probs)
    if isinstance(reduced, Generation):
        return GenerationResult(
            **common, sequence_probability=reduced.confidence, token_probs=reduced.token_probs, stopped=reduced.stopped
        )
    if isinstance(reduced, ContinuationScore):
        return ScoreResult(
            **common,
            log_probability=reduced.log_probability,
            token_probs=reduced.token_probs,
            is_greedy=reduced.is_greedy,
        )
    raise TypeError(f"no result type for {type(reduced).__name__}")


__all__ = [
    "ChoiceResult",
    "GenerationResult",
    "ImageInput",
    "PrunedModel",
    "PrunedResult",
    "ScoreResult",
    "YesNoResult",
    "load",
    "pruned",
]
