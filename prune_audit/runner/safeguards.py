"""What keeps a run's records trustworthy: batch and budget domains (``compute.budget``), inputs pinned by
content, the resume check, and one writer per run directory.

A resume is accepted only when everything the records depend on has the same content:
question files and annotations by sha256, the model's weights by sha256 and the images
the questions use by the sha256 of each file (``safety.fingerprint``). Paths are kept in
the manifest as information only, so a run copied to another machine or HOME resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prune_audit.compute.budget import Budget, check_budget_for
from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import MANIFEST_FILE, differing_fields, read_manifest
from prune_audit.records.schema import RECORDS_FILE
from prune_audit.records.store import PARTS_DIR, holds_records
from prune_audit.runner.embedded import used_images
from prune_audit.safety.atomic import remove_partial_files
from prune_audit.safety.fingerprint import (
    HashCache,
    combined_sha256,
    embedded_fingerprint,
    first_differing_image,
    images_fingerprint,
    weight_files,
)
from prune_audit.safety.ownership import hold_output_dir, remove_written

RUN_FILES = (MANIFEST_FILE, RECORDS_FILE)  # what a run writes directly in its folder (parts go under PARTS_DIR)


def check_run_options(selector: str, budget: Budget, batch_size: int) -> None:
    """Domains that do not need the model: batch size, and a positive budget exactly when there is a selector."""
    if batch_size < 1:
        raise PruneAuditError(f"--batch-size must be at least 1, got {batch_size}")
    check_budget_for(selector, budget)


def hash_cache_file() -> Path:
    """Where file hashes are remembered between runs (the prune-audit cache folder)."""
    from prune_audit.demo.questions import default_cache_dir

    return default_cache_dir() / "sha256-cache.json"


def weights_sha256(model_source: str) -> str | None:
    """sha256 over the weight files of a local checkpoint folder (None for a hub id)."""
    files = weight_files(model_source)
    if not files:
        return None
    cache = HashCache(hash_cache_file())
    digests = {path.name: cache.sha256(path) for path in files}
    cache.save()
    return combined_sha256(digests)


def pin_inputs(
    manifest: dict[str, Any],
    model_source: str,
    images_dir: Path,
    image_paths: dict[str, Path],
    embedded: Mapping[str, bytes] | None = None,
) -> None:
    """Add the content pins of the model weights and the used images to ``manifest``; ``embedded``: the images of
    Parquet question files by name (``runner.embedded``), pinned by their bytes (not yet written)."""
    weights = weights_sha256(model_source)
    if weights is not None:
        manifest["model"] = {**manifest.get("model", {}), "weights_sha256": weights}
    pins = (
        images_fingerprint(image_paths, hash_cache_file())
        if embedded is None
        else embedded_fingerprint(used_images(embedded, image_paths))
    )
    manifest["images"] = {"path": str(images_dir), **pins}


def check_resumable(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Refuse a run directory holding a run of another configuration or other inputs."""
    if (run_dir / MANIFEST_FILE).is_file():
        check_same_run(run_dir, read_manifest(run_dir), manifest)


def check_same_run(run_dir: Path, previous: dict[str, Any], manifest: dict[str, Any]) -> None:
    """The manifest of ``run_dir`` (``previous``) describes the same configuration and inputs."""
    differences = differing_fields(previous, manifest)
    if differences:
        raise PruneAuditError(
            f"{run_dir} holds a run with a different configuration ({', '.join(differences)}); "
            f"pass another --out or repeat the original command"
        )
    old_images, new_images = previous.get("images"), manifest.get("images")
    if isinstance(old_images, dict) and isinstance(new_images, dict):
        changed = first_differing_image(old_images, new_images)
        if changed is not None:
            raise PruneAuditError(
                f"{run_dir} was run on other images: {changed} in {new_images.get('path')} has other content than "
                f"when its records were written; pass the original --images or another --out"
            )


def hold_run_dir(run_dir: Path, shard_writer: str | None) -> ExitStack:
    """Own the run directory as a run (``hold_output_dir``; shards share it) and drop partial files.

    The caller closes the returned stack when the run ends. Partial files of interrupted
    writes are removed only where no live writer can own them: the run's own files under
    the exclusive lock, this shard's part files under a shard lock.
    """
    held = ExitStack()
    held.enter_context(hold_output_dir(run_dir, "run", shard=shard_writer, writes=RUN_FILES))
    try:
        remove_partial_files(run_dir / PARTS_DIR, [f"part-{shard_writer or '*'}-*.parquet"])
    except BaseException:
        held.close()
        raise
    return held


def undo_first_writes(run_dir: Path, written: list[Path]) -> None:
    """After a failure: remove what a new run wrote (``written``: its manifest, its embedded images) while it
    holds no record yet, and the parts folder its failed append made, so the corrected command is not refused
    as another configuration; then ``hold_output_dir`` gives the emptied folder back."""
    if written and not holds_records(run_dir):
        remove_written(run_dir, written)
        try:
            (run_dir / PARTS_DIR).rmdir()  # made empty by the append that failed
        except OSError:
            pass  # absent, or holds something else
