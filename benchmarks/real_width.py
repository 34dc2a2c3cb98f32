"""Memory and time per question of the new families at their real 7B/8B widths, random weights, on CPU (issue 25).

    python -m benchmarks.real_width --family llava_next --decoder-layers 2 --json /tmp/next.json
    python -m benchmarks.real_width --family qwen3_vl                     # full depth, if memory allows
    python -m benchmarks.real_width --family internvl --tiny              # the builders' tiny widths (a test)

Nothing is downloaded. The family's offline builder (``build_tiny`` / ``build_*``) writes a
tiny checkpoint only for its tokenizer and image processor; the processor is then set to the
released checkpoint's image settings (pixel limits, crop size, anyres pinpoints), the config to
the released widths (``REAL``, from each checkpoint's ``config.json``, also named in the builders'
docstrings), and the stock transformers model is instantiated from that config with random
weights directly in bfloat16 (default dtype bf16 while it is built: no float32 copy exists).
``--decoder-layers K`` keeps the real widths with K decoder layers. One real COCO val2017
image (640 x 480) goes through the adapter's ``prepare`` and ``answer`` (the prefill ``run``
uses), dense and under each ``--selectors`` name at each ``--budgets`` value (a selector that cannot
run, e.g. an in-LLM schedule at a reduced depth, is recorded with its one-line reason).

Memory rule (a shared machine): before the model is allocated, its weights (counted on the meta
device) plus ``ACTIVATION_ALLOWANCE_GIB`` plus ``HEADROOM_GIB`` must fit in ``MemAvailable``;
otherwise the run is refused in one line that names a smaller ``--decoder-layers``.

Reported per question: visual tokens, ``answer()`` wall time and its vision / selection / prefill
parts, the milliseconds spent inside the decoder layers (forward hooks on them, observation only),
the analytic FLOPs of the cost columns, and the process's peak RSS (VmHWM). With K below the real
depth L the full-depth figures are extrapolated linearly, since every decoder layer of these
models has the same shape and (without a KV cache for a yes/no answer) holds no state:

    time_L  = time_K  + (L - K) * (decoder-layer ms / K)
    flops_L = flops_K + (L - K) * (flops_llm_K / K)      (flops_llm includes the LM head at one position)
    rss_L   = rss_K   + (L - K) * (bytes of one decoder layer's bf16 weights)

exact for dense and input-level selectors (every layer sees the same tokens); in-LLM selectors
(FastV) scale their schedule with the depth, so their reduced-depth figures are not extrapolated.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

from benchmarks.gpu import set_fields
from benchmarks.selectors import read_memory_kib
from prune_audit.errors import PruneAuditError
from prune_audit.pruners import get_selector, list_selectors

REPOSITORY = Path(__file__).resolve().parents[1]
IMAGE = REPOSITORY.parent / "shared" / "data" / "coco" / "tiny_coco_val2017" / "val2017" / "000000017627.jpg"
WORDS = ["is", "there", "a", "cat", "dog", "car", "person", "in", "the", "image"]
QUESTION = "is there a cat in the image ?"
ACTIVATION_ALLOWANCE_GIB = 2.0
HEADROOM_GIB = 4.0
GIB = 2**30

# anyres canvases of the released checkpoints (preprocessor_config.json / config.json)
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
ONEVISION_PINPOINTS = [[384 * rows, 384 * cols] for rows in range(1, 7) for cols in range(1, 7)]

# family: title, the released checkpoint, builder image size, vision / text config fields, top-level fields,
# image-processor fields
REAL: dict[str, dict] = {
    "llava_next": {
        "title": "LLaVA-NeXT-7B",
        "checkpoint": "llava-hf/llava-v1.6-vicuna-7b-hf",
        "image_size": 336,
        "vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16},
        "text": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": 128,
            "vocab_size": 32064,
            "max_position_embeddings": 4096,
        },
        "top": {"image_grid_pinpoints": LLAVA_NEXT_PINPOINTS},
        "processor": {"image_grid_pinpoints": LLAVA_NEXT_PINPOINTS},
    },
    "qwen2_vl": {
        "title": "Qwen2-VL-7B",
        "checkpoint": "Qwen/Qwen2-VL-7B-Instruct",
        "image_size": 112,
        "vision": {"embed_dim": 1280, "depth": 32, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 3584},
        "text": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "mrope_section": [16, 24, 24],
        },
        "top": {},
        "processor": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
    },
    "qwen3_vl": {
        "title": "Qwen3-VL-8B",
        "checkpoint": "Qwen/Qwen3-VL-8B-Instruct",
        "image_size": 128,
        "vision": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "depth": 27,
            "num_heads": 16,
            "out_hidden_size": 4096,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
        "text": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 262144,
            "mrope_section": [24, 20, 20],
        },
        "top": {},
        "processor": {"min_pixels": 65536, "max_pixels": 16777216},
    },
    "internvl": {
        "title": "InternVL3-8B",
        "checkpoint": "OpenGVLab/InternVL3-8B-hf",
        "image_size": 448,
        "builder": {"patch_size": 14, "max_patches": 12},  # the released tiling: up to 12 tiles plus a thumbnail
        "vision": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16},
        "text": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151674,
            "max_position_embeddings": 32768,
        },
        "top": {},
        "processor": {},
    },
    "llava_onevision": {
        "title": "LLaVA-OneVision-7B",
        "checkpoint": "llava-hf/llava-onevision-qwen2-7b-ov-hf",
        "image_size": 384,
        "vision": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26, "num_attention_heads": 16},
        "text": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 152128,
            "max_position_embeddings": 32768,
        },
        "top": {"image_grid_pinpoints": ONEVISION_PINPOINTS, "vision_aspect_ratio": "anyres_max_9"},
        "processor": {"image_grid_pinpoints": ONEVISION_PINPOINTS},
    },
}


def real_checkpoint(family: str, folder: Path, tiny: bool) -> Path:
    """The family's tiny offline checkpoint with the released image-processor settings (``tiny``: the builder's
    own small image size)."""
    from transformers import AutoImageProcessor

    from prune_audit.models.families import adapter_for

    spec = REAL[family]
    sizes = {} if tiny else {"image_size": spec["image_size"], **spec.get("builder", {})}
    source = adapter_for(family, family).build_tiny(folder, words=WORDS, **sizes)
    if not tiny and spec["processor"]:
        processor = AutoImageProcessor.from_pretrained(source, backend="pil")
        for name, value in spec["processor"].items():
            setattr(processor, name, value)
        if "max_pixels" in spec["processor"]:  # the Qwen processors resize by ``size``, not the two attributes
            processor.size = {
                "shortest_edge": spec["processor"]["min_pixels"],
                "longest_edge": spec["processor"]["max_pixels"],
            }
        processor.save_pretrained(source)
    return source


def real_config(family: str, source: Path, decoder_layers: int | None, tiny: bool):
    """The checkpoint's config at the released widths (``tiny``: the builder's) with ``decoder_layers`` layers."""
    from transformers import AutoConfig

    spec, config = REAL[family], AutoConfig.from_pretrained(source)
    text = dict(spec["text"]) if not tiny else {}
    if decoder_layers is not None:
        text["num_hidden_layers"] = decoder_layers
    if not tiny:
        set_fields(config.vision_config, spec["vision"])
        set_fields(config, spec["top"])
    set_fields(config.text_config, text)
    return config


def count_parameters(model_class, config) -> int:
    """Parameters of ``model_class(config)``, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config).parameters())


def check_memory(planned_bytes: int, layers: int) -> float:
    """MemAvailable in GiB; refuses in one line when ``planned_bytes`` plus the headroom does not fit."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024 / GIB
            break
    needed = planned_bytes / GIB + ACTIVATION_ALLOWANCE_GIB + HEADROOM_GIB
    if needed > available:
        raise PruneAuditError(
            f"{layers} decoder layers need {needed:.1f} GiB (weights {planned_bytes / GIB:.1f} + activations "
            f"{ACTIVATION_ALLOWANCE_GIB} + headroom {HEADROOM_GIB}) but only {available:.1f} GiB are available; "
            "pass a smaller --decoder-layers"
        )
    return available


def instantiate_bf16(model_class, config):
    """``model_class(config)`` randomly initialised with every parameter allocated in bfloat16 (seed 0)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    try:
        return model_class(config).eval()
    finally:
        torch.set_default_dtype(previous)


class LayerClock:
    """Milliseconds spent inside the decoder ``layers`` (forward pre/post hooks; the forward is unchanged)."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.ms, self._start = 0.0, 0.0
        self.handles = [
            hook
            for layer in layers
            for hook in (
                layer.register_forward_pre_hook(lambda *_: self._begin()),
                layer.register_forward_hook(lambda *_: self._end()),
            )
        ]

    def _begin(self) -> None:
        self._start = time.perf_counter()

    def _end(self) -> None:
        self.ms += (time.perf_counter() - self._start) * 1000


def measure(vlm, prepared, name: str, budget: int | None, clock: LayerClock) -> dict:
    """One question under selector ``name`` (``dense``: none) at ``budget``: wall time, parts, FLOPs, peak RSS."""
    selector = None if name == "dense" else get_selector(name)
    clock.ms = 0.0
    start = time.perf_counter()
    with torch.no_grad():
        [answer] = vlm.answer([prepared], selector, budget, generator=torch.Generator().manual_seed(0))
    wall_ms = (time.perf_counter() - start) * 1000
    cost = answer.cost
    return {
        "selector": name,
        "budget": budget,
        "visual_tokens": prepared.num_visual,
        "kept_tokens": len(answer.kept),
        "ms": wall_ms,
        **{f"{part}_ms": ms for part, ms in answer.latency_parts.items()},
        "decoder_layer_ms": clock.ms,
        "gflops": cost.flops / 1e9,
        "gflops_llm": cost.flops_llm / 1e9,
        "gflops_dense": cost.flops_dense / 1e9,
        "peak_rss_gib": read_memory_kib()["VmHWM"] * 1024 / GIB,
    }


def extrapolate(row: dict, measured_layers: int, real_layers: int, layer_bytes: int, in_llm: bool) -> dict:
    """The full-depth figures of a reduced-depth ``row`` (the module docstring's formulas); {} when not linear."""
    if measured_layers == real_layers or in_llm:
        return {}
    extra = real_layers - measured_layers
    return {
        "ms_full_depth": row["ms"] + extra * row["decoder_layer_ms"] / measured_layers,
        "gflops_full_depth": row["gflops"] + extra * row["gflops_llm"] / measured_layers,
        "peak_rss_gib_full_depth": row["peak_rss_gib"] + extra * layer_bytes / GIB,
    }


def run(
    family: str,
    decoder_layers: int | None,
    selectors: list[str],
    budgets: list[int],
    threads: int,
    tiny: bool,
    image: Path,
) -> dict:
    """Build ``family`` at the released widths (``tiny``: the builder's) and answer one question on ``image``,
    dense and under each selector at each budget; the result as written by ``--json``."""
    from prune_audit.models.families import adapter_for

    torch.set_num_threads(threads)
    adapter = adapter_for(family, family)
    model_class = adapter.transformers_class()
    with tempfile.TemporaryDirectory() as folder:
        source = real_checkpoint(family, Path(folder) / family, tiny)
        config = real_config(family, source, decoder_layers, tiny)
        layers = config.text_config.num_hidden_layers
        real_layers = REAL[family]["text"]["num_hidden_layers"] if not tiny else layers
        parameters = count_parameters(model_class, config)
        layer_parameters = count_parameters(model_class, real_config(family, source, layers + 1, tiny)) - parameters
        full_parameters = parameters + (real_layers - layers) * layer_parameters
        available = check_memory(2 * parameters, layers)
        start = time.perf_counter()
        model = instantiate_bf16(model_class, config)
        build_s = time.perf_counter() - start
        vlm = adapter.from_model(model, str(source), prompt_template=None, system_prompt=None, clip_text=None)
        start = time.perf_counter()
        prepared = vlm.prepare(Image.open(image), QUESTION)
        prepare_ms = (time.perf_counter() - start) * 1000
        clock = LayerClock(vlm.loop.stack.layers)
        rows = []
        runs = [("dense", None)] + [(name, budget) for name in selectors for budget in budgets]
        for name, budget in runs:
            try:
                row = measure(vlm, prepared, name, budget, clock)
            except PruneAuditError as error:  # e.g. an in-LLM schedule that does not fit a reduced depth
                row = {"selector": name, "budget": budget, "refused": str(error)}
            else:
                in_llm = name != "dense" and get_selector(name).stage != "input"
                row.update(extrapolate(row, layers, real_layers, 2 * layer_parameters, in_llm))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open("/proc/loadavg") as handle:
        load = handle.read().split()[:3]
    return {
        "family": family,
        "title": REAL[family]["title"],
        "checkpoint": REAL[family]["checkpoint"],
        "tiny": tiny,
        "decoder_layers": layers,
        "real_decoder_layers": real_layers,
        "threads": threads,
        "image": image.name,
        "image_size": list(Image.open(image).size),
        "parameters": parameters,
        "weights_gib": 2 * parameters / GIB,
        "weights_gib_full_depth": 2 * full_parameters / GIB,
        "decoder_layer_gib": 2 * layer_parameters / GIB,
        "mem_available_gib": available,
        "build_s": build_s,
        "prepare_ms": prepare_ms,
        "load_average": load,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """One family's result as a markdown table: measured at ``decoder_layers``, and extrapolated to the real depth."""
    layers, real = result["decoder_layers"], result["real_decoder_layers"]
    header = (
        f"| selector | budget | visual tokens kept | s per question at {layers} layers (vision / selection / "
        f"prefill) | decoder layers s | GFLOPs | peak RSS GiB |"
    )
    if layers != real:
        header += f" extrapolated to {real} layers: s per question | GFLOPs | peak RSS GiB |"
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for row in result["rows"]:
        budget = "-" if row["budget"] is None else str(row["budget"])
        if "refused" in row:
            lines.append(f"| {row['selector']} | {budget} | refused: {row['refused']} |")
            continue
        line = (
            f"| {row['selector']} | {budget} | {row['kept_tokens']} of {row['visual_tokens']} | "
            f"{row['ms'] / 1000:.1f} ({row['vision_ms'] / 1000:.1f} / {row['selection_ms'] / 1000:.2f} / "
            f"{row['prefill_ms'] / 1000:.1f}) | {row['decoder_layer_ms'] / 1000:.1f} | {row['gflops']:,.0f} | "
            f"{row['peak_rss_gib']:.2f} |"
        )
        if "ms_full_depth" in row:
            line += (
                f" {row['ms_full_depth'] / 1000:.1f} | {row['gflops_full_depth']:,.0f} | "
                f"{row['peak_rss_gib_full_depth']:.2f} |"
            )
        elif layers != real:
            line += " not linear (in-LLM schedule) | | |"
        lines.append(line)
    return "\n".join(lines)


def positive_integer(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(REAL))
    parser.add_argument(
        "--decoder-layers",
        type=positive_integer,
        default=None,
        help="decoder layers at the real widths (default: the real depth)",
    )
    parser.add_argument("--selectors", nargs="*", default=["divprune"])
    parser.add_argument("--budgets", nargs="+", type=positive_integer, default=[64, 128])
    parser.add_argument("--threads", type=positive_integer, default=2)
    parser.add_argument("--tiny", action="store_true", help="the builder's tiny widths (a fast test of the script)")
    parser.add_argument("--image", type=Path, default=IMAGE)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.selectors) - set(list_selectors()))
    if unknown:
        parser.error(f"unknown selector(s) {', '.join(unknown)}; registered: {', '.join(list_selectors())}")
    real_layers = REAL[args.family]["text"]["num_hidden_layers"]
    if args.decoder_layers is not None and not args.tiny and args.decoder_layers > real_layers:
        parser.error(
            f"--decoder-layers {args.decoder_layers} exceeds {REAL[args.family]['title']}'s "
            f"{real_layers}; pass 1..{real_layers}"
        )
    if not args.image.is_file():
        parser.error(f"image {args.image} not found; pass --image PATH (a COCO val2017 image)")
    return args


def main(argv: list[str] | None = None, report: Callable[[str], None] = print) -> dict:
    """Run one family; ``report`` gets its markdown table, then a summary line."""
    args = parse_arguments(argv)
    try:
        result = run(
            args.family, args.decoder_layers, args.selectors, args.budgets, args.threads, args.tiny, args.image
        )
    except PruneAuditError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    report(markdown(result))
    report(
        f"{result['title']}: {result['decoder_layers']} of {result['real_decoder_layers']} decoder layers, "
        f"{result['weights_gib']:.2f} GiB bf16 weights ({result['weights_gib_full_depth']:.2f} at full depth), "
        f"threads {result['threads']}, load {' '.join(result['load_average'])}"
    )
    return result


if __name__ == "__main__":
    main()
