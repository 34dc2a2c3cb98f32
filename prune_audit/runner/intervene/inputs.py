"""Where ``intervene`` reads a run's inputs: the recorded paths, or overrides checked against the pins.

A run copied to another machine keeps its manifest, whose paths point to the old one.
``--pope``, ``--images``, ``--annotations`` and ``--model`` (as for ``run``) name the same
inputs elsewhere; each is accepted only when its content matches the manifest's sha256
pins (``runner.safeguards``), so the re-run questions see exactly the run's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import images_folder
from prune_audit.runner.safeguards import hash_cache_file, weights_sha256
from prune_audit.safety import fingerprint
from prune_audit.safety.fingerprint import file_sha256, first_differing_image, images_fingerprint
from prune_audit.safety.inputs import check_input_file, path_under


@dataclass(frozen=True)
class RunInputs:
    """The run's inputs; as overrides, None (or no question files) means the recorded path."""

    question_files: tuple[Path, ...] = ()
    images: Path | None = None
    annotations: Path | None = None
    model: str | None = None


def locate_inputs(manifest: dict[str, Any], overrides: RunInputs) -> RunInputs:
    """Every input of the run, each override verified against its pin; refused in one line otherwise."""
    return RunInputs(
        question_files=question_files(manifest, overrides.question_files),
        images=images_dir(manifest, overrides.images),
        annotations=annotations_file(manifest, overrides.annotations),
        model=model_source(manifest, overrides.model),
    )


def question_files(manifest: dict[str, Any], overrides: tuple[Path, ...]) -> tuple[Path, ...]:
    """The question files: each override must hash as one pinned file, and every pinned file be given."""
    pinned = manifest.get("question_files", [])
    if not overrides:
        for entry in pinned:
            check_pinned_file(Path(entry["path"]), entry["sha256"], "--pope FILE (repeatable)")
        return tuple(Path(entry["path"]) for entry in pinned)
    pins = {entry["sha256"]: entry["path"] for entry in pinned}
    given = {file_sha256(existing(path, "--pope")): path for path in overrides}
    for digest, path in given.items():
        if digest not in pins:
            raise PruneAuditError(f"--pope {path} is none of the run's question files (sha256 differs)")
    for digest, recorded in pins.items():
        if digest not in given:
            raise PruneAuditError(f"the run's question file {Path(recorded).name} is not among --pope; pass it too")
    return tuple(overrides)


def annotations_file(manifest: dict[str, Any], override: Path | None) -> Path:
    entry = manifest["annotations"]
    if override is None:
        check_pinned_file(Path(entry["path"]), entry["sha256"], "--annotations FILE")
        return Path(entry["path"])
    if file_sha256(existing(override, "--annotations")) != entry["sha256"]:
        raise PruneAuditError(f"--annotations {override} is not the run's annotations file (sha256 differs)")
    return override


def images_dir(manifest: dict[str, Any], override: Path | None) -> Path:
    """The images folder, recorded or overridden; it must hold every image the run used, with the pinned bytes
    (the manifest schema requires the pins)."""
    pins = manifest["images"]
    if override is None:
        folder, where, fix = (
            images_folder(manifest),
            "the run's images folder",
            "pass --images DIR with the run's images",
        )
        if not folder.is_dir():
            raise PruneAuditError(f"{folder}, {where}, is not found; pass --images DIR")
    else:
        folder, where, fix = override, "--images", "pass the folder holding the run's images"
    paths = {name: path_under(folder, name, "the run's manifest") for name in pins["files"]}
    for path in paths.values():
        check_input_file(path, f"image of the run (in {where})", fix, limit_size=False)
    changed = first_differing_image(pins, images_fingerprint(paths, hash_cache_file()))
    if changed is not None:
        raise PruneAuditError(f"{where} {folder}: {changed} has other content than in the run (sha256 differs); {fix}")
    return folder


def model_source(manifest: dict[str, Any], override: str | None) -> str:
    """The model folder or hub id; an override must hold weights with the pinned sha256."""
    model = manifest["model"]
    pinned = model.get("weights_sha256")
    if override is None:
        if pinned is not None and not Path(model["id"]).is_dir():
            raise PruneAuditError(f"{model['id']}, the run's model folder, is not found; pass --model PATH")
        if pinned is not None and weights_sha256(model["id"]) != pinned:
            raise PruneAuditError(
                f"{model['id']}, the run's model folder, now holds other weights (sha256 differs); "
                f"pass --model PATH with the run's model"
            )
        return model["id"]
    if pinned is None:
        raise PruneAuditError("the run's manifest pins no model weights, so --model cannot be verified")
    if not Path(override).is_dir():
        raise PruneAuditError(f"--model {override} is not a model folder")
    if weights_sha256(override) != pinned:
        raise PruneAuditError(f"--model {override} has other weights than the run's model (sha256 differs)")
    return override


def check_pinned_file(path: Path, sha256: str, option: str) -> None:
    """A recorded input still exists and hashes as when the run was made (else: pass ``option``)."""
    fingerprint.check_pinned_file(
        path, sha256, "the run's manifest", f"pass {option} with the run's own file", hash_cache_file()
    )


def existing(path: Path, option: str) -> Path:
    if not Path(path).is_file():
        raise PruneAuditError(f"{option} {path} is not a file")
    return Path(path)
