"""Question files that embed their images (the lmms-eval Parquet layouts): no ``--images`` folder.

Planning decodes every embedded image the run uses in memory (nothing is written); execution
writes them under ``RUN_DIR/images/`` before the first record, so the manifest's images folder,
``visualize --run`` and ``intervene`` read them as any run's images. Their pins are the sha256 of
the embedded bytes, equal to those of the written files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from prune_audit.errors import PruneAuditError

EMBEDDED_IMAGES = "images"
"""The folder of the run directory that holds the images embedded in its question files."""


def check_embedded_images(
    images_option: Path | None, embedded: Mapping[str, bytes], questions: Sequence, run_dir: Path
) -> tuple[dict[str, Path], dict[str, tuple[int, int]]]:
    """Every used embedded image decodes: where the run will write it and its (width, height), by name.

    ``questions``: the run's ``TaskQuestion``s; ``images_option``: ``--images``, which must be absent.
    """
    from prune_audit.data.images import decode_rgb
    from prune_audit.safety.inputs import check_image_name
    from prune_audit.safety.names import check_file_names
    from prune_audit.safety.ownership import check_owned_paths

    if images_option is not None:
        raise PruneAuditError(f"the Parquet question files embed their images; drop --images {images_option}")
    paths: dict[str, Path] = {}
    sizes: dict[str, tuple[int, int]] = {}
    names = list(dict.fromkeys(question.image for question in questions))
    where = "the Parquet question files' image_source"
    for name in names:
        check_image_name(name, where)
    check_file_names(names, where)
    for name in names:
        sizes[name] = decode_rgb(embedded[name], f"{name} (embedded in the question files)").size
        paths[name] = run_dir / EMBEDDED_IMAGES / name
    check_owned_paths(run_dir, paths.values())
    return paths, sizes


def used_images(embedded: Mapping[str, bytes], image_paths: Mapping[str, Path]) -> dict[str, bytes]:
    """The embedded images the run uses (``image_paths``' names), in first-use order."""
    return {name: embedded[name] for name in image_paths}


def write_embedded_images(
    embedded: Mapping[str, bytes], image_paths: Mapping[str, Path], run_dir: Path, written: list[Path]
) -> None:
    """Write each used embedded image to its path in the run directory, unless it already holds these bytes
    (a resumed run); each path is checked again right before (``check_owned_paths``: never through a link), and
    appended to ``written`` once written."""
    from prune_audit.safety.atomic import write_bytes_atomic
    from prune_audit.safety.ownership import check_owned_paths

    for name, path in image_paths.items():
        check_owned_paths(run_dir, [path])
        data = embedded[name]
        if path.is_file() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(data, path)
        written.append(path)
