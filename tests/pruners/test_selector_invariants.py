"""Invariants every registered selector must satisfy, input-level and in-LLM alike.

Signals are built from the dataclass fields of ``InputSignals`` / ``LayerSignals``
and the shapes below, so a new selector is covered as soon as it is registered and
a new signal field fails loudly until its shape is declared here.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from selector_cases import layer_average_case

from prune_audit.pruners import (
    InputSelector,
    InputSignals,
    LayerSelector,
    LayerSignals,
    Stage,
    get_selector,
    list_selectors,
    selector_class,
)
from prune_audit.pruners.schedule import average_visual_tokens
from prune_audit.pruners.serving import TOWER_HOOK_SIGNALS
from prune_audit.pruners.signals import VIDEO_GRID as VIDEO_GRID_SIGNAL

GRID = (6, 8)
N = GRID[0] * GRID[1]
VIDEO_GRID = (3, 2, 8)
SIZES = {"N": N, "N+1": N + 1, "D": 16, "Dv": 12, "H": 4, "d": 8, "T": 6, "Lv": 3, "K": 3, "2": 2, "4": 4}
# (shape in SIZES symbols, kind): "prob" = attention probabilities, "weight" = non-negative, "bounds" = a
# (min, max) pair, "crop_index" = each token's crop (K crops of a several-crop tower), "crop_layout" = an anyres
# layout of the N tokens (a 4 x 4 base view, then a 2 x 1 canvas of 4 x 4 tiles: the K = 3 runs of token_crops)
INPUT_SHAPES = {
    "features": (("N", "D"), "normal"),
    "vision_features": (("N", "Dv"), "normal"),
    "cls_attention": (("H", "N"), "prob"),
    "cls_logits": (("H", "N+1"), "normal"),
    "vision_keys": (("H", "N+1", "d"), "normal"),
    "last_layer_cls_logits": (("H", "N+1"), "normal"),
    "last_layer_vision_keys": (("H", "N+1", "d"), "normal"),
    "cls_feature": (("Dv",), "normal"),
    "text_relevance": (("N",), "normal"),
    "model_text_relevance": (("N",), "normal"),
    "text_relevance_bounds": (("2",), "bounds"),
    "model_text_relevance_bounds": (("2",), "bounds"),
    "token_crops": (("N",), "crop_index"),
    "crop_cls_features": (("K", "Dv"), "normal"),
    "crop_cls_keys": (("H", "K", "d"), "normal"),
    "last_cls_logits": (("N",), "normal"),
    "crop_layout": (("4", "2"), "crop_layout"),
    "demand": (("N",), "weight"),
    "layer_attention": (("Lv", "N"), "prob"),
    "layer_cls_attention": (("Lv", "N"), "prob"),
    "model_layer_attention": (("Lv", "N"), "prob"),
    "model_layer_cls_attention": (("Lv", "N"), "prob"),
    "step_attention": (("N",), "weight"),
}
# "n" is the number of alive tokens at the stage
LAYER_SHAPES = {
    "text_logits": (("H", "T", "n"), "normal"),
    "text_probs": (("H", "T", "n"), "prob"),
    "visual_probs": (("H", "n", "n"), "prob"),
    "hidden_states": (("n", "D"), "normal"),
    "previous_hidden_states": (("n", "D"), "normal"),
    "text_hidden_states": (("T", "D"), "normal"),
    "normed_hidden_states": (("n", "D"), "normal"),
    "text_normed_hidden_states": (("T", "D"), "normal"),
    "key_norms": (("n",), "weight"),
    "text_key_norms": (("T",), "weight"),
    "values": (("H", "n", "d"), "normal"),
    "text_values": (("H", "T", "d"), "normal"),
    "embeddings": (("n", "D"), "normal"),
    "text_embeddings": (("T", "D"), "normal"),
    "sequence_index": (("n",), "visual_index"),
    "text_sequence_index": (("T",), "text_index"),
    "layer_cls_attention": (("Lv", "n"), "prob"),
    "model_layer_cls_attention": (("Lv", "n"), "prob"),
    "layer_attention": (("Lv", "n"), "prob"),
    "rope_ones_logits": (("T", "n"), "weight"),
}
VARIANTS = ["random", "constant", "zeros", "ties"]

INPUT_SELECTORS = [name for name in list_selectors() if selector_class(name).stage == "input"]
LLM_SELECTORS = [name for name in list_selectors() if selector_class(name).stage == "llm"]
#: in-LLM selectors whose kept counts follow from the data, not the stage (FrameFusion: similarity and cost model)
DATA_COUNTS = {"framefusion"}


def make_tensor(shape: tuple[int, ...], kind: str, variant: str, generator: torch.Generator) -> torch.Tensor:
    """One signal tensor; degenerate variants are all-equal, all-zero or full of exact ties."""
    if kind == "crop_index":  # K equal runs of tokens
        return torch.arange(shape[0]) * SIZES["K"] // shape[0]
    if kind == "crop_layout":  # base view 4 x 4, tile grid 8 x 4 from a 2 x 1 canvas, nothing unpadded
        return torch.tensor([[4, 4], [8, 4], [2, 1], [0, 0]])
    if kind == "bounds":
        return make_tensor(shape, "normal", variant, generator).sort().values
    if kind.endswith("_index"):  # prompt indices: the image at 5.., the text after it
        return torch.arange(shape[0]) + (5 if kind == "visual_index" else 5 + N)
    if variant == "constant":
        return torch.full(shape, 1.0 / shape[-1] if kind == "prob" else 1.0)
    if variant == "zeros":
        return torch.zeros(shape)
    if variant == "ties":
        return torch.randint(0, 2, shape, generator=generator).float()
    values = torch.randn(shape, generator=generator)
    if kind == "prob":
        return torch.softmax(values, dim=-1)
    return values.abs() if kind == "weight" else values


def tensor_fields(cls: type) -> list[str]:
    # merging_tower is a function of the adapter's tower (ToMe in the tower), not a tensor
    return [f.name for f in dataclasses.fields(cls) if str(f.type).startswith("Tensor") and f.name != "alive"]


def build_signals(cls, shapes, sizes, variant, seed=0, **fixed):
    generator = torch.Generator().manual_seed(seed)
    undeclared = sorted(set(tensor_fields(cls)) - set(shapes))
    assert not undeclared, f"declare the shape of the new signal field(s) {undeclared} in this test"
    tensors = {}
    for name in tensor_fields(cls):
        symbols, kind = shapes[name]
        tensors[name] = make_tensor(tuple(sizes[s] for s in symbols), kind, variant, generator)
    return cls(**fixed, **tensors)


def synthetic_tower(variant: str, seed: int):
    """A ``merging_tower`` over ``Lv`` layers of random (1 + N, Dv) states and per-layer heads of the variant:
    each layer hands ``merge`` its states and ``merge.metric`` of (H, L) CLS rows, (H, L, d) keys and values."""

    def run(merge):
        generator = torch.Generator().manual_seed(seed)
        hidden = make_tensor((N + 1, SIZES["Dv"]), "normal", variant, generator)
        size, sources = torch.ones(N + 1), [torch.zeros(0, dtype=torch.long)] + [torch.tensor([c]) for c in range(N)]
        for layer in range(SIZES["Lv"]):
            length = hidden.shape[0]
            cls_probs = make_tensor((SIZES["H"], length), "prob", variant, generator)
            keys, values = (make_tensor((SIZES["H"], length, SIZES["d"]), "normal", variant, generator) for _ in "kv")
            metric = merge.metric(cls_probs, keys, values)
            hidden, size, sources = merge(layer, SIZES["Lv"], hidden, metric, size, sources)
        return hidden, sources

    return run


def input_signals(variant: str = "random", seed: int = 0) -> InputSignals:
    # the 6 x 8 grid read as a clip of 3 temporal steps of 2 x 8 tokens too (EVS's video_grid; the others ignore it)
    signals = build_signals(InputSignals, INPUT_SHAPES, SIZES, variant, seed, grid=GRID, video_grid=VIDEO_GRID)
    signals.merging_tower = synthetic_tower(variant, seed)  # the one signal that is a function, not a tensor
    return signals


def layer_signals(alive: torch.Tensor, layer: int, variant: str = "random", seed: int = 0) -> LayerSignals:
    sizes = {**SIZES, "n": alive.numel()}
    return build_signals(
        LayerSignals, LAYER_SHAPES, sizes, variant, seed, alive=alive, grid=GRID, layer=layer, num_layers=32,
        video_grid=VIDEO_GRID,
    )  # fmt: skip


def seeded() -> torch.Generator:
    return torch.Generator().manual_seed(123)


def assert_valid_selection(selection, budget: int, fills_budget: bool = True) -> None:
    kept = selection.kept
    assert kept.dtype == torch.long
    assert torch.equal(kept, torch.unique(kept)), "kept must be unique and ascending"
    assert kept.numel() == 0 or (0 <= int(kept.min()) and int(kept.max()) < N)
    if fills_budget:
        assert selection.num_output_tokens == min(budget, N)
    else:
        assert 1 <= selection.num_output_tokens <= min(budget, N)
    if selection.sources is not None:
        (tokens,) = [t for t in (selection.vision_tokens, selection.llm_tokens) if t is not None]  # exactly one
        assert tokens.shape[0] == len(selection.sources) and torch.isfinite(tokens).all()
        carried = torch.cat(selection.sources)
        assert carried.numel() == 0 or (0 <= int(carried.min()) and int(carried.max()) < N)
        assert set(kept.tolist()) <= set(carried.tolist())


def assert_same_selection(first, second) -> None:
    assert torch.equal(first.kept, second.kept)
    assert (first.sources is None) == (second.sources is None)
    if first.sources is not None:
        assert all(torch.equal(a, b) for a, b in zip(first.sources, second.sources, strict=True))
        torch.testing.assert_close(first.vision_tokens, second.vision_tokens)
        torch.testing.assert_close(first.llm_tokens, second.llm_tokens)


def own_score(selector) -> bool:
    """Whether the selector scores tokens itself (then its scores must be finite)."""
    base = InputSelector if selector.stage == "input" else LayerSelector
    return type(selector).score is not base.score


# --- registry -------------------------------------------------------------------------------------


def test_every_selector_declares_its_metadata():
    for name in list_selectors():
        cls = selector_class(name)
        assert cls.name == name and cls.stage in ("input", "llm") and cls.summary
        assert cls.reference.paper and cls.reference.repository
        assert isinstance(cls.requires, frozenset)
        known = set(tensor_fields(InputSignals if cls.stage == "input" else LayerSignals))
        known |= {VIDEO_GRID_SIGNAL, "merging_tower"}  # a clip's (T, h, w) tuple and the tower function: no tensors
        undeclared = cls.requires - known
        assert not undeclared, f"{name} requires unknown signal(s) {undeclared}"


def test_unknown_selector_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as error:
        get_selector("no_such_selector")
    for name in list_selectors():
        assert name in str(error.value)


@pytest.mark.parametrize("name", list_selectors())
def test_unknown_option_lists_the_valid_ones(name):
    with pytest.raises(ValueError, match="no_such_option") as error:
        get_selector(name, no_such_option=1)
    for option in dataclasses.fields(selector_class(name)):
        if option.init:
            assert option.name in str(error.value)


# --- input-level selectors ------------------------------------------------------------------------


@pytest.mark.parametrize("name", INPUT_SELECTORS)
@pytest.mark.parametrize("budget", [1, 2, 7, 20, N - 1])
def test_input_selection_is_valid_and_has_the_budget(name, budget):
    selector = get_selector(name)
    assert_valid_selection(selector.select(input_signals(), budget, seeded()), budget, selector.fills_budget)


@pytest.mark.parametrize("name", INPUT_SELECTORS)
@pytest.mark.parametrize("budget", [N, N + 5])
def test_budget_of_all_tokens_keeps_everything(name, budget):
    selection = get_selector(name).select(input_signals(), budget, seeded())
    assert selection.kept.tolist() == list(range(N))
    assert selection.num_output_tokens == N


@pytest.mark.parametrize("name", INPUT_SELECTORS)
@pytest.mark.parametrize("budget", [0, -3, 2.5])
def test_invalid_budget_raises(name, budget):
    with pytest.raises(ValueError, match="budget"):
        get_selector(name).select(input_signals(), budget, seeded())


@pytest.mark.parametrize("name", INPUT_SELECTORS)
def test_missing_input_signal_is_named(name):
    selector = get_selector(name)
    if not selector.requires:
        pytest.skip(f"{name} needs no signal")
    for missing in sorted(selector.requires):
        signals = dataclasses.replace(input_signals(), **{missing: None})
        with pytest.raises(ValueError, match=missing):
            selector.select(signals, 10, seeded())


@pytest.mark.parametrize("name", INPUT_SELECTORS)
def test_same_seed_gives_the_same_selection(name):
    first = get_selector(name).select(input_signals(), 10, seeded())
    second = get_selector(name).select(input_signals(), 10, seeded())
    assert_same_selection(first, second)


@pytest.mark.parametrize("name", INPUT_SELECTORS)
@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_degenerate_input_signals(name, variant):
    selector = get_selector(name)
    signals = input_signals(variant)
    assert_valid_selection(selector.select(signals, 10, seeded()), 10, selector.fills_budget)
    if own_score(selector):
        assert torch.isfinite(selector.score(signals, seeded())).all()


@pytest.mark.parametrize("name", INPUT_SELECTORS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_in_float32(name, dtype):
    signals = input_signals()
    halves = {f: getattr(signals, f).to(dtype) for f in tensor_fields(InputSignals)}
    low = get_selector(name).select(dataclasses.replace(signals, **halves), 10, seeded())
    upcast = {f: t.float() for f, t in halves.items()}
    reference = get_selector(name).select(dataclasses.replace(signals, **upcast), 10, seeded())
    assert_valid_selection(low, 10, get_selector(name).fills_budget)
    assert_same_selection(low, reference)


# --- in-LLM selectors -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", LLM_SELECTORS)
@pytest.mark.parametrize("budget", [64, 128, 192])
def test_schedule_realises_the_layer_average(name, budget):
    selector, budget = layer_average_case(name, budget, 32, 576)
    stages = selector.schedule(32, 576, budget)
    layers = [s.layer for s in stages]
    keeps = [s.keep for s in stages]
    assert layers == sorted(set(layers)) and all(0 <= layer < 32 for layer in layers)
    assert keeps == sorted(keeps, reverse=True) and all(0 <= keep <= 576 for keep in keeps)
    assert abs(average_visual_tokens(stages, 32, 576) - budget) <= 0.02 * budget


def run_stages(name: str, variant: str) -> list[torch.Tensor]:
    """Prune a 6 x 8 grid through the selector's schedule; returns the alive set after each stage."""
    selector, budget = layer_average_case(name, 12, 32, N)
    stages = selector.schedule(32, N, budget)
    alive, state, history = torch.arange(N), {}, []
    for index, stage in enumerate(stages):
        signals = layer_signals(alive, stage.layer, variant, seed=index)
        if own_score(selector):
            assert torch.isfinite(selector.score(stage, signals, copy.deepcopy(state))).all()
        kept = selector.prune(stage, signals, state)
        assert kept.dtype == torch.long
        assert torch.equal(kept, torch.unique(kept)), "positions must be unique and ascending"
        assert kept.numel() == min(stage.keep, alive.numel()) or name in DATA_COUNTS
        assert kept.numel() == 0 or (0 <= int(kept.min()) and int(kept.max()) < alive.numel())
        alive = alive[kept]
        history.append(alive)
    return history


@pytest.mark.parametrize("name", LLM_SELECTORS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_prune_keeps_the_stage_count(name, variant):
    history = run_stages(name, variant)
    assert history, f"{name} has no stage for a budget of 12 of {N} tokens"


@pytest.mark.parametrize("name", LLM_SELECTORS)
def test_prune_is_deterministic(name):
    first, second = run_stages(name, "random"), run_stages(name, "random")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("name", LLM_SELECTORS)
def test_missing_layer_signal_is_named(name):
    selector = get_selector(name)
    stage = Stage(layer=2, keep=10)
    for missing in sorted(selector.requires - TOWER_HOOK_SIGNALS):  # the tower hook: its own tower stage's (below)
        absent = {name: None for name in (missing, selector.substitutes.get(missing, missing))}  # and its substitute
        signals = dataclasses.replace(layer_signals(torch.arange(N), 2), **absent)
        with pytest.raises(ValueError, match=missing):
            selector.prune(stage, signals, {})
    tower = selector.tower_stage()
    if tower is not None:  # MustDrop's vision stage reads the tower hook
        signals = input_signals()
        signals.merging_tower = None
        with pytest.raises(ValueError, match="merging_tower"):
            tower.select(signals, 10)
