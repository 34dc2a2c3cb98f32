"""An lmms-eval model under any registered selector: ``lmms-eval --model prune_audit --model_args
pretrained=PATH,selector=fastv,budget=64,records=DIR --tasks ...`` (the optional extra ``prune-audit[lmms-eval]``).

Registered through the entry-point group ``lmms_eval.models`` (``manifest``). Answers go through
:func:`prune_audit.api.pruning.pruned`, the pruned prefill and KV cache of ``prune-audit run``. So far it serves
``generate_until`` requests (greedy decoding; lmms-eval's ``until`` strings cut the text afterwards);
``loglikelihood`` requests are refused in one line. With ``records=DIR`` every answered request becomes a line
of ``DIR/<task>.jsonl``: the document, the text, its sequence probability, the kept sets per stage and the cost.
Importing this module imports lmms-eval.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest

from prune_audit.api.pruning import load, pruned
from prune_audit.errors import PruneAuditError

RECORDS_OWNER = "lmms-eval"
"""The command name the records folder is owned under (``safety.ownership``)."""


def manifest() -> ModelManifest:
    """The entry point's payload: the model id ``prune_audit`` and its class."""
    return ModelManifest(model_id="prune_audit", simple_class_path="prune_audit.api.lmms_eval.PruneAuditModel")


class PruneAuditModel(lmms):
    """lmms-eval's simple-model interface over a pruned prune-audit model.

    Args:
        pretrained: a model folder, hub id or bundled demo name (``prune_audit.load``).
        selector, budget: as ``prune-audit run --selector --budget`` (``none`` without budget: dense).
        records: a folder for the per-request records (new, empty, or this plugin's own); None: none written.
        device, dtype, threads: as ``prune_audit.load``.
        batch_size: requests answered together (lmms-eval's --batch_size), questions per forward pass.
        options: the selector's options (``--option KEY=VALUE``).
    """

    is_simple = True

    def __init__(self, pretrained: str = "demo", selector: str = "none", budget: Any = None, records: str | None = None,
                 device: str | None = None, dtype: str = "auto", threads: Any = None, batch_size: Any = 1,
                 **options: Any) -> None:
        super().__init__()
        from prune_audit.safety.ownership import check_output_dir

        self._records = None if records in (None, "") else check_output_dir(Path(records), RECORDS_OWNER,
                                                                            option="records=")
        self._batch_size = int(batch_size)
        if self._batch_size < 1:
            raise PruneAuditError(f"batch_size must be at least 1, got {batch_size}")
        vlm = load(str(pretrained), device=device or "auto", dtype=dtype,
                   threads=None if threads in (None, "") else int(threads))
        self._stack = ExitStack()
        self._model = self._stack.enter_context(pruned(vlm, str(selector), _budget(budget), **options))
        self._lines: dict[str, list[dict[str, Any]]] = {}

    def generate_until(self, requests: list) -> list[str]:
        """Greedy answers of every request, cut at the request's ``until`` strings; ``batch_size`` requests at a
        time are answered together (those of one ``max_new_tokens``), so only their images are held."""
        texts = []
        for start in range(0, len(requests), self._batch_size):
            texts += self._answer_batch([request.args for request in requests[start : start + self._batch_size]])
        self._write_records()
        return texts

    def _answer_batch(self, arguments: list[tuple]) -> list[str]:
        images = []
        for _, _, doc_to_visual, doc_id, task, split in arguments:
            visuals = doc_to_visual(self.task_dict[task][split][doc_id])
            visuals = visuals if isinstance(visuals, list) else [visuals]
            if len(visuals) != 1:
                raise PruneAuditError(f"{task} document {doc_id} has {len(visuals)} images; prune-audit models take one")
            images.append(visuals[0])
        by_limit: dict[int, list[int]] = {}
        for row, (_, gen_kwargs, *_) in enumerate(arguments):
            by_limit.setdefault(int(gen_kwargs.get("max_new_tokens", 16)), []).append(row)
        results: dict[int, Any] = {}
        for limit, rows in by_limit.items():
            answers = self._model.generate([images[row] for row in rows], [arguments[row][0] for row in rows],
                                           max_new_tokens=limit, batch_size=self._batch_size)
            results.update(zip(rows, answers))
        texts = []
        for row, (_, gen_kwargs, _, doc_id, task, split) in enumerate(arguments):
            result = results[row]
            texts.append(_cut(result.text, gen_kwargs.get("until")))
            self._lines.setdefault(task, []).append({
                "doc_id": doc_id, "task": task, "split": split, "text": texts[-1],
                "sequence_probability": result.sequence_probability, "stopped": result.stopped,
                "kept_stages": result.kept_stages, "merged_stages": result.merged_stages,
                "stage_layers": result.stage_layers, "grid": list(result.grid),
                "visual_tokens_avg": result.visual_tokens_avg, "flops": result.cost.flops,
                "flops_dense": result.cost.flops_dense,
            })
        return texts

    def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:
        raise PruneAuditError("the prune_audit lmms-eval model answers generate_until tasks only so far; "
                              "loglikelihood tasks need continuation scoring under pruning")

    def generate_until_multi_round(self, requests: list) -> list[str]:
        raise PruneAuditError("the prune_audit lmms-eval model answers single-round generate_until tasks only")

    def _write_records(self) -> None:
        if self._records is None:
            return
        from prune_audit.safety.atomic import write_text_atomic
        from prune_audit.safety.ownership import hold_output_dir

        with hold_output_dir(self._records, RECORDS_OWNER, option="records=",
                             writes=[f"{task}.jsonl" for task in self._lines]):
            for task, lines in self._lines.items():
                write_text_atomic("".join(json.dumps(line) + "\n" for line in lines), self._records / f"{task}.jsonl")


def _budget(value: Any) -> Any:
    """lmms-eval's model_args value of ``budget``: tokens (int or digits), a share, ``all`` or none."""
    if value in (None, "", "none", "None"):
        return None
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _cut(text: str, until: Any) -> str:
    """``text`` up to the first of lmms-eval's ``until`` strings."""
    for stop in [until] if isinstance(until, str) else list(until or []):
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text
