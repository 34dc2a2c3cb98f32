"""The kept-set interchange format (docs/interchange.md): what a pruner kept, per question and stage, and what
the model answered, in JSON Lines or Parquet, so pruners that ran elsewhere are audited like a ``run``.

JSON Lines: a header object on the first line, then one object per question. Parquet: one row per question
(``stages``, ``answer``, ``cost``, ``latency_ms`` as JSON text), the header as JSON in the file's key-value
metadata ``INTERCHANGE_METADATA``. Reading validates every entry and names the line (row) of a bad one; it
needs no model, so the checks that need the token grid (indices in range) come later
(``runner.imported``). Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from prune_audit.compute.cost import SIGNAL_SOURCES
from prune_audit.errors import PruneAuditError
from prune_audit.records.consistency import (
    cost_problem,
    disjoint_probabilities_problem,
    generation_problem,
    stage_cells_problem,
)
from prune_audit.records.manifest import MANIFEST_SCHEMA, SELECTOR_STAGES
from prune_audit.safety.inputs import check_input_file, loads_json, open_input
from prune_audit.tasks.registry import DEFAULT_TASK

FORMAT = "prune-audit-kept-sets"
FORMAT_VERSION = 2
"""Version 2 added the summary of a generated answer (``GENERATION_SUMMARY``) beside ``token_probs``; version 1
files (first-token tasks, or generations with ``token_probs``) read unchanged."""
READABLE_VERSIONS = (1, 2)
INTERCHANGE_METADATA = b"prune_audit.interchange"
SUFFIXES = (".jsonl", ".parquet")
COST_FIELDS = (
    "flops",
    "flops_vision",
    "flops_selector",
    "flops_llm",
    "flops_dense",
    "flops_decode_token",
    "kv_bytes",
    "flop_equivalent_tokens",
)
"""The analytic cost columns a question line's ``cost`` holds (``records.schema.COST_COLUMNS``)."""
SIGNAL_SOURCES_FIELD = "signal_sources"
"""The cost column a ``cost`` may also hold: the ``compute.cost.SIGNAL_SOURCES`` the selector read (absent or null:
not known)."""
LATENCY_PARTS = ("vision", "selection", "prefill", "decode")
"""The latency parts a question line may carry, in ms (``latency_<part>_ms`` columns)."""
GENERATION_SUMMARY = {
    "sequence_probability": "sequence_prob",
    "mean_token_probability": "mean_token_prob",
    "answer_tokens": "answer_tokens",
    "stopped": "stopped",
}
"""A generated answer's summary fields and the record columns they carry (``records.schema``, generating tasks)."""
TASK_OPTIONS = ("max_new_tokens", "confidence")
"""A generating task's options a header may carry (``run --max-new-tokens --confidence``, version 2)."""
_KEPT_SET_FIX = "pass a file written by `prune-audit export` or in the format of docs/interchange.md"
_PARQUET_JSON = ("stages", "answer", "cost", "latency_ms")


@dataclass(frozen=True)
class KeptStage:
    """One stage: the decoder ``layer`` whose input the ``kept`` grid indices are, the grid indices each
    merged token alive after it carries (``merged``), and the visual tokens it feeds (``tokens``: more than
    kept + merged when some have no grid cell, such as a CLS token VisionZip keeps)."""

    layer: int
    kept: list[int]
    merged: list[list[int]] = field(default_factory=list)
    tokens: int | None = None

    @property
    def fed(self) -> int:
        """Visual tokens the stage feeds the decoder."""
        return self.tokens if self.tokens is not None else len(self.kept) + len(self.merged)


@dataclass(frozen=True)
class KeptQuestion:
    """One question line: its key, image, stages (empty: unpruned) and answer.

    ``answer`` holds ``text`` and ``probability`` (the task's confidence) and may hold the answer mode's
    reduction (``p_yes``/``p_no``; ``letter_probs``; ``stopped`` with ``token_probs`` or ``GENERATION_SUMMARY``);
    ``cost`` and ``latency_ms`` are optional measurements to carry over (``COST_FIELDS``, ``LATENCY_PARTS``).
    ``line`` is where it was read.
    """

    question_id: int
    split: str
    image: str
    stages: list[KeptStage]
    answer: dict[str, Any]
    cost: dict[str, Any] | None
    latency_ms: dict[str, float] | None
    line: str


@dataclass(frozen=True)
class KeptSets:
    """A whole file: the header (``task``, ``selector``, ``budget``, ``producer``) and the question lines."""

    header: dict[str, Any]
    questions: list[KeptQuestion]
    path: Path

    @property
    def task(self) -> str:
        return self.header["task"]


# ----- writing ------------------------------------------------------------------------


def header_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """The header a run's manifest exports: format, version, task (and a generating task's options), selector (as
    run) and budget."""
    task_options = {name: manifest[name] for name in TASK_OPTIONS if manifest.get(name) is not None}
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "task": manifest.get("task", DEFAULT_TASK),
        **task_options,
        "selector": manifest["selector"],
        "budget": manifest["budget"],
        "model": manifest["model"]["id"],
        "producer": f"prune-audit {manifest['version']}",
    }


def question_line(record: dict[str, Any]) -> dict[str, Any]:
    """One record of a run as a question line (the reduction of its answer mode from the task's columns)."""
    stages = [
        {"layer": layer, "kept": kept, **({"merged": merged} if merged else {})}
        for layer, kept, merged in zip(record["stage_layers"], record["kept_stages"], record["merged_stages"])
    ]
    if record["stage_layers"] == [0] and record["visual_tokens_avg"] != len(record["kept"]) + len(
        record["merged_stages"][0]
    ):
        stages[0]["tokens"] = int(record["visual_tokens_avg"])  # input-level: every layer sees the same count
    answer = {"text": record["answer_text"], "probability": record["confidence"]}
    for name in ("p_yes", "p_no", "letter_probs"):
        if record.get(name) is not None:
            answer[name] = record[name]
    if record.get("sequence_prob") is not None:  # a generating task: its records keep the summary, not each token
        answer.update({field_name: record[column] for field_name, column in GENERATION_SUMMARY.items()})
    return {
        "question_id": record["question_id"],
        "split": record["split"],
        "image": record["image"],
        "stages": stages,
        "answer": answer,
        "cost": {name: record[name] for name in (*COST_FIELDS, SIGNAL_SOURCES_FIELD)},
        "latency_ms": {
            part: record[f"latency_{part}_ms"] for part in LATENCY_PARTS if record.get(f"latency_{part}_ms") is not None
        },
    }


def write_kept_sets(header: dict[str, Any], lines: list[dict[str, Any]], path: Path) -> None:
    """Write ``header`` and ``lines`` to ``path`` (.jsonl or .parquet, by its suffix) atomically."""
    from prune_audit.safety.atomic import write_text_atomic

    if path.suffix == ".jsonl":
        text = "".join(json.dumps(entry, allow_nan=True) + "\n" for entry in [header, *lines])
        write_text_atomic(text, path)
        return
    from prune_audit.records.store import write_table_atomic

    columns = {name: [line[name] for line in lines] for name in ("question_id", "split", "image")}
    columns.update({name: [json.dumps(line[name]) for line in lines] for name in _PARQUET_JSON})
    table = pa.table(columns).replace_schema_metadata({INTERCHANGE_METADATA: json.dumps(header).encode()})
    write_table_atomic(table, path)


def is_kept_set_file(path: Path) -> bool:
    """Whether ``path`` holds a kept-set file's header (its first line, or its Parquet metadata)."""
    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as handle:
                return json.loads(handle.readline()).get("format") == FORMAT
        import pyarrow.parquet as pq

        return INTERCHANGE_METADATA in (pq.read_schema(path).metadata or {})
    except (OSError, ValueError, AttributeError, pa.ArrowInvalid):
        return False


def check_suffix(path: Path, option: str) -> None:
    if path.suffix not in SUFFIXES:
        raise PruneAuditError(f"{option} {path} must end in .jsonl or .parquet (the interchange format's two forms)")


# ----- reading ------------------------------------------------------------------------


def read_kept_sets(path: Path) -> KeptSets:
    """The file at ``path``, every entry checked; a one-line PruneAuditError naming the line (row) otherwise."""
    path = Path(path)
    check_suffix(path, "FILE")
    check_input_file(path, "kept-set file", _KEPT_SET_FIX)
    header, entries = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    _check_header(header, path)
    questions = [_question(entry, where) for where, entry in entries]
    if not questions:
        raise PruneAuditError(f"{path} holds a header but no question lines")
    seen: dict[tuple[str, int], str] = {}
    for question in questions:
        key = (question.split, question.question_id)
        if key in seen:
            raise PruneAuditError(
                f"{question.line}: question {key[0]}/{key[1]} repeats {seen[key]}; give each question once"
            )
        seen[key] = question.line
    return KeptSets(header, questions, path)


def _read_jsonl(path: Path) -> tuple[Any, list[tuple[str, Any]]]:
    entries = []
    header = None
    with open_input(path, "kept-set file", _KEPT_SET_FIX) as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise PruneAuditError(
                    f"{path} line {number}: not UTF-8 text (byte 0x{raw[error.start]:02x}); {_KEPT_SET_FIX}"
                ) from None
            if not text.strip():
                continue
            try:
                value = loads_json(text, f"{path} line {number}")
            except json.JSONDecodeError as error:
                raise PruneAuditError(
                    f"{path} line {number}: not JSON ({error.msg}); one JSON object per line"
                ) from None
            if header is None:
                header = value
            else:
                entries.append((f"{path} line {number}", value))
    return header, entries


def _read_parquet(path: Path) -> tuple[Any, list[tuple[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise PruneAuditError(f"{path} is not a readable Parquet file ({error}); write it again") from None
    metadata = table.schema.metadata or {}
    if INTERCHANGE_METADATA not in metadata:
        raise PruneAuditError(
            f"{path} has no interchange header (Parquet metadata {INTERCHANGE_METADATA.decode()}); "
            f"see docs/interchange.md"
        )
    try:
        header = loads_json(
            metadata[INTERCHANGE_METADATA], f"{path} (Parquet metadata {INTERCHANGE_METADATA.decode()})"
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PruneAuditError(
            f"{path}: the interchange header (Parquet metadata {INTERCHANGE_METADATA.decode()}) is "
            f"not JSON ({getattr(error, 'msg', error)}); {_KEPT_SET_FIX}"
        ) from None
    entries = []
    for row, entry in enumerate(table.to_pylist()):
        where = f"{path} row {row}"
        for name in _PARQUET_JSON:
            if isinstance(entry.get(name), str):
                try:
                    entry[name] = loads_json(entry[name], f"{where}: column {name}")
                except json.JSONDecodeError:
                    raise PruneAuditError(f"{where}: column {name} is not JSON text") from None
        entries.append((where, entry))
    return header, entries


def _check_header(header: Any, path: Path) -> None:
    where = f"{path} line 1 (header)"
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise PruneAuditError(f'{where}: not a kept-set file (the header must hold "format": "{FORMAT}")')
    if header.get("version") not in READABLE_VERSIONS:
        raise PruneAuditError(
            f"{where}: format version {header.get('version')!r}; this prune-audit reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if not isinstance(header.get("task"), str):
        raise PruneAuditError(f'{where}: "task" must name a task (pope, ...)')
    tokens = header.get("max_new_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise PruneAuditError(f'{where}: "max_new_tokens" must be null or a whole number >= 1, got {tokens!r}')
    if not isinstance(header.get("confidence") or "", str):
        raise PruneAuditError(
            f'{where}: "confidence" must be null or a generating task\'s confidence name (docs/tasks.md)'
        )
    selector = header.get("selector", {"name": "imported"})
    if isinstance(selector, str):
        selector = {"name": selector}
    if not isinstance(selector, dict) or not isinstance(selector.get("name"), str):
        raise PruneAuditError(f'{where}: "selector" must be a name or an object with a name')
    if selector.get("stage") not in SELECTOR_STAGES:
        raise PruneAuditError(
            f'{where}: selector "stage" must be input, llm, composed or null, got {selector["stage"]!r}'
        )
    header["selector"] = selector
    _, budget_check = MANIFEST_SCHEMA["budget"]  # the header's budget becomes the manifest's: one definition
    if budget_check(header.get("budget")) is not None:
        raise PruneAuditError(
            f'{where}: "budget" must be {budget_check(header.get("budget"))}, got {header.get("budget")!r}'
        )


def _question(entry: Any, where: str) -> KeptQuestion:
    if not isinstance(entry, dict):
        raise PruneAuditError(f"{where}: a question line must be a JSON object")
    for name in ("question_id", "split", "image", "stages", "answer"):
        if name not in entry:
            raise PruneAuditError(f'{where}: "{name}" is missing')
    question_id = entry["question_id"]
    if isinstance(question_id, bool) or not isinstance(question_id, int):
        raise PruneAuditError(f'{where}: "question_id" must be an integer, got {question_id!r}')
    for name in ("split", "image"):
        if not isinstance(entry[name], str) or not entry[name]:
            raise PruneAuditError(f'{where}: "{name}" must be a non-empty string')
    stages = _stages(entry["stages"], where)
    answer = _answer(entry["answer"], where)
    cost = _cost(entry.get("cost"), where)
    latency = entry.get("latency_ms")
    if latency is not None and not _numbers(latency, set(LATENCY_PARTS), exact=False):
        raise PruneAuditError(
            f'{where}: "latency_ms" must be null or map parts of {", ".join(LATENCY_PARTS)} '
            f"to non-negative milliseconds"
        )
    return KeptQuestion(question_id, entry["split"], entry["image"], stages, answer, cost, latency, where)


def _cost(cost: Any, where: str) -> dict[str, Any] | None:
    """The line's ``cost``: null, or every ``COST_FIELDS`` number (and the optional ``signal_sources``) obeying
    ``records.consistency.cost_problem`` as a run's record does."""
    if cost is None:
        return None
    numbers = (
        {name: value for name, value in cost.items() if name != SIGNAL_SOURCES_FIELD}
        if isinstance(cost, dict)
        else None
    )
    if numbers is None or not _numbers(numbers, set(COST_FIELDS), exact=True):
        raise PruneAuditError(f'{where}: "cost" must be null or hold the finite numbers {", ".join(COST_FIELDS)}')
    problem = cost_problem(numbers)
    if problem is not None:
        raise PruneAuditError(
            f'{where}: "cost": {problem}; give the cost as run records it, or drop "cost" to '
            f"have it computed from the kept sets"
        )
    sources = cost.get(SIGNAL_SOURCES_FIELD)
    if sources is not None and (
        not isinstance(sources, list)
        or not all(isinstance(source, str) and source in SIGNAL_SOURCES for source in sources)
    ):
        raise PruneAuditError(
            f'{where}: cost "{SIGNAL_SOURCES_FIELD}" must be null or a list of {", ".join(SIGNAL_SOURCES)}'
        )
    return cost


def _numbers(value: Any, names: set[str], exact: bool) -> bool:
    """``value`` maps ``names`` (all of them when ``exact``, else some) to finite non-negative numbers."""
    if not isinstance(value, dict) or not (set(value) == names if exact else set(value) <= names):
        return False
    return all(_finite(number) and number >= 0 for number in value.values())


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _indices(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def _stages(value: Any, where: str) -> list[KeptStage]:
    if not isinstance(value, list):
        raise PruneAuditError(f'{where}: "stages" must be a list of {{layer, kept, merged}} objects')
    stages: list[KeptStage] = []
    for number, stage in enumerate(value):
        at = f"{where}: stage {number}"
        if not isinstance(stage, dict) or "layer" not in stage or "kept" not in stage:
            raise PruneAuditError(f'{at} must be an object with "layer" and "kept"')
        layer, kept, merged = stage["layer"], stage["kept"], stage.get("merged", [])
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise PruneAuditError(
                f'{at}: "layer" must be a decoder layer index >= 0 (negative: a cut in the vision tower), got {layer!r}'
            )
        if not _indices(kept):
            raise PruneAuditError(f'{at}: "kept" must be a list of grid indices >= 0')
        if len(set(kept)) != len(kept):
            raise PruneAuditError(f'{at}: "kept" repeats a grid index; list each once')
        if not isinstance(merged, list) or not all(_indices(sources) and sources for sources in merged):
            raise PruneAuditError(f'{at}: "merged" must be a list of non-empty lists of grid indices')
        problem = stage_cells_problem(kept, merged)
        if problem is not None:
            raise PruneAuditError(f"{at}: {problem}")
        tokens = stage.get("tokens")
        if tokens is not None and (
            isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < len(kept) + len(merged)
        ):
            raise PruneAuditError(
                f'{at}: "tokens" must be null or an integer >= kept + merged ({len(kept) + len(merged)})'
            )
        if stages:
            previous = stages[-1]
            if layer <= previous.layer:
                raise PruneAuditError(
                    f"{at}: layer {layer} does not follow the previous stage's layer "
                    f"{previous.layer}; list stages by increasing layer"
                )
            covered = set(previous.kept).union(*previous.merged)
            outside = sorted(set(kept) - covered)
            if outside:
                raise PruneAuditError(
                    f"{at}: kept index {outside[0]} was not alive after the previous stage; stages must be nested"
                )
        stages.append(KeptStage(layer, list(kept), [list(sources) for sources in merged], tokens))
    return stages


def _answer(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("text"), str):
        raise PruneAuditError(f'{where}: "answer" must be an object with the answer "text"')
    probability = value.get("probability")
    if probability is not None and (not _finite(probability) or not 0 <= probability <= 1):
        raise PruneAuditError(f'{where}: answer "probability" must be null or a number in [0, 1], got {probability!r}')
    for name in ("p_yes", "p_no"):
        if name in value and (not _finite(value[name]) or not 0 <= value[name] <= 1):
            raise PruneAuditError(f'{where}: answer "{name}" must be a number in [0, 1]')
    for name in ("letter_probs", "token_probs"):
        if name in value and (
            not isinstance(value[name], list) or not all(_finite(p) and 0 <= p <= 1 for p in value[name])
        ):
            raise PruneAuditError(f'{where}: answer "{name}" must be a list of numbers in [0, 1]')
    for name in ("sequence_probability", "mean_token_probability"):
        if name in value and (not _finite(value[name]) or not 0 <= value[name] <= 1):
            raise PruneAuditError(f'{where}: answer "{name}" must be a number in [0, 1]')
    tokens = value.get("answer_tokens", 0)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise PruneAuditError(f'{where}: answer "answer_tokens" must be a whole number >= 0, got {tokens!r}')
    if "stopped" in value and not isinstance(value["stopped"], bool):
        raise PruneAuditError(f'{where}: answer "stopped" must be true or false')
    problem = _probabilities_problem(value)
    if problem is not None:
        raise PruneAuditError(f"{where}: answer {problem}; give the probabilities the model gave")
    return value


def _probabilities_problem(answer: dict[str, Any]) -> str | None:
    """The answer's probabilities agree with each other as a run's records do (``records.consistency``)."""
    if "p_yes" in answer and "p_no" in answer:
        return disjoint_probabilities_problem("p_yes and p_no", [answer["p_yes"], answer["p_no"]])
    if "letter_probs" in answer:
        return disjoint_probabilities_problem("letter_probs", answer["letter_probs"])
    if "token_probs" in answer:  # the summary follows from the tokens: only an empty list can contradict the text
        return None if answer["token_probs"] else generation_problem(answer["text"], 1.0, 1.0, 0)
    summary: list[Any] = [answer.get(name) for name in GENERATION_SUMMARY if name != "stopped"]
    return None if None in summary else generation_problem(answer["text"], *summary)


__all__ = [
    "COST_FIELDS",
    "FORMAT",
    "FORMAT_VERSION",
    "GENERATION_SUMMARY",
    "LATENCY_PARTS",
    "TASK_OPTIONS",
    "KeptQuestion",
    "KeptSets",
    "KeptStage",
    "header_of",
    "is_kept_set_file",
    "question_line",
    "read_kept_sets",
    "write_kept_sets",
]
