"""The run manifest: everything needed to reproduce a run and to refuse an inconsistent resume."""

from __future__ import annotations

import hashlib
import json
import math
import platform
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from prune_audit import __version__
from prune_audit.errors import PruneAuditError
from prune_audit.records.schema import SCHEMA_VERSION
from prune_audit.safety.atomic import write_text_atomic
from prune_audit.safety.inputs import loads_json

MANIFEST_FILE = "manifest.json"

# fields that define the run: a resume must match them exactly
CONFIG_FIELDS = (
    "task",
    "max_new_tokens",
    "confidence",
    "model",
    "processor",
    "prompt",
    "dtype",
    "selector",
    "budget",
    "question_files",
    "annotations",
    "limit",
    "seed",
    "split",
)


MANIFEST_KEYS: tuple[tuple[str, str], ...] = (
    ("version", "prune-audit version that wrote the run"),
    (
        "run_id",
        "sha256 of the configuration and the inputs' content (run_id_of); every records file of the run "
        "carries it in its Parquet metadata (prune_audit.run_id), so records of another run are never read or resumed",
    ),
    (
        "records_schema",
        "version of the record columns (records/schema.py SCHEMA_VERSION); every reader and resume "
        "refuse another version",
    ),
    ("task", "the run's task (`run --task`, docs/tasks.md); every other command reads it from here (absent: pope)"),
    ("max_new_tokens", "generation limit of a task answered by greedy decoding (null for first-token tasks)"),
    ("confidence", "a generating task's confidence definition, sequence or mean-token (null for first-token tasks)"),
    ("git_revision", "git commit of the prune-audit source (null outside a checkout)"),
    ("versions", "{python, torch, transformers} versions"),
    ("model", "{id, config_hash}: model folder or hub id, and a hash of its config"),
    ("family", "model family adapter: a registered model_type (docs/models.md)"),
    (
        "prompt",
        "{template, system, first}: prompt template name, system prompt, and the full prompt of the first "
        "question (the task's instruction composed once, in the template's conversation, one image placeholder; "
        "absent in runs of earlier versions)",
    ),
    ("dtype", "weights' dtype (float32, bfloat16, float16)"),
    ("device", "torch device the model ran on"),
    ("attn_implementation", "attention kernel (sdpa)"),
    ("num_layers", "decoder layers of the language model"),
    ("answer_tokens", "{yes, no}: token ids summed into p_yes and p_no"),
    (
        "processor",
        "image processor: class, geometry mode, sizes, patch size; first_image: the first question's TokenGeometry",
    ),
    ("clip_text", "LLaVA, LLaVA-NeXT: CLIP text tower used for CDPruner relevance (null when none)"),
    ("positions", "Qwen2.5-VL: position ids the pruned sequence keeps"),
    (
        "selector",
        "{name, stage, options, positions, schedule, schedule_num_visual}: the selector as run; a composed selector "
        "(stage composed, e.g. input+llm) adds parts: each part's own object with its budget, and its schedule is its "
        "in-LLM part's on the tokens the input part feeds "
        "(schedule: [layer, keep] stages of in-LLM selectors for the first question's token count; keep excludes "
        "the tokens a merge inserts, such as SparseVLM's recycled ones, which realised_visual_tokens_avg counts; "
        "null, with schedule_num_visual, for one whose schedule follows what its own tower stage feeds each image, "
        "FlowCut's, MustDrop's with its vision stage: the records hold its stages); per_frame: true where an image "
        "selector (or a composed selector's input part) ran on each temporal step of a clip alone at an even share "
        "of the budget (a project convention: no official per-frame code; absent otherwise)",
    ),
    (
        "budget",
        "--budget in visual tokens, or a share as given (11%: each image keeps its share, rounded half up; "
        "visual_tokens_avg holds the realised count); a list, one per part, for a composed selector; null for the "
        "unpruned run",
    ),
    ("question_files", "[{path, sha256}] of the task's question files (POPE: --pope)"),
    ("annotations", "{path, sha256} of the evidence annotations (POPE: the COCO instances file; null without)"),
    (
        "images",
        "{path, sha256, count, files}: folder of the question images and the sha256 of each image the "
        "questions use (files: name -> sha256; sha256 over all of them)",
    ),
    ("split", "--split (all by default)"),
    ("limit", "--limit (null: every question)"),
    ("num_questions", "questions in the run (all shards)"),
    ("seed", "--seed of random selectors"),
    ("command", "the command line as parsed (options that differ from their defaults)"),
    (
        "threads",
        "{intra_op, inter_op, source, usable_cores}: torch threads and where the number came "
        "from (--threads, OMP_NUM_THREADS or sched_getaffinity); not part of the configuration",
    ),
    ("realised_visual_tokens_avg", "mean visual_tokens_avg over the records, written when the run completes"),
)
"""Every top-level key of manifest.json with its meaning (docs/records.md is generated from it)."""


def git_revision() -> str | None:
    """The prune-audit source revision, when running from a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def library_versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def base_manifest() -> dict[str, Any]:
    return {
        "version": __version__,
        "records_schema": SCHEMA_VERSION,
        "git_revision": git_revision(),
        "versions": library_versions(),
    }


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The run's manifest, validated against ``MANIFEST_SCHEMA`` and its ``run_id``.

    Refused (one line naming the file, the field and the fix) unless it is a JSON object of this
    version's records schema (``SCHEMA_VERSION``) whose every declared field has its type and domain.
    """
    path = Path(run_dir) / MANIFEST_FILE
    if not path.exists():
        raise PruneAuditError(
            f"{run_dir} is not a run directory (no {MANIFEST_FILE}); pass a directory written by prune-audit run"
        )
    if not path.is_file():
        raise PruneAuditError(f"{path} is not a file; remove it, or pass a directory written by prune-audit run")
    try:
        manifest = loads_json(path.read_text(encoding="utf-8"), str(path))
    except json.JSONDecodeError as error:
        raise PruneAuditError(f"{path} is not valid JSON ({error.msg}); re-run to rewrite it") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PruneAuditError(f"cannot read {path} ({error}); check the file, or re-run into a new --out") from None
    if not isinstance(manifest, dict):
        raise PruneAuditError(
            f"{path} holds a JSON {_json_type(manifest)}, not a run manifest (an object); it was not written by "
            f"prune-audit: remove the folder, or re-run into a new --out"
        )
    check_schema_version(manifest, run_dir)
    check_manifest(manifest, path)
    return manifest


def check_schema_version(manifest: dict[str, Any], run_dir: Path) -> None:
    """Refuse a run whose records schema is not this version's, rather than misread it."""
    version = manifest.get("records_schema")
    if version == SCHEMA_VERSION and not isinstance(version, bool):
        return
    written = "an older" if not _is_int(version) or version < SCHEMA_VERSION else "a newer"
    raise PruneAuditError(
        f"{run_dir} was written by {written} prune-audit (records schema {version or 1}, this version reads "
        f"{SCHEMA_VERSION}); re-run with this version (into a new --out directory)"
    )


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (a reader sees the old or the new manifest, never a part)."""
    write_text_atomic(
        json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n", Path(run_dir) / MANIFEST_FILE
    )


def images_folder(manifest: dict[str, Any]) -> Path:
    """The folder the run read its images from (one line when a manifest read without validation names none)."""
    images = manifest.get("images")
    folder = images.get("path") if isinstance(images, dict) else images
    if not isinstance(folder, str) or not folder:
        raise PruneAuditError(
            f"the run's manifest names no images folder (images: {json.dumps(images, default=str)[:60]}); "
            f"re-run into a new --out to record it"
        )
    return Path(folder)


INFORMATION_KEYS = frozenset({"path"})
"""Where an input was read from: recorded for people, never compared (runs are portable)."""


def differing_fields(old: dict[str, Any], new: dict[str, Any], fields: tuple[str, ...] = CONFIG_FIELDS) -> list[str]:
    """Names of configuration fields whose contents differ (nested dicts compared by dotted key).

    Paths are information only; the model's id (often a folder) counts only when either
    side lacks the sha256 of its weights.
    """
    differences: list[str] = []
    for name in fields:
        _collect_differences(name, _content(old.get(name)), _content(new.get(name)), differences)
    weights = [(manifest.get("model") or {}).get("weights_sha256") for manifest in (old, new)]
    if None not in weights:
        differences = [name for name in differences if name != "model.id"]
    return differences


def _content(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _content(item) for key, item in value.items() if key not in INFORMATION_KEYS}
    if isinstance(value, list):
        return [_content(item) for item in value]
    return value


def _collect_differences(prefix: str, old: Any, new: Any, out: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            _collect_differences(f"{prefix}.{key}", old.get(key), new.get(key), out)
    elif _normalise(old) != _normalise(new):
        out.append(prefix)


def _normalise(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# ----- the declared schema -----------------------------------------------------------------

Check = Callable[[Any], str | None]
"""A field's check: None when the value is valid, else what the value should be."""

SHA256 = re.compile(r"[0-9a-f]{64}")
SHARE = re.compile(r"\d+(\.\d+)?%")
SELECTOR_STAGES = (None, "input", "llm", "composed")  # composed: pruners.composed.COMPOSED_STAGE
UNPRUNED = "none"
"""``selector.name`` of the unpruned (dense) run, the only run without a budget."""


def _json_type(value: Any) -> str:
    names = {
        dict: "object",
        list: "list",
        str: "string",
        bool: "boolean",
        type(None): "null",
        float: "number",
        int: "integer",
    }
    return names.get(type(value), type(value).__name__)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) else "a string"


def _integer(value: Any) -> str | None:
    return None if _is_int(value) else "an integer"


def _positive(value: Any) -> str | None:
    return None if _is_int(value) and value >= 1 else "a positive integer"


def _non_negative_number(value: Any) -> str | None:
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return None if finite else "a finite non-negative number"


def _sha256(value: Any) -> str | None:
    return None if isinstance(value, str) and SHA256.fullmatch(value) else "a sha256 (64 hex digits)"


def _mapping(*, may_lack: tuple[str, ...] = (), **fields: Check) -> Check:
    """An object holding at least ``fields`` but ``may_lack`` (fields that runs of earlier versions lack), each
    field present passing its check."""

    def check(value: Any) -> str | None:
        if not isinstance(value, dict):
            return f"an object with {', '.join(fields)}" if fields else "an object"
        for name, field_check in fields.items():
            if name not in value and name in may_lack:
                continue
            if name not in value:
                return f"an object with {', '.join(fields)} (it lacks {name})"
            problem = field_check(value[name])
            if problem is not None:
                return f"an object whose {name} is {problem}"
        return None

    return check


def _optional(check: Check) -> Check:
    return lambda value: None if value is None or check(value) is None else f"null or {check(value)}"


def _list_of(item: Check) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, list) or not value:
            return "a non-empty list"
        problems = [item(entry) for entry in value]
        return next((f"a list of {problem}" for problem in problems if problem is not None), None)

    return check


def _selector(value: Any) -> str | None:
    problem = _mapping(
        name=_string,
        stage=lambda stage: None if stage in SELECTOR_STAGES else "input, llm, composed or null",
        options=lambda options: None if isinstance(options, dict) else "an object",
    )(value)
    if problem is None and (value["name"] == UNPRUNED) != (value["stage"] is None):
        return f"an object whose stage is null exactly for the unpruned run (name {UNPRUNED!r})"
    return problem


def _budget(value: Any) -> str | None:
    if isinstance(value, list) and len(value) > 1 and all(_budget(part) is None for part in value):
        return None  # a composed selector's budgets, one per part
    if _is_int(value) and value >= 1:
        return None
    if isinstance(value, str) and SHARE.fullmatch(value) and 0 < float(value[:-1]) <= 100:
        return None
    return "a positive number of visual tokens, a share such as 11%, or a list of these (one per composed part)"


FILE_PIN = _mapping(path=_string, sha256=_sha256)

MANIFEST_SCHEMA: dict[str, tuple[bool, Check]] = {
    "version": (True, _string),
    "run_id": (True, _sha256),
    "records_schema": (True, _integer),  # its value is checked first (check_schema_version)
    "task": (False, _string),
    "max_new_tokens": (False, _optional(_positive)),
    "confidence": (False, _optional(_string)),
    "git_revision": (False, _optional(_string)),
    "versions": (False, _optional(_mapping())),
    "model": (True, _mapping(id=_string, config_hash=_string)),
    "family": (False, _optional(_string)),
    "prompt": (
        True,
        _mapping(template=_optional(_string), system=_optional(_string), first=_optional(_string), may_lack=("first",)),
    ),
    "dtype": (True, _string),
    "device": (False, _optional(_string)),
    "attn_implementation": (False, _optional(_string)),
    "num_layers": (False, _optional(_positive)),
    "answer_tokens": (False, _optional(_mapping())),
    "processor": (True, _mapping()),
    "clip_text": (False, lambda value: None),  # free-form information (a path, a hub id or null)
    "positions": (False, lambda value: None),
    "selector": (True, _selector),
    "budget": (True, _optional(_budget)),
    "question_files": (True, _list_of(FILE_PIN)),
    "annotations": (True, _optional(FILE_PIN)),
    "images": (True, _mapping(path=_string, sha256=_sha256, files=_mapping())),
    "split": (True, _string),
    "limit": (True, _optional(_positive)),
    "num_questions": (True, _positive),
    "seed": (True, _integer),
    "command": (False, _optional(_string)),
    "threads": (False, _optional(_mapping())),
    "realised_visual_tokens_avg": (False, _optional(_non_negative_number)),
}
"""Every manifest field (``MANIFEST_KEYS``): (required, check of its JSON type and domain)."""


def check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Refuse a manifest with a field missing, of the wrong JSON type or out of its domain, or whose
    ``run_id`` is not the one of its configuration (an edited manifest)."""
    problem = manifest_problem(manifest)
    if problem is not None:
        _refuse_field(path, *problem)


def manifest_problem(manifest: dict[str, Any]) -> tuple[str, str] | None:
    """The first field of ``manifest`` that ``check_manifest`` refuses and what is wrong with it, or None: every
    reader's check, also applied to the manifest ``import`` is about to write."""
    for name, (required, check) in MANIFEST_SCHEMA.items():
        if name not in manifest:
            if required:
                return name, "is missing"
            continue
        problem = check(manifest[name])
        if problem is not None:
            return name, f"must be {problem}, got {_shown(manifest[name])}"
    unpruned = manifest["selector"]["name"] == UNPRUNED
    if unpruned != (manifest["budget"] is None):
        return "budget", (
            f"must be null exactly for the unpruned run, got {_shown(manifest['budget'])} with selector "
            f"{manifest['selector']['name']!r}"
        )
    if manifest["run_id"] != run_id_of(manifest):
        return "run_id", "does not match the configuration fields (the manifest was edited)"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    shown = text if len(text) <= 40 else text[:37] + "..."
    return shown if value is None else f"{_json_type(value)} {shown}"


def _refuse_field(path: Path, name: str, problem: str) -> None:
    raise PruneAuditError(
        f"{path}: field {name!r} {problem}; it was not written by this prune-audit as is: restore the file, or "
        f"re-run with this version into a new --out"
    )


IDENTITY_FIELDS = (*CONFIG_FIELDS, "images")
"""What a run's records depend on: its configuration and the content of its images."""


def run_id_of(manifest: dict[str, Any]) -> str:
    """The ``run_id``: sha256 of the identity fields' content (paths left out, and the model's id too where
    the weights' sha256 stands for it), so shards of one command share it and a copied run keeps it."""
    identity = {name: _content(manifest.get(name)) for name in IDENTITY_FIELDS}
    model = identity.get("model")
    if isinstance(model, dict) and model.get("weights_sha256") is not None:
        identity["model"] = {key: value for key, value in model.items() if key != "id"}
    text = json.dumps(_normalise(identity), sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()
