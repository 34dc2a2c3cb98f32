"""An lmms-eval model under any registered selector: ``lmms-eval --model prune_audit --model_args
pretrained=PATH,selector=fastv,budget=64,records=DIR --tasks ...`` (the optional extra ``prune-audit[lmms-eval]``).

Registered through the entry-point group ``lmms_eval.models`` (``manifest``). Answers go through
:func:`prune_audit.api.pruning.pruned`, the pruned prefill and KV cache of ``prune-audit run``:

- ``generate_until``: greedy decoding; lmms-eval's ``until`` strings cut the text afterwards.
- ``loglikelihood`` (and ``multiple_choice``, which lmms-eval sends as one loglikelihood request per choice):
  the continuation teacher-forced through the pruned KV cache (``PrunedModel.score``), answered as
  ``(value, is_greedy)``; ``is_greedy``: every token is the argmax (lmms-eval's definition). lmms-eval 0.7.3
  disagrees with itself on ``value``: ``lmms.loglikelihood``'s docstring says the log-probability, but its HF
  model classes (``llava_hf``, ``qwen2_vl``...) return the mean token loss (``outputs.loss``) and its
  ``multiple_choice`` scoring picks the choice of least value (``np.argmin``). ``loglikelihood=mean_loss``
  (default: multiple-choice accuracy comes out right) returns the mean negative log-probability per token;
  ``loglikelihood=log_probability`` the documented sum of log-probabilities (lmms-eval issue #370 discusses
  the mix-up). Records carry both. Each pair goes back wrapped in lmms-eval's ``GenerationResult``: 0.7.3's
  evaluator (``api.instance.unwrap_generation_output``) turns any other non-text answer into ``str(answer)``,
  and its loglikelihood scoring then fails on the text ("too many values to unpack").
- ``generate_until_multi_round``: each round the task's ``doc_to_text`` gives (one image, a prompt), answered as
  a ``generate_until`` request; the rounds' texts are returned together (a list per request).

With ``records=DIR`` every answered request (every round) becomes a line of ``DIR/<task>.jsonl``: the document,
the text, its probability, the kept sets per stage and the cost. Importing this module imports lmms-eval.
"""

from __future__ import annotations

import itertools
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from lmms_eval.api.instance import GenerationResult
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest

from prune_audit.api.pruning import load, pruned
from prune_audit.compute.budget import parse_listed_budget
from prune_audit.errors import PruneAuditError

RECORDS_OWNER = "lmms-eval"
"""The command name the records folder is owned under (``safety.ownership``)."""


LOGLIKELIHOOD_VALUES = ("mean_loss", "log_probability")
"""What a loglikelihood request returns: the mean negative log-probability per continuation token (lmms-eval's HF
classes, argmin in multiple_choice) or the sum of log-probabilities (lmms-eval's documented interface)."""


def manifest() -> ModelManifest:
    """The entry point's payload: the model id ``prune_audit`` and its class."""
    return ModelManifest(model_id="prune_audit", simple_class_path="prune_audit.api.lmms_eval.PruneAuditModel")


class PruneAuditModel(lmms):
    """lmms-eval's simple-model interface over a pruned prune-audit model.

    Args:
        pretrained: a model folder, hub id or bundled demo name (``prune_audit.load``).
        selector, budget: as ``prune-audit run --selector --budget`` (``none`` without budget: dense); a composed
            selector's budget joins its parts with ``/`` (``budget=96/48``: model_args are comma-separated).
        records: a folder for the per-request records (new, empty, or this plugin's own); None: none written.
        device, dtype, threads: as ``prune_audit.load``.
        batch_size: requests answered together (lmms-eval's --batch_size), questions per forward pass.
        loglikelihood: ``mean_loss`` or ``log_probability``, the value a loglikelihood request returns (see above).
        options: the selector's options (``--option KEY=VALUE``).
    """

    is_simple = True

    def __init__(
        self,
        pretrained: str = "demo",
        selector: str = "none",
        budget: Any = None,
        records: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        threads: Any = None,
        batch_size: Any = 1,
        loglikelihood: str = "mean_loss",
        **options: Any,
    ) -> None:
        super().__init__()
        from prune_audit.safety.ownership import check_output_dir

        self._records = (
            None if records in (None, "") else check_output_dir(Path(records), RECORDS_OWNER, option="records=")
        )
        self._batch_size = int(batch_size)
        if self._batch_size < 1:
            raise PruneAuditError(f"batch_size must be at least 1, got {batch_size}")
        if loglikelihood not in LOGLIKELIHOOD_VALUES:
            raise PruneAuditError(
                f"loglikelihood={loglikelihood!r} is not one of {', '.join(LOGLIKELIHOOD_VALUES)}; "
                f"mean_loss is what lmms-eval's multiple_choice scoring expects"
            )
        self._loglikelihood = loglikelihood
        vlm = load(
            str(pretrained),
            device=device or "auto",
            dtype=dtype,
            threads=None if threads in (None, "") else int(threads),
        )
        self._stack = ExitStack()
        self._model = self._stack.enter_context(pruned(vlm, str(selector), parse_listed_budget(budget), **options))
        self._lines: dict[str, list[dict[str, Any]]] = {}

    def _doc(self, task: str, split: str, doc_id: int) -> Any:
        return self.task_dict[task][split][doc_id]

    def _one_image(self, visuals: Any, task: str, doc_id: int) -> Any:
        """The single image of a document (prune-audit models take one image per question)."""
        visuals = visuals if isinstance(visuals, list) else [visuals]
        if len(visuals) != 1 or visuals[0] is None:
            raise PruneAuditError(f"{task} document {doc_id} has {len(visuals)} images; prune-audit models take one")
        return visuals[0]

    def _record(self, task: str, line: dict[str, Any], result: Any) -> None:
        """Keep the record line of one answered request: ``line`` (request and answer fields) and the provenance,
        its stages as ``run`` records them (the unpruned model: one stage at layer 0 keeping every token)."""
        from prune_audit.runner.build import recorded_stages

        kept_stages, stage_layers, merged_stages = recorded_stages(result, result.grid[0] * result.grid[1])
        self._lines.setdefault(task, []).append(
            {
                **line,
                "kept_stages": kept_stages,
                "merged_stages": merged_stages,
                "stage_layers": stage_layers,
                "grid": list(result.grid),
                "visual_tokens_avg": result.visual_tokens_avg,
                "flops": result.cost.flops,
                "flops_dense": result.cost.flops_dense,
            }
        )

    def generate_until(self, requests: list) -> list[str]:
        """Greedy answers of every request, cut at the request's ``until`` strings; ``batch_size`` requests at a
        time are answered together (those of one ``max_new_tokens``), so only their images are held."""
        texts = []
        for start in range(0, len(requests), self._batch_size):
            texts += self._answer_batch([request.args for request in requests[start : start + self._batch_size]])
        self._write_records()
        return texts

    def _answer_batch(self, arguments: list[tuple], round_index: int | None = None) -> list[str]:
        """``(context, gen_kwargs, doc_to_visual or the image list, doc_id, task, split)`` per request."""
        images = []
        for _, _, visual, doc_id, task, split in arguments:
            visuals = visual(self._doc(task, split, doc_id)) if callable(visual) else visual
            images.append(self._one_image(visuals, task, doc_id))
        by_limit: dict[int, list[int]] = {}
        for row, (_, gen_kwargs, *_) in enumerate(arguments):
            by_limit.setdefault(int(gen_kwargs.get("max_new_tokens", 16)), []).append(row)
        results: dict[int, Any] = {}
        for limit, rows in by_limit.items():
            answers = self._model.generate(
                [images[row] for row in rows],
                [arguments[row][0] for row in rows],
                max_new_tokens=limit,
                batch_size=self._batch_size,
            )
            results.update(zip(rows, answers))
        texts = []
        for row, (_, gen_kwargs, _, doc_id, task, split) in enumerate(arguments):
            result = results[row]
            texts.append(_cut(result.text, gen_kwargs.get("until")))
            rounds = {} if round_index is None else {"round": round_index}
            self._record(
                task,
                {
                    "doc_id": doc_id,
                    "task": task,
                    "split": split,
                    **rounds,
                    "request": "generate_until",
                    "text": texts[-1],
                    "sequence_probability": result.sequence_probability,
                    "stopped": result.stopped,
                },
                result,
            )
        return texts

    def loglikelihood(self, requests: list) -> list[GenerationResult]:
        """``(value, is_greedy)`` of each request's continuation given its image and context (``value`` as
        ``loglikelihood=`` says), teacher-forced through the pruned KV cache; ``batch_size`` requests at a time."""
        answers = []
        for start in range(0, len(requests), self._batch_size):
            batch = [request.args for request in requests[start : start + self._batch_size]]
            if any(len(arguments) != 6 for arguments in batch):
                raise PruneAuditError(
                    "a loglikelihood request without a document (lmms-eval's acc_mutual_info scores "
                    "choices without an image); drop acc_mutual_info from the task's metrics"
                )
            images, contexts, continuations = [], [], []
            for context, target, doc_to_visual, doc_id, task, split in batch:
                doc = self._doc(task, split, doc_id)
                images.append(self._one_image(doc_to_visual(doc), task, doc_id))
                contexts.append(context)
                continuations.append(target if isinstance(target, str) else str(target(doc)))
            results = self._model.score(images, contexts, continuations, batch_size=self._batch_size)
            for (_, _, _, doc_id, task, split), continuation, result in zip(batch, continuations, results):
                mean_loss = -result.log_probability / len(result.token_probs) if result.token_probs else 0.0
                self._record(
                    task,
                    {
                        "doc_id": doc_id,
                        "task": task,
                        "split": split,
                        "request": "loglikelihood",
                        "continuation": continuation,
                        "log_probability": result.log_probability,
                        "mean_loss": mean_loss,
                        "probability": result.confidence,
                        "is_greedy": result.is_greedy,
                    },
                    result,
                )
                value = mean_loss if self._loglikelihood == "mean_loss" else result.log_probability
                answers.append(GenerationResult(text=(value, result.is_greedy)))  # type: ignore[arg-type]
        self._write_records()
        return answers

    def generate_until_multi_round(self, requests: list) -> list[list[str]]:
        """Every round of every request, one request at a time: round 0 is the request's own context and image;
        round ``r > 0`` asks the task's ``doc_to_text(doc, previous_output, round_idx, previous_round_info)`` for
        ``(visuals, context, terminal, round texts, round info)`` and stops when ``terminal`` is true. Each request's
        answer is the list of its rounds' texts (a list: lmms-eval 0.7.3 passes lists of text through and turns a
        tuple into its ``str``)."""
        answers = []
        for request in requests:
            context, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split = request.args
            doc = self._doc(task, split, doc_id)
            visuals, texts, info = doc_to_visual(doc), [], None
            for round_index in itertools.count():
                if round_index:
                    visuals, context, terminal, previous, info = doc_to_text(
                        doc, previous_output=list(texts), round_idx=round_index, previous_round_info=info
                    )
                    texts = list(previous) if previous is not None else texts
                    if terminal:
                        break
                texts += self._answer_batch([(context, dict(gen_kwargs), visuals, doc_id, task, split)], round_index)
            answers.append(texts)
        self._write_records()
        return answers

    def _write_records(self) -> None:
        if self._records is None:
            return
        from prune_audit.safety.atomic import write_text_atomic
        from prune_audit.safety.ownership import hold_output_dir

        with hold_output_dir(
            self._records, RECORDS_OWNER, option="records=", writes=[f"{task}.jsonl" for task in self._lines]
        ):
            for task, lines in self._lines.items():
                write_text_atomic("".join(json.dumps(line) + "\n" for line in lines), self._records / f"{task}.jsonl")


def _cut(text: str, until: Any) -> str:
    """``text`` up to the first of lmms-eval's ``until`` strings."""
    for stop in [until] if isinstance(until, str) else list(until or []):
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text
