"""How this machine's half-precision CPU kernels round, against a float32-accumulated product rounded once.

    python -m benchmarks.half_kernels

The kept-set tests (the half-precision tests of tests/pruners/test_<name>.py) assert what prune-audit guarantees: the kept sets equal the
official ones also when the official code runs with this CPU's half GEMM. How many products that GEMM rounds
differently from a GPU's float32 accumulation depends on the CPU's kernels (AMX, avx512_fp16, avx512_bf16 or
none), so it is measured here, not asserted:

- ``fastv_last_row``: per prompt (10 seeds), of the 18,432 last-row image probabilities (32 heads x 576) of
  the official eager attention (FastV, PDrop, VScan's LLM stage), how many differ;
- ``rope_logits``: of the 423,801 all-ones RoPE logits of SparseVLM v2.0 (651 x 651), how many differ.

The last line is JSON, with the CPU's half-precision flags.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# the cases are the tests' own (one definition), as benchmarks/lmms_eval_compare.py reads its test's helpers
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / folder) for folder in ("", "pruners")]
import torch  # noqa: E402
from rederivation import HALF_DTYPES, PREFIX, SEEDS, TOKENS, dtype_name, fastv_cpu_gemm_case  # noqa: E402
from test_sparsevlm2 import official_rope_ones_half  # noqa: E402

HALF_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "f16c")
"""The CPU flags that select torch's half-precision GEMM kernels."""


def cpu_half_flags() -> list[str]:
    """Those of ``HALF_FLAGS`` that /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [flag for flag in HALF_FLAGS if flag in flags]


def fastv_last_row(dtype: torch.dtype) -> list[int]:
    """Per seed, the last-row image probabilities the CPU GEMM rounds differently from the float32-accumulated one."""
    image = slice(PREFIX, PREFIX + TOKENS)
    counts = []
    for seed in SEEDS:
        official, probe = fastv_cpu_gemm_case(seed, dtype)
        counts.append(int((official[:, -1, image] != probe[:, -1, image]).sum()))
    return counts


def rope_logits(dtype: torch.dtype) -> int:
    """The all-ones RoPE logits the CPU GEMM rounds differently from the float32-accumulated product."""
    length = PREFIX + TOKENS + 40
    cpu, gpu = (official_rope_ones_half(length, dtype, dot) for dot in ("cpu", "gpu"))
    return int((cpu != gpu).sum())


def main() -> None:
    torch.set_num_threads(1)
    result = {"cpu_half_flags": cpu_half_flags(), "torch": torch.__version__}
    for dtype in HALF_DTYPES:
        counts = fastv_last_row(dtype)
        result[dtype_name(dtype)] = {
            "fastv_last_row": {"min": min(counts), "max": max(counts)},
            "rope_logits": rope_logits(dtype),
        }
        print(
            f"{dtype_name(dtype)}: FastV last-row probabilities differing per prompt {min(counts)} to "
            f"{max(counts)} of 18,432; RoPE logits differing {result[dtype_name(dtype)]['rope_logits']} of 423,801"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
