"""CPU threads of the commands that run a model (``--threads``).

PyTorch starts one intra-op thread per physical core of the machine, even when the
process may only use some of them (taskset, cgroups, SLURM) or when other processes
share the cores. Oversubscribed OpenMP threads spin-wait on each other, so a run beside
a busy process can slow down many times over. The commands therefore pin

- intra-op threads to ``--threads N``; without it ``$OMP_NUM_THREADS`` when set, else the
  cores this process may use (``os.sched_getaffinity``);
- inter-op threads to 1 (the commands run one forward pass at a time).

Either count must lie in 1..usable cores: more threads than cores only wait for each other, and a
count far beyond (``--threads 100000``) cannot be started and crashes OpenBLAS with SIGSEGV.

The choice is returned as a dict for the run manifest.
"""

from __future__ import annotations

import os

from prune_audit.errors import PruneAuditError
from prune_audit.integers import parse_integer


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> tuple[int, str]:
    """(threads, where the number came from): $OMP_NUM_THREADS when set, else the usable cores."""
    from_environment = environment_threads()
    return (
        (from_environment, "OMP_NUM_THREADS") if from_environment is not None else (usable_cores(), "sched_getaffinity")
    )


def environment_threads() -> int | None:
    """$OMP_NUM_THREADS checked like ``--threads`` (None when unset): OpenBLAS and OpenMP read it too,
    and a count they cannot start crashes the process (SIGSEGV) instead of failing."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    fix = "unset it or pass --threads N"
    try:
        count = parse_integer(value)
    except ValueError:
        raise PruneAuditError(f"OMP_NUM_THREADS must be a positive integer, got {value!r}; {fix}") from None
    return _within_cores(
        count, "OMP_NUM_THREADS", f"OMP_NUM_THREADS={value}", f"set it to 1 to {usable_cores()} or unset it"
    )


def check_threads(threads: int | None) -> tuple[int, str]:
    """(threads, source) for ``--threads`` (None: the default), each in 1..usable_cores(); nothing is changed.

    $OMP_NUM_THREADS is checked even when ``--threads`` is given, since other libraries read it.
    Called by planning before anything is written; ``configure_threads`` calls it again.
    """
    if threads is None:
        return default_threads()
    environment_threads()
    fix = f"pass --threads 1 to {usable_cores()} (or leave it out)"
    return _within_cores(threads, "--threads", f"--threads {threads}", fix), "--threads"


def _within_cores(count: int, name: str, given: str, fix: str) -> int:
    """``count`` when 1 <= count <= the usable cores: more threads than cores only wait for each other,
    and far more cannot be started at all."""
    if count < 1:
        raise PruneAuditError(f"{name} must be at least 1, got {count}; {fix}")
    cores = usable_cores()
    if count > cores:
        raise PruneAuditError(f"{given} is more than the {cores} cores this process may use; {fix}")
    return count


def configure_threads(threads: int | None) -> dict:
    """Set torch's intra-op threads (``threads`` or the default, checked by ``check_threads``) and one
    inter-op thread.

    Returns ``{"intra_op", "inter_op", "source", "usable_cores"}`` for the manifest.
    """
    import torch

    count, source = check_threads(threads)
    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op work; a second call in one process keeps it
        pass
    return {
        "intra_op": torch.get_num_threads(),
        "inter_op": torch.get_num_interop_threads(),
        "source": source,
        "usable_cores": usable_cores(),
    }
