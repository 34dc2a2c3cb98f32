"""Time every input-level selector on synthetic signals and report its peak extra memory.

    python benchmarks/selectors.py                      # N = 576, 2304, 16384; D = 4096
    python benchmarks/selectors.py --tokens 576 --dim 1024 --selectors divprune scope
    python -m benchmarks.selectors --threads 1 --tokens 16384 --selectors divprune cdpruner scope coverage --floor

Each (selector, N) runs in a fresh process (``--measure``) so that peak memory is
that selector's alone: the process builds the signals, warms up on a tiny input,
resets the kernel's peak-RSS mark (``/proc/self/clear_refs``) and reports
``VmHWM - VmRSS`` after the timed runs, i.e. the extra resident memory the
selection needed beyond its inputs. Timing is the median of ``--repeats`` runs (one
run when N >= 8192) of the wall time or, at ``--threads 1``, of the thread's CPU time
(which does not count waiting for a core on a shared machine). CPU, float32.

``--official`` also times, in the same process and alternating with the selector run by run,
the official algorithm's plain form (:data:`OFFICIAL`, re-derived from the paper and the
reference code it names: DivPrune, CDPruner, SCOPE; coverage has no official code) on the same input, and says whether both keep
the same set.

``--floor`` also times, in the same process after the selector, one plain matrix
product with the multiply-adds of the greedy selectors' arithmetic (:data:`FLOORS`),
and prints the selector's time as a multiple of it.

Signals: ``features`` and ``vision_features`` are (N, D) draws around 64 random
cluster centres (so similarity-based greedy methods see structure, as on real
images), ``cls_attention`` (16, N) softmax rows, ``vision_keys`` (16, N + 1, 64),
``text_relevance`` and ``demand`` (N,) random. The budget is ``--budget`` tokens or,
by default, ``round(N / 9)`` (11.1 % kept, the most aggressive of the usual 33.3 /
22.2 / 11.1 % Qwen2.5-VL settings; 64 tokens at N = 576).
"""

from __future__ import annotations

import os
import sys

# this file shares its name with the stdlib module `selectors` (imported by subprocess):
# keep the script's own folder off the import path
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse
import ctypes
import json
import math
import statistics
import subprocess
import time
from pathlib import Path

HEADS, KEY_DIM, CLUSTERS = 16, 64, 64

FLOORS = {
    # isolation pass (the N x N Gram) + one similarity row per pick
    "divprune": lambda n, d, k: (n, d, n + k),
    # one kernel row per pick + the Cholesky corrections (sum over picks of t x N: k^2 N / 2)
    "cdpruner": lambda n, d, k: (n, d + k // 2, k),
    # the N x N Gram; the greedy gap sums are additions, not multiply-adds, and are not counted
    "scope": lambda n, d, k: (n, d, n),
    "coverage": lambda n, d, k: (n, d, n),
}
"""Per greedy selector, ``(N, D, k) -> (m, inner, n)``: one (m, inner) @ (inner, n) product with its multiply-adds."""


def official_divprune(features, budget: int):
    """DivPrune's plain form (Alvar et al., CVPR 2025; vbdi/divprune ``DivPrune``, defaults): the full cosine
    distance matrix ``1 - cos``, the first pick the token farthest from its nearest other token, each later pick
    the token whose smallest distance to the picks so far is largest, recomputed over the picked rows every step.
    Returns the picks, ascending."""
    import torch

    unit = features / torch.linalg.vector_norm(features, dim=1, keepdim=True)
    distance = 1.0 - unit @ unit.T
    picks = [int(torch.topk(distance, 2, dim=0, largest=False).values[1].argmax())]
    for _ in range(budget - 1):
        picks.append(int(distance[picks].min(dim=0).values.argmax()))
    return torch.tensor(sorted(picks))


def official_cdpruner(features, text_relevance, budget: int):
    """CDPruner's plain form (Theia-4869/CDPruner ``encode_images``, theta off): relevance min-max normalised,
    the whole kernel ``L = r_i r_j cos(f_i, f_j)``, then fast greedy MAP (Chen et al. 2018) without early stop:
    each step the largest conditional gain ``d_j``, its Cholesky vector ``(L[j] - C[:, j] @ C) / sqrt(d_j)``.
    Returns the picks, ascending."""
    import torch

    relevance = (text_relevance - text_relevance.min() + 1e-6) / (text_relevance.max() - text_relevance.min())
    unit = features / torch.linalg.vector_norm(features, dim=-1, keepdim=True)
    kernel = relevance[:, None] * (unit @ unit.T) * relevance[None, :]
    vectors = torch.zeros(budget, kernel.shape[0])
    gains = torch.diagonal(kernel).clone()
    picks = []
    for step in range(budget):
        best = int(torch.argmax(gains))
        picks.append(best)
        vector = (kernel[best] - vectors[:step, best] @ vectors[:step]) / torch.sqrt(gains[best])
        vectors[step] = vector
        gains -= vector**2
        gains[best] = -float("inf")
    return torch.tensor(sorted(picks))


def official_scope(vision_features, cls_attention, budget: int):
    """SCOPE's plain form (kinredon/SCOPE ``SCOPE``, ALPHA=1, COMBINED=multi): the whole cosine matrix, then each
    step every candidate's coverage gain ``sum_j max(0, S[j, i] - cov_j)`` recomputed over all of ``S``, times
    its CLS saliency; the best joins and raises the coverage. Returns the picks, ascending."""
    import torch

    unit = vision_features / torch.linalg.vector_norm(vision_features, dim=-1, keepdim=True)
    similarity, saliency = unit @ unit.T, cls_attention.sum(dim=0)
    coverage, picked, picks = torch.zeros(similarity.shape[0]), torch.zeros(similarity.shape[0], dtype=torch.bool), []
    for _ in range(budget):
        gains = (similarity - coverage[:, None]).clamp_min(0).sum(dim=0)
        best = int(torch.argmax((saliency * gains).masked_fill(picked, -float("inf"))))
        picks.append(best)
        picked[best] = True
        coverage = torch.maximum(coverage, similarity[:, best])
    return torch.tensor(sorted(picks))


OFFICIAL = {
    "scope": lambda signals, budget: official_scope(signals.vision_features, signals.cls_attention, budget),
    "divprune": lambda signals, budget: official_divprune(signals.features, budget),
    "cdpruner": lambda signals, budget: official_cdpruner(signals.features, signals.text_relevance, budget),
}
"""Per selector, its official algorithm's plain form: ``(signals, budget) -> kept grid indices, ascending``."""


def read_memory_kib() -> dict[str, int]:
    """Current (VmRSS) and peak (VmHWM) resident memory of this process in KiB."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


def reset_peak_rss() -> int:
    """Set this process's peak resident memory to the current one; returns the current (KiB).

    Freed heap memory is handed back first: otherwise later allocations would reuse it
    without raising the RSS, and the peak would miss them.
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    return read_memory_kib()["VmRSS"]


def grid_for(tokens: int) -> tuple[int, int]:
    rows = math.isqrt(tokens)
    while tokens % rows:
        rows -= 1
    return rows, tokens // rows


def synthetic_signals(tokens: int, dim: int, seed: int = 0):
    """InputSignals for one synthetic image with N = ``tokens`` and width ``dim``."""
    import torch

    from prune_audit.pruners import InputSignals

    generator = torch.Generator().manual_seed(seed)

    def clustered() -> torch.Tensor:
        centres = torch.randn(CLUSTERS, dim, generator=generator)
        labels = torch.randint(0, CLUSTERS, (tokens,), generator=generator)
        return centres[labels] + 0.7 * torch.randn(tokens, dim, generator=generator)

    return InputSignals(
        grid=grid_for(tokens),
        features=clustered(),
        vision_features=clustered(),
        cls_attention=torch.softmax(3 * torch.randn(HEADS, tokens, generator=generator), dim=1),
        vision_keys=torch.randn(HEADS, tokens + 1, KEY_DIM, generator=generator),
        cls_feature=torch.randn(dim, generator=generator),
        text_relevance=torch.randn(tokens, generator=generator),
        demand=torch.rand(tokens, generator=generator),
    )


def clock() -> float:
    """CPU time of this thread when torch computes in it (one thread), else wall time."""
    import torch

    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def floor_ms(name: str, tokens: int, dim: int, budget: int, repeats: int) -> float:
    """Median milliseconds of the plain matrix product :data:`FLOORS` gives for ``name``."""
    import torch

    rows, inner, columns = FLOORS[name](tokens, dim, budget)
    left, right = torch.randn(rows, inner), torch.randn(inner, columns)
    times = []
    for _ in range(repeats):
        start = clock()
        torch.matmul(left, right)
        times.append(clock() - start)
    return 1000 * statistics.median(times)


def measure(
    name: str,
    tokens: int,
    dim: int,
    budget: int,
    repeats: int,
    threads: int,
    floor: bool = False,
    official: bool = False,
) -> dict[str, float]:
    """Median milliseconds per image and peak extra MiB of one selector (run in a fresh process)."""
    import torch

    from prune_audit.pruners import get_selector

    if threads:
        torch.set_num_threads(threads)

    selector = get_selector(name)
    selector.select(synthetic_signals(64, 8), 8, torch.Generator().manual_seed(0))  # warm-up
    signals = synthetic_signals(tokens, dim)
    before = reset_peak_rss()
    times, official_times = [], []
    for _ in range(repeats):
        start = clock()
        kept = selector.select(signals, budget, torch.Generator().manual_seed(0)).kept
        times.append(clock() - start)
        if official and name in OFFICIAL:  # alternating, so both see the same machine load
            start = clock()
            official_kept = OFFICIAL[name](signals, budget)
            official_times.append(clock() - start)
    peak = read_memory_kib()["VmHWM"]
    row = {
        "selector": name,
        "tokens": tokens,
        "budget": budget,
        "ms": 1000 * statistics.median(times),
        "peak_extra_mib": (peak - before) / 1024,
    }
    if official_times:
        row["official_ms"] = 1000 * statistics.median(official_times)
        row["same_kept"] = bool(torch.equal(kept, official_kept))
    if floor and name in FLOORS:
        del signals
        row["floor_ms"] = floor_ms(name, tokens, dim, budget, repeats)
    return row


def run_child(name: str, tokens: int, args: argparse.Namespace) -> dict[str, float]:
    budget = default_budget(tokens, args.budget)
    repeats = 1 if tokens >= 8192 else args.repeats
    command = [
        sys.executable,
        __file__,
        "--measure",
        name,
        "--tokens",
        str(tokens),
        "--dim",
        str(args.dim),
        "--budget",
        str(budget),
        "--repeats",
        str(repeats),
        "--threads",
        str(args.threads),
    ]
    if args.floor:
        command.append("--floor")
    if args.official:
        command.append("--official")
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(output)


def default_budget(tokens: int, budget: int) -> int:
    return budget or round(tokens / 9)


def input_selector_names() -> list[str]:
    from prune_audit.pruners import list_selectors, selector_class

    return [name for name in list_selectors() if selector_class(name).stage == "input"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[576, 2304, 16384])
    parser.add_argument("--dim", type=int, default=4096, help="width D of features and vision features")
    parser.add_argument("--budget", type=int, default=0, help="tokens kept (default round(N / 9))")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--selectors", nargs="+", help="default: every input-level selector")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--floor", action="store_true", help="also time a plain matmul with the greedy selectors' multiply-adds"
    )
    parser.add_argument(
        "--official",
        action="store_true",
        help="also time the official algorithm's plain form side by side (OFFICIAL: divprune, cdpruner, scope)",
    )
    parser.add_argument("--measure", metavar="SELECTOR", help=argparse.SUPPRESS)
    parser.add_argument("--block-elements", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        if args.block_elements:
            from prune_audit.pruners import similarity

            similarity.BLOCK_ELEMENTS = args.block_elements
        tokens = args.tokens[0]
        budget = default_budget(tokens, args.budget)
        print(
            json.dumps(
                measure(args.measure, tokens, args.dim, budget, args.repeats, args.threads, args.floor, args.official)
            )
        )
        return

    import torch

    threads = args.threads or torch.get_num_threads()
    kind = "thread CPU time" if threads == 1 else "wall time"
    print(f"torch {torch.__version__}, {threads} thread(s), {kind}, D = {args.dim}, float32, CPU")
    floor_header = f" {'floor ms':>10} {'x floor':>8}" if args.floor else ""
    official_header = f" {'official ms':>12} {'x official':>10} {'same kept':>9}" if args.official else ""
    print(
        f"{'selector':<10} {'N':>6} {'kept':>5} {'ms/image':>10} {'peak extra MiB':>15}{floor_header}{official_header}"
    )
    for tokens in args.tokens:
        for name in args.selectors or input_selector_names():
            row = run_child(name, tokens, args)
            floor = f" {row['floor_ms']:>10.1f} {row['ms'] / row['floor_ms']:>8.2f}" if "floor_ms" in row else ""
            official = (
                f" {row['official_ms']:>12.1f} {row['ms'] / row['official_ms']:>10.2f} {str(row['same_kept']):>9}"
                if "official_ms" in row
                else ""
            )
            print(
                f"{name:<10} {tokens:>6} {row['budget']:>5} {row['ms']:>10.1f} {row['peak_extra_mib']:>15.1f}{floor}"
                f"{official}",
                flush=True,
            )


if __name__ == "__main__":
    main()
