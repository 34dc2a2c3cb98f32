"""Merge the records of sharded runs of one configuration."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import CONFIG_FIELDS, MANIFEST_FILE, differing_fields, read_manifest, write_manifest
from prune_audit.records.schema import RECORDS_FILE
from prune_audit.records.store import RecordStore, check_run_layout, merge_tables, stamped, write_table_atomic
from prune_audit.safety.ownership import check_output_dir, hold_output_dir


def merge_runs(run_dirs: Sequence[Path], out: Path | None = None) -> pa.Table:
    """Union the records of ``run_dirs`` into ``out`` (default: the first directory).

    Every directory must hold a manifest of the same configuration, and together
    they must cover every question of the run exactly; otherwise nothing is written.
    The manifest is written before the records, so an interrupted merge never leaves
    records without their manifest.
    """
    if not run_dirs:
        raise PruneAuditError("pass at least one run directory to merge")
    target = Path(out) if out is not None else Path(run_dirs[0])
    for directory in run_dirs:
        check_run_layout(Path(directory))
    manifests = [read_manifest(Path(d)) for d in run_dirs]
    check_output_dir(target, "run")  # after the inputs: a mistyped run is named as such
    check_run_layout(target)
    for directory, manifest in zip(run_dirs[1:], manifests[1:]):
        differences = differing_fields(manifests[0], manifest, (*CONFIG_FIELDS, "images"))
        if differences:
            raise PruneAuditError(
                f"{directory} was run with a different configuration than {run_dirs[0]} ({', '.join(differences)}); "
                f"merge only shards of one command"
            )
    stores = [RecordStore(Path(d), manifests[0]) for d in dict.fromkeys(Path(d).resolve() for d in run_dirs)]
    records = merge_tables((store.read() for store in stores), ", ".join(str(d) for d in run_dirs))
    expected = manifests[0]["num_questions"]
    if records.num_rows != expected:
        raise PruneAuditError(
            f"the shards hold {records.num_rows} of {expected} questions; run the missing shards, then merge again"
        )
    if (target / MANIFEST_FILE).is_file() and target.resolve() not in [Path(d).resolve() for d in run_dirs]:
        differences = differing_fields(read_manifest(target), manifests[0], (*CONFIG_FIELDS, "images"))
        if differences:
            raise PruneAuditError(
                f"{target} holds a run of another configuration ({', '.join(differences)}); merge never replaces "
                f"it: pass another --out"
            )
    manifest = dict(manifests[0])
    manifest["realised_visual_tokens_avg"] = float(np.mean(records["visual_tokens_avg"].to_numpy()))
    with hold_output_dir(target, "run", writes=(RECORDS_FILE, MANIFEST_FILE)):
        write_manifest(target, manifest)
        write_table_atomic(stamped(records, manifest["run_id"]), target / RECORDS_FILE)
        for store in stores:
            if store.run_dir.resolve() == target.resolve():
                store.compact()
    return records
