"""CPU threads of the commands that run a model (``--threads``).

PyTorch starts one intra-op thread per physical core of the machine, even when the
process may only use some of them (taskset, cgroups, SLURM) or when other processes
share the cores. Oversubscribed OpenMP threads spin-wait on each other, so a run beside
a busy process can slow down many times over. The commands therefore pin

- intra-op threads to ``--threads N``; without it ``$OMP_NUM_THREADS`` when set, else the
  cores this process may use (``os.sched_getaffinity``);
- inter-op threads to 1 (the commands run one forward pass at a time).

The choice is returned as a dict for the run manifest.
"""

from __future__ import annotations

import os

from prune_audit.errors import PruneAuditError


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> tuple[int, str]:
    """(threads, where the number came from): $OMP_NUM_THREADS when set, else the usable cores."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        try:
            if int(value) >= 1:
                return int(value), "OMP_NUM_THREADS"
        except ValueError:
            pass
        raise PruneAuditError(f"OMP_NUM_THREADS must be a positive integer, got {value!r}; unset it or pass --threads N")
    return usable_cores(), "sched_getaffinity"


def configure_threads(threads: int | None) -> dict:
    """Set torch's intra-op threads (``threads`` or the default) and one inter-op thread.

    Returns ``{"intra_op", "inter_op", "source", "usable_cores"}`` for the manifest.
    """
    import torch

    if threads is not None and threads < 1:
        raise PruneAuditError(f"--threads must be at least 1, got {threads}")
    count, source = (threads, "--threads") if threads is not None else default_threads()
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
