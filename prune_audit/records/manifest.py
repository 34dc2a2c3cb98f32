"""The run manifest: everything needed to reproduce a run and to refuse an inconsistent resume."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

from prune_audit import __version__
from prune_audit.errors import PruneAuditError
from prune_audit.records.schema import SCHEMA_VERSION
from prune_audit.safety.atomic import write_text_atomic

MANIFEST_FILE = "manifest.json"

# fields that define the run: a resume must match them exactly
CONFIG_FIELDS = (
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
    ("records_schema", "version of the record columns (records/schema.py SCHEMA_VERSION); every reader and resume "
     "refuse another version"),
    ("git_revision", "git commit of the prune-audit source (null outside a checkout)"),
    ("versions", "{python, torch, transformers} versions"),
    ("model", "{id, config_hash}: model folder or hub id, and a hash of its config"),
    ("family", "model family adapter: llava or qwen2_5_vl"),
    ("prompt", "{template, system}: prompt template name and system prompt"),
    ("dtype", "weights' dtype (float32, bfloat16, float16)"),
    ("device", "torch device the model ran on"),
    ("attn_implementation", "attention kernel (sdpa)"),
    ("num_layers", "decoder layers of the language model"),
    ("answer_tokens", "{yes, no}: token ids summed into p_yes and p_no"),
    ("processor", "image processor: class, geometry mode, sizes, patch size; first_image: the first "
     "question's TokenGeometry"),
    ("clip_text", "LLaVA: CLIP text tower used for CDPruner relevance (null when none)"),
    ("positions", "Qwen2.5-VL: position ids the pruned sequence keeps"),
    ("selector", "{name, stage, options, positions, schedule, schedule_num_visual}: the selector as run "
     "(schedule: [layer, keep] stages of in-LLM selectors for the first question's token count; keep excludes "
     "the tokens a merge inserts, such as SparseVLM's recycled ones, which realised_visual_tokens_avg counts)"),
    ("budget", "--budget in visual tokens, or a share as given (11%: each image keeps its share, rounded half up; "
               "visual_tokens_avg holds the realised count); null for the unpruned run"),
    ("question_files", "[{path, sha256}] of the POPE files"),
    ("annotations", "{path, sha256} of the COCO instances file (null without masks)"),
    ("images", "folder of the question images"),
    ("split", "--split (all by default)"),
    ("limit", "--limit (null: every question)"),
    ("num_questions", "questions in the run (all shards)"),
    ("seed", "--seed of random selectors"),
    ("command", "the command line as parsed (options that differ from their defaults)"),
    ("threads", "{intra_op, inter_op, source, usable_cores}: torch threads and where the number came "
     "from (--threads, OMP_NUM_THREADS or sched_getaffinity); not part of the configuration"),
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
    """The run's manifest; refused unless its records follow this version's schema (``SCHEMA_VERSION``)."""
    path = Path(run_dir) / MANIFEST_FILE
    if not path.is_file():
        raise PruneAuditError(f"{run_dir} is not a run directory (no {MANIFEST_FILE}); pass a directory written by prune-audit run")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise PruneAuditError(f"{path} is not valid JSON ({error.msg}); re-run to rewrite it") from None
    check_schema_version(manifest, run_dir)
    return manifest


def check_schema_version(manifest: dict[str, Any], run_dir: Path) -> None:
    """Refuse a run whose records schema is not this version's, rather than misread it."""
    version = manifest.get("records_schema") if isinstance(manifest, dict) else None
    if version == SCHEMA_VERSION:
        return
    written = "an older" if not isinstance(version, int) or version < SCHEMA_VERSION else "a newer"
    raise PruneAuditError(
        f"{run_dir} was written by {written} prune-audit (records schema {version or 1}, this version reads "
        f"{SCHEMA_VERSION}); re-run with this version (into a new --out directory)"
    )


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    write_text_atomic(json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n", Path(run_dir) / MANIFEST_FILE)


def images_folder(manifest: dict[str, Any]) -> Path:
    """The folder the run read its images from (manifests before content pins held it as a string)."""
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
