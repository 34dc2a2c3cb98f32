"""The README's main job: `prune-audit run` with no options audits the bundled demo end to end."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest


@pytest.mark.slow
def test_default_run_from_the_readme_writes_records(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "prune_audit.cli.main", "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    run_dir = tmp_path / "runs" / "demo-dense"
    records = pq.read_table(run_dir / "records.parquet").to_pandas()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert len(records) == manifest["num_questions"] == 9000
    assert set(records["split"]) == {"random", "popular", "adversarial"}
    assert records["correct"].mean() >= 0.95
    assert (records["visual_tokens_avg"] == 144).all()
    assert f"{records['correct'].mean():.4f}" in completed.stdout
