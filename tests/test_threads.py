"""--threads: the default follows $OMP_NUM_THREADS, else the cores this process may use; one inter-op thread."""

import json
import os
import subprocess
import sys

import pytest

from prune_audit.errors import PruneAuditError
from prune_audit.threads import check_threads, default_threads, usable_cores


def configured(threads, env_threads):
    """configure_threads(threads) in a fresh interpreter (inter-op threads are settable once per process)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = env_threads
    code = f"import json; from prune_audit.threads import configure_threads; print(json.dumps(configure_threads({threads})))"
    return json.loads(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    )


def test_usable_cores_is_the_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_default_follows_omp_num_threads_else_the_affinity(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == (usable_cores(), "sched_getaffinity")
    monkeypatch.setenv("OMP_NUM_THREADS", str(usable_cores()))
    assert default_threads() == (usable_cores(), "OMP_NUM_THREADS")
    for value in ("many", "²", "+1", "1_0"):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        with pytest.raises(PruneAuditError, match="OMP_NUM_THREADS must be a positive integer"):
            default_threads()


def test_more_threads_than_usable_cores_are_refused(monkeypatch):
    """OpenBLAS cannot start 100000 threads and the process dies with SIGSEGV: the limit is the usable cores."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    assert check_threads(cores) == (cores, "--threads")
    with pytest.raises(PruneAuditError, match=f"--threads {cores + 1} is more than the {cores} cores"):
        check_threads(cores + 1)
    with pytest.raises(PruneAuditError, match="--threads must be at least 1"):
        check_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    for threads in (None, 1):  # other libraries read the variable even when --threads is given
        with pytest.raises(PruneAuditError, match=f"OMP_NUM_THREADS=100000 is more than the {cores} cores"):
            check_threads(threads)


def test_configure_sets_intra_and_one_inter_op_thread():
    assert configured(None, None) == {
        "intra_op": usable_cores(),
        "inter_op": 1,
        "source": "sched_getaffinity",
        "usable_cores": usable_cores(),
    }
    assert configured(None, "1")["intra_op"] == 1
    chosen = configured(usable_cores(), "1")
    assert chosen["intra_op"] == usable_cores() and chosen["source"] == "--threads"
