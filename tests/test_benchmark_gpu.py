"""``benchmarks/gpu.py --smoke``: the GPU benchmark's code paths at a reduced width on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
spec = importlib.util.spec_from_file_location("benchmark_gpu", SCRIPT)
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)


def test_gpu_benchmark_smoke_writes_markdown_and_json(tmp_path):
    markdown, records = tmp_path / "gpu.md", tmp_path / "gpu.json"
    gpu.main(
        [
            "--smoke",
            "--selectors",
            "random",
            "fastv",
            "cls_attn",
            "--budgets",
            "64",
            "--markdown",
            str(markdown),
            "--json",
            str(records),
        ]
    )
    rows = json.loads(records.read_text())["rows"]
    timed = {(r["model"], r["selector"], r["batch"]) for r in rows}
    for model in ("LLaVA-1.5-7B shape", "Qwen2.5-VL-7B shape"):
        for batch in (1, 2):
            assert {(model, "dense", batch), (model, "random", batch), (model, "fastv", batch)} <= timed
    # Qwen has no CLS token: cls_attn is left out there, not failed
    assert ("Qwen2.5-VL-7B shape", "cls_attn", 1) not in timed
    for row in rows:
        assert row["ms"] > 0 and row["questions_per_s"] > 0 and row["speedup"] > 0
        assert row["visual_tokens"] == 256
        assert (row["selector_ms"] is None) == (row["selector"] == "dense")
        assert min(row["vision_ms"], row["selection_ms"], row["prefill_ms"]) >= 0 and row["gflops"] > 0
        assert row["flops_relative"] == 1.0 if row["selector"] == "dense" else row["flops_relative"] < 1.0
        assert row["kv_mib"] > 0
    text = markdown.read_text()
    assert "| dense ms / question, batch 1 | 52.7 |" in text and "fastv@64 saving vs dense" in text
