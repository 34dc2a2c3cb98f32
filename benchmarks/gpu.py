"""Prefill latency, throughput and peak memory of 7B-shaped VLMs under every selector (issue 18, item 4).

    python -m benchmarks.gpu                        # on a CUDA machine: LLaVA-1.5-7B and Qwen2.5-VL-7B shapes
    python -m benchmarks.gpu --models llava --batches 1 --repeats 3
    python -m benchmarks.gpu --smoke --markdown /tmp/g.md --json /tmp/g.json   # reduced width, CPU (a test)

Nothing is downloaded: a tiny checkpoint of each family is built offline only for its
tokenizer and image processor, then the model is instantiated from the real 7B config
(sizes below) with random weights directly on the device in bfloat16. Random weights
give the same arithmetic as trained ones, so latency and memory are those of the real
models (the answers are meaningless). The LLaVA prompt holds 576 visual tokens
(336 px, 14 px patches); the Qwen processor is pinned to 672 x 672 px, so the square test
image gives 24 x 24 = 576 tokens as well.

For the dense model and every selector the model supports, at every budget and batch
size: prefill latency (``answer()``: vision tower, selection, pruned language-model
prefill, yes/no reduction) timed with the records' timer (``models.timing``: CUDA events on a
GPU, ``perf_counter`` on CPU), warm-up excluded, the median of ``--repeats`` runs; throughput = batch / latency; peak memory
``torch.cuda.max_memory_allocated`` over the timed runs, also less what was allocated
before them (weights, inputs), each with its ratio to dense (CPU: not measured); and the
selector's own time (its signals and its selection: ``select_input`` for input-level, the
per-stage signal and prune step for in-LLM selectors), from one extra run in which
those steps are synchronised and timed. Each row also breaks a question down as the records
do (docs/compute.md): the medians of the vision / selection / prefill parts of ``answer()``
(ms per question, CUDA events between parts as in the records), the analytic prefill GFLOPs and their
share of dense, and the KV-cache MiB after the prefill.

The anchors are the calibration study's H200 numbers for LLaVA-1.5-7B on POPE: dense
52.7 ms per question at batch 1; FastV, VisionZip and PDrop 4-7 ms faster; coverage
at 128 tokens 72.2 ms; 5.0x dense throughput at 64 tokens, batch 32. The study timed
whole questions, this script times the prefill of a fixed 576-token image prompt, so
ratios near 1 mean the same regime, not the same number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from prune_audit.analysis.reproduce import seed_figure
from prune_audit.errors import PruneAuditError
from prune_audit.models import base as model_base
from prune_audit.models.build import build_clip
from prune_audit.models.llava import LlavaModel
from prune_audit.models.qwen import QwenModel
from prune_audit.models.timing import timed_ms
from prune_audit.pruners import get_selector, list_selectors

WORDS = "is there a cat dog car person in the image".split()
QUESTION = "is there a cat in the image ?"

# (family, builder keyword arguments for the tiny processor checkpoint, config fields of the 7B model)
SHAPES = {
    "llava": {
        "title": "LLaVA-1.5-7B shape",
        "image": 336,
        "build": lambda folder, image: LlavaModel.build_tiny(
            folder, words=WORDS, image_size=image, patch_size=14, max_position_embeddings=4096
        ),
        "vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16},
        "text": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32064,
        },
        "clip_text": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
        },
    },
    "qwen": {
        "title": "Qwen2.5-VL-7B shape",
        "image": 672,
        "build": lambda folder, image: QwenModel.build_tiny(
            folder, words=WORDS, image_size=image, max_position_embeddings=32768
        ),
        "vision": {
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "depth": 32,
            "num_heads": 16,
            "out_hidden_size": 3584,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
        "text": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "mrope_section": [16, 24, 24],
        },
    },
}
# --smoke: the same code paths at a width a CPU runs in seconds (256 visual tokens)
SMOKE = {
    "llava": {
        "image": 224,
        "vision": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
        "text": {
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "vocab_size": 320,
        },
        "clip_text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
    },
    "qwen": {
        "image": 448,
        "vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "depth": 2,
            "num_heads": 2,
            "out_hidden_size": 64,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 320,
            "mrope_section": [2, 3, 3],
        },
    },
}
ANCHORS = {
    "dense_ms_b1": seed_figure("dense.ms_b1").expected,
    "saving_ms_b1": (4.0, 7.0),
    "coverage_128_ms_b1": 72.2,
    "speedup_64_b32": seed_figure("timing.throughput_b32").expected,
}
"""The seed's H200 figures; those `prune-audit reproduce` checks come from its table (analysis/reproduce.py)."""
SAVING_SELECTORS = ("fastv", "visionzip", "pdrop")


def set_fields(config, fields: dict) -> None:
    """Set config ``fields``; ``mrope_section`` lives in ``rope_parameters`` and ``layer_types`` follows the depth."""
    for name, value in fields.items():
        if name == "mrope_section":
            config.rope_parameters["mrope_section"] = list(value)
        else:
            setattr(config, name, value)
    if getattr(config, "layer_types", None) is not None:  # derived from the layer count at construction
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers


def instantiate(model_class, config, device: torch.device, dtype: torch.dtype):
    """``model_class(config)`` allocated and randomly initialised on ``device`` in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(previous)


def random_vlm(family: str, sizes: dict, folder: Path, device: torch.device, dtype: torch.dtype):
    """The family's adapter around a randomly initialised model of ``sizes`` built on ``device``."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    from prune_audit.models.llava import LlavaModel
    from prune_audit.models.qwen import QwenModel

    source = SHAPES[family]["build"](folder / family, sizes["image"])
    config = AutoConfig.from_pretrained(source)
    set_fields(config.vision_config, sizes["vision"])
    set_fields(config.text_config, sizes["text"])
    config.text_config.tie_word_embeddings = False
    name = f"random {SHAPES[family]['title']}"
    if family == "qwen":
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = instantiate(Qwen2_5_VLForConditionalGeneration, config, device, dtype)
        return QwenModel(
            model,
            AutoImageProcessor.from_pretrained(source, backend="pil"),
            AutoTokenizer.from_pretrained(source),
            model_id=name,
        )
    from transformers import CLIPModel, LlavaForConditionalGeneration

    model = instantiate(LlavaForConditionalGeneration, config, device, dtype)
    clip_source = build_clip(folder / "clip", words=WORDS, image_size=sizes["image"])
    clip_config = AutoConfig.from_pretrained(clip_source)
    set_fields(clip_config.text_config, sizes["clip_text"])
    set_fields(clip_config.vision_config, {"hidden_size": sizes["vision"]["hidden_size"]})
    clip = instantiate(CLIPModel, clip_config, device, dtype)
    return LlavaModel(
        model,
        AutoProcessor.from_pretrained(source, backend="pil"),
        model_id=name,
        clip=(clip, AutoTokenizer.from_pretrained(clip_source)),
    )


@contextlib.contextmanager
def selector_timer(vlm, device: torch.device) -> Iterator[list[float]]:
    """Collects the milliseconds of every input-level ``select_input`` and in-LLM stage step while active."""
    spent: list[float] = []

    def timed(method):
        def wrapper(*args, **kwargs):
            result = []
            spent.append(timed_ms(device, lambda: result.append(method(*args, **kwargs))))
            return result[0]

        return wrapper

    select_input = model_base.select_input  # the prefill calls it by this module-level name
    model_base.select_input, vlm.loop._stage_columns = timed(select_input), timed(vlm.loop._stage_columns)
    try:
        yield spent
    finally:
        model_base.select_input = select_input
        del vlm.loop._stage_columns


def measure(vlm, prepared, selector, budget, batch: int, repeats: int, device: torch.device) -> dict:
    """Median latency (ms per forward), peak memory and selector time of one configuration."""
    questions, cuda = [prepared] * batch, device.type == "cuda"

    answers = []

    def run():
        answers.append(vlm.answer(questions, selector, budget, generator=torch.Generator().manual_seed(0))[0])

    run()  # warm-up (kernels, allocator, the schedule cache)
    answers.clear()
    resident = torch.cuda.memory_allocated() / 2**20 if cuda else None  # weights and prepared inputs
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [timed_ms(device, run) for _ in range(repeats)]
    parts = {
        f"{part}_ms": statistics.median(answer.latency_parts[part] for answer in answers)
        for part in ("vision", "selection", "prefill")
    }
    cost = answers[0].cost
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    selector_ms = None
    if selector is not None:
        with selector_timer(vlm, device) as spent:
            run()
        selector_ms = sum(spent)
    ms = statistics.median(times)
    return {
        "ms": ms,
        "ms_per_question": ms / batch,
        "questions_per_s": batch * 1000 / ms,
        "peak_mib": peak,
        "extra_mib": None if peak is None else peak - resident,
        "selector_ms": selector_ms,
        **parts,
        "gflops": cost.flops / 1e9,
        "flops_relative": cost.flops / cost.flops_dense,
        "kv_mib": cost.kv_bytes / 2**20,
    }


def benchmark_family(family: str, sizes: dict, args, device, dtype) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        vlm = random_vlm(family, sizes, Path(folder), device, dtype)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8))
    prepared = vlm.prepare(image, QUESTION)
    rows = []
    supported = [name for name in args.selectors if name in vlm.supported_selectors()]
    if skipped := sorted(set(args.selectors) - set(supported)):
        print(f"{SHAPES[family]['title']}: not supported here: {', '.join(skipped)}", flush=True)
    configurations = [(None, None)] + [(name, budget) for name in supported for budget in args.budgets]
    for batch in args.batches:
        for name, budget in configurations:
            row = {
                "model": SHAPES[family]["title"],
                "selector": name or "dense",
                "budget": budget,
                "batch": batch,
                "visual_tokens": prepared.num_visual,
            }
            try:
                selector = None if name is None else get_selector(name)
                row.update(measure(vlm, prepared, selector, budget, batch, args.repeats, device))
            except PruneAuditError as error:
                row["not_run"] = str(error)
            print(json.dumps(row), flush=True)
            rows.append(row)
    del vlm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """speedup = dense latency / latency and memory = peak / dense peak, same model and batch."""
    dense = {(r["model"], r["batch"]): r for r in rows if r["selector"] == "dense" and "ms" in r}
    for row in rows:
        base = dense.get((row["model"], row["batch"]))
        if base is None or "ms" not in row:
            continue
        row["speedup"] = base["ms"] / row["ms"]
        row["saving_ms_per_question"] = base["ms_per_question"] - row["ms_per_question"]
        row["memory_ratio"] = None if row["peak_mib"] is None else row["peak_mib"] / base["peak_mib"]
        row["extra_memory_ratio"] = None if row["extra_mib"] is None else row["extra_mib"] / base["extra_mib"]


def anchor_rows(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """(quantity, study, here, here / study) for the LLaVA rows."""
    llava = {
        (r["selector"], r["budget"], r["batch"]): r
        for r in rows
        if r["model"] == SHAPES["llava"]["title"] and "ms" in r
    }
    out = []
    if (dense := llava.get(("dense", None, 1))) is not None:
        here = dense["ms_per_question"]
        out.append(("dense ms / question, batch 1", "52.7", f"{here:.1f}", f"{here / ANCHORS['dense_ms_b1']:.2f}"))
    low, high = ANCHORS["saving_ms_b1"]
    for (name, budget, batch), row in sorted(llava.items(), key=lambda item: str(item[0])):
        if name in SAVING_SELECTORS and batch == 1:
            out.append(
                (
                    f"{name}@{budget} saving vs dense, ms, batch 1",
                    f"{low:g}-{high:g}",
                    f"{row['saving_ms_per_question']:.1f}",
                    "",
                )
            )
    if (coverage := llava.get(("coverage", 128, 1))) is not None:
        here = coverage["ms_per_question"]
        out.append(
            (
                "coverage@128 ms / question, batch 1",
                "72.2",
                f"{here:.1f}",
                f"{here / ANCHORS['coverage_128_ms_b1']:.2f}",
            )
        )
    for (name, budget, batch), row in sorted(llava.items(), key=lambda item: str(item[0])):
        if budget == 64 and batch == max(b for _, _, b in llava) and name != "dense":
            out.append(
                (
                    f"{name}@64 throughput / dense, batch {batch}",
                    "5.0 (batch 32)",
                    f"{row['speedup']:.2f}",
                    f"{row['speedup'] / ANCHORS['speedup_64_b32']:.2f}",
                )
            )
    return out


def markdown(rows: list[dict], header: str) -> str:
    def number(value, digits=1):
        return "" if value is None else f"{value:.{digits}f}"

    lines = [
        header,
        "",
        "| model | selector | budget | batch | ms / forward | ms / question | questions/s | "
        "speedup | peak MiB | memory / dense | above weights MiB | above weights / dense | selector ms | "
        "vision / selection / prefill ms per question | GFLOPs | FLOPs / dense | KV MiB |",
        "|" + " --- |" * 17,
    ]
    for r in rows:
        if "not_run" in r:
            lines.append(
                f"| {r['model']} | {r['selector']} | {r['budget']} | {r['batch']} | not run: "
                f"{r['not_run']} | | | | | | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['model']} | {r['selector']} | {r['budget'] or ''} | {r['batch']} | {number(r['ms'])} | "
            f"{number(r['ms_per_question'])} | {number(r['questions_per_s'])} | "
            f"{number(r.get('speedup'), 2)} | {number(r['peak_mib'], 0)} | "
            f"{number(r.get('memory_ratio'), 3)} | {number(r['extra_mib'], 0)} | "
            f"{number(r.get('extra_memory_ratio'), 3)} | {number(r['selector_ms'])} | "
            f"{number(r['vision_ms'], 2)} / {number(r['selection_ms'], 2)} / {number(r['prefill_ms'], 2)} | "
            f"{number(r['gflops'], 2)} | {number(r['flops_relative'], 3)} | {number(r['kv_mib'])} |"
        )
    lines += [
        "",
        "Anchors (calibration study, LLaVA-1.5-7B, POPE, H200):",
        "",
        "| quantity | study | here | here / study |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in anchor_rows(rows)]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--selectors", nargs="*", default=None, help="default: every registered selector")
    parser.add_argument("--budgets", nargs="*", type=int, default=[64, 128, 192])
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="reduced width on CPU, float32, batches 1 and 2")
    parser.add_argument("--markdown", type=Path, default=Path("docs/benchmarks-gpu.md"))
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks-gpu.json"))
    args = parser.parse_args(argv)
    args.selectors = args.selectors or list_selectors()
    unknown = sorted(set(args.selectors) - set(list_selectors()))
    if unknown or min(args.budgets) < 1 or min(args.batches) < 1 or args.repeats < 1:
        parser.error(f"unknown selectors {unknown}" if unknown else "budgets, batches and repeats must be >= 1")
    if args.smoke:
        args.batches, args.repeats = [1, 2], 1
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: the full benchmark needs a GPU (use --smoke on CPU)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name = "CPU (smoke, reduced width)" if args.smoke else torch.cuda.get_device_name(device)
    rows = []
    for family in args.models:
        sizes = {**SHAPES[family], **SMOKE[family]} if args.smoke else SHAPES[family]
        rows += benchmark_family(family, sizes, args, device, dtype)
    add_ratios(rows)
    header = (
        f"Device: {name}; torch {torch.__version__}; {str(dtype).removeprefix('torch.')}; "
        f"median of {args.repeats} timed runs after one warm-up; command: python -m benchmarks.gpu"
        f"{' --smoke' if args.smoke else ''}"
    )
    for path, text in (
        (args.markdown, markdown(rows, header)),
        (args.json, json.dumps({"device": name, "rows": rows}, indent=1)),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(markdown(rows, header))


if __name__ == "__main__":
    main()
