"""What the hardware allows: the prefill's arithmetic as bare matmuls, dense vs pruned (issue 18).

    python -m benchmarks.gemm_floor --text-hidden 2048 --text-layers 16 --text-heads 16 --budgets 64 128

``benchmarks.prefill`` compares a pruned prefill's time with its ideal FLOP ratio. On a CPU a
matmul over fewer rows runs at a lower rate (the weights are streamed once per call whatever the
row count, and the blocking has less to work with), so even a prefill with no overhead at all
lands above the FLOP ratio. This benchmark measures that floor: the same decoder arithmetic as
plain ``torch.nn.functional.linear`` calls on random weights of the benchmark model's shapes
(Q, K, V, O projections, gated MLP, causal SDPA) plus the unchanged vision tower as one matmul
chain, for the dense sequence and for one where every decoder layer holds ``budget`` visual
tokens (an input-level selector's shape). ``floor`` = pruned / dense time of that chain;
``ideal`` = the FLOP ratio of ``benchmarks.prefill``; ``floor / ideal`` is how far above the FLOP
ratio a pruned prefill without any selector or bookkeeping cost would land. Times are the minimum
of ``--repeats`` runs of thread CPU time at one thread. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# benchmarks/selectors.py would shadow the standard library's selectors module (torch imports it)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.prefill import SIZES, decoder_layer_flops, text_sizes, vision_flops  # noqa: E402

NUM_VISUAL = 576  # CLIP 336 px / 14 px patches, as in benchmarks.prefill
TEXT_TOKENS = 40  # about the benchmark prompt's text tokens


class DecoderWeights:
    """Random float32 weights of one Llama decoder layer: projections (out, in) as ``F.linear`` takes them."""

    def __init__(self, hidden: int, intermediate: int, generator: torch.Generator):
        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=generator) * cols**-0.5

        self.qkv = weight(3 * hidden, hidden)
        self.out = weight(hidden, hidden)
        self.gate_up = weight(2 * intermediate, hidden)
        self.down = weight(hidden, intermediate)


def decoder_layer(x: torch.Tensor, w: DecoderWeights, heads: int, causal: bool = True) -> torch.Tensor:
    """One layer's matmuls on ``x`` (T, H): fused QKV, SDPA over ``heads``, O, gated MLP. Returns (T, H)."""
    tokens, hidden = x.shape
    q, k, v = F.linear(x, w.qkv).view(tokens, 3, heads, hidden // heads).permute(1, 2, 0, 3)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(0, 1).reshape(tokens, hidden)
    x = x + F.linear(attended, w.out)
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.down)


def chain_ms(
    layers: list[DecoderWeights],
    vision: list[DecoderWeights],
    visual_per_layer: list[int],
    sizes: dict[str, int],
    repeats: int,
) -> float:
    """Minimum thread-CPU milliseconds of the vision chain plus the decoder chain at the given visual counts."""
    best = float("inf")
    vision_x = torch.randn(NUM_VISUAL + 1, sizes["vision_hidden_size"])
    for _ in range(repeats + 1):  # the first run warms up
        start = time.thread_time()
        for weights in vision:
            decoder_layer(vision_x, weights, sizes["vision_heads"], causal=False)
        x = torch.randn(TEXT_TOKENS + visual_per_layer[0], sizes["text_hidden_size"])
        for weights, visual in zip(layers, visual_per_layer):
            x = decoder_layer(x[-(TEXT_TOKENS + visual) :], weights, sizes["text_heads"])
        best = min(best, (time.thread_time() - start) * 1000)
    return best


def ideal_ratio(visual_per_layer: list[int], dense_per_layer: list[int], sizes: dict[str, int]) -> float:
    """FLOP ratio pruned / dense as ``benchmarks.prefill`` counts it (vision tower included, LM head left out)."""
    vision = vision_flops(
        NUM_VISUAL + 1, sizes["vision_hidden_size"], sizes["vision_intermediate_size"], sizes["vision_layers"] - 1
    )

    def total(per_layer: list[int]) -> float:
        return vision + sum(
            decoder_layer_flops(TEXT_TOKENS + v, sizes["text_hidden_size"], sizes["text_intermediate_size"])
            for v in per_layer
        )

    return total(visual_per_layer) / total(dense_per_layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="*", type=int, default=[64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--text-hidden", type=int, default=SIZES["text_hidden_size"], help="decoder width")
    parser.add_argument("--text-layers", type=int, default=SIZES["text_layers"], help="decoder layers")
    parser.add_argument("--text-heads", type=int, default=SIZES["text_heads"], help="decoder attention heads")
    args = parser.parse_args()
    if min(args.text_hidden, args.text_layers, args.text_heads, args.repeats) < 1 or args.text_hidden % args.text_heads:
        parser.error("sizes and --repeats must be positive, the width divisible by the heads")
    if any(not 0 < budget <= NUM_VISUAL for budget in args.budgets):
        parser.error(f"--budgets must lie in 1..{NUM_VISUAL}")
    torch.set_num_threads(1)
    sizes = text_sizes(args.text_hidden, args.text_layers, args.text_heads)
    generator = torch.Generator().manual_seed(0)
    layers = [
        DecoderWeights(sizes["text_hidden_size"], sizes["text_intermediate_size"], generator)
        for _ in range(sizes["text_layers"])
    ]
    vision = [
        DecoderWeights(sizes["vision_hidden_size"], sizes["vision_intermediate_size"] * 2 // 3, generator)
        for _ in range(sizes["vision_layers"] - 1)
    ]
    dense_layers = [NUM_VISUAL] * sizes["text_layers"]
    dense_ms = chain_ms(layers, vision, dense_layers, sizes, args.repeats)
    print(
        f"bare matmul chain, {NUM_VISUAL} visual + {TEXT_TOKENS} text tokens, decoder {args.text_hidden} x "
        f"{args.text_layers}, 1 thread, thread CPU time, minimum of {args.repeats}: dense {dense_ms:.1f} ms"
    )
    print("| budget | pruned ms | floor | ideal | floor / ideal |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    for budget in args.budgets:
        per_layer = [budget] * sizes["text_layers"]
        ms = chain_ms(layers, vision, per_layer, sizes, args.repeats)
        floor, ideal = ms / dense_ms, ideal_ratio(per_layer, dense_layers, sizes)
        rows.append({"budget": budget, "ms": ms, "floor": floor, "ideal": ideal, "floor_over_ideal": floor / ideal})
        print(f"| {budget} | {ms:.1f} | {floor:.3f} | {ideal:.3f} | {floor / ideal:.2f} |")
    print(json.dumps({"dense_ms": dense_ms, "sizes": sizes, "rows": rows}))


if __name__ == "__main__":
    main()
