"""Issue 26: the analytic FLOPs equal ``FlopCounterMode``'s count over the same forward, to the FLOP.

Every model part (vision tower to the feature layer, projector, the CLS and decoder probes, CLIP
text tower, decoder layers at their realised lengths, LM head) is checked against the counter for
every selector each model supports, on both bundled demos and tiny LLaVA / Qwen2.5-VL checkpoints.
The counter counts matrix products and convolutions only when attention runs eagerly (CPU SDPA
kernels are not registered with it), so the models are switched to eager attention here. The
selector's own arithmetic is counted apart (a counter around ``select`` / ``prune`` / ``merge``);
it must match where the selector's class says its formula is exact (``Selector.flops_exact``).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import WORDS, random_image
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.compute.flops import flop_equivalent_tokens, language_prefill
from prune_audit.demo.assets import DEMO_MODELS
from prune_audit.demo.evaluate import load_demo
from prune_audit.errors import PruneAuditError
from prune_audit.pruners.composed import selector_parts
from prune_audit.pruners.registry import get_selector, list_selectors, selector_class

SELECTOR_METHODS = ("select", "prune", "merge")


def eager(vlm):
    """``vlm`` with eager attention in every tower, so the counter sees the attention products."""
    vlm.model.set_attn_implementation("eager")
    if getattr(vlm, "clip", None) is not None:
        vlm.clip[0].set_attn_implementation("eager")
    return vlm


def counted(vlm, item, selector, budget):
    """(FLOPs counted outside the selector's methods, FLOPs counted inside them, the answer).

    ToMe's tower rerun (``location=tower``) runs inside ``select`` but is the model's vision work: its count,
    less the merge steps between its layers (the selector's own arithmetic), moves to the first number.
    """
    inside, tower, merges = [], [], []
    # the tower rerun: on the image, or on each crop of an anyres image (LLaVA-NeXT's crop_merging_tower)
    rerun_name = "_crop_merging_tower" if hasattr(vlm, "_crop_merging_tower") else "_merging_tower"
    if "merging_tower" in getattr(selector, "requires", ()):
        rerun = getattr(vlm, rerun_name)

        def counting_tower(*inputs):
            *pixels, merge = inputs

            def counting_merge(*args):
                with FlopCounterMode(display=False) as counter:
                    result = merge(*args)
                merges.append(counter.get_total_flops())
                return result

            for trait in ("proportional", "metric", "after_mlp", "reads_next_layer", "next_layer_cls"):
                if hasattr(merge, trait):  # the step's traits the tower reads (MustDrop's: after the MLP, next row)
                    setattr(counting_merge, trait, getattr(merge, trait))
            with FlopCounterMode(display=False) as counter:
                result = rerun(*pixels, counting_merge)
            tower.append(counter.get_total_flops())
            return result

        setattr(vlm, rerun_name, counting_tower)
    # an in-LLM selector's own tower stage (MustDrop's) is a part whose methods count as the selector's too
    for part in {id(part): part for part in selector_parts(selector) if part is not None}.values():
        for name in SELECTOR_METHODS:
            if callable(getattr(part, name, None)):  # not an option of that name (FastVID's merge=false)
                method = getattr(part, name)

                def counting(*args, _method=method, **kwargs):
                    with FlopCounterMode(display=False) as counter:
                        result = _method(*args, **kwargs)
                    inside.append(counter.get_total_flops())
                    return result

                object.__setattr__(part, name, counting)
    with FlopCounterMode(display=False) as counter:
        answer = vlm.answer([item], selector, budget, generator=torch.Generator().manual_seed(0))[0]
    if tower:
        delattr(vlm, rerun_name)
    tower_pass = sum(tower) - sum(merges)
    return counter.get_total_flops() - sum(inside) + tower_pass, sum(inside) - tower_pass, answer


def resized_for(vlm, image, question, selector, budget):
    """The prompt as a run prepares it (a selector acting on the image: the resized image, whose smaller tower and
    prefill are counted); None where the processor's fixed resolution (the Qwen demo's min = max pixels) gives
    no smaller image fewer tokens, which is refused in one line."""
    try:
        return vlm.prepare_for(image, question, selector, budget)
    except PruneAuditError as error:
        assert selector.resizes_image and "the processor gives at least" in str(error)
        return None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The two bundled demos and tiny LLaVA (with a CLIP text tower) / Qwen2.5-VL checkpoints, eager."""
    from prune_audit.models import load_vlm
    from prune_audit.models.build import build_clip
    from prune_audit.models.llava import LlavaModel
    from prune_audit.models.qwen import QwenModel

    root = tmp_path_factory.mktemp("compute")
    llava = LlavaModel.build_tiny(root / "llava", words=WORDS, text_layers=4, text_kv_heads=2, seed=3)
    clip = build_clip(root / "clip", words=WORDS, vision_hidden_size=64)
    # dynamic resolution down to one token, so an image-resizing selector meets any budget (the demo's is fixed)
    qwen = QwenModel.build_tiny(root / "qwen", words=WORDS, text_layers=4, seed=3, min_pixels=28 * 28)
    return {
        "demo": eager(load_demo(DEMO_MODELS["demo"])),
        "demo-qwen": eager(load_demo(DEMO_MODELS["demo-qwen"])),
        "tiny-llava": eager(load_vlm(llava, device="cpu", clip_text=clip)),
        "tiny-qwen": eager(load_vlm(qwen, device="cpu")),
    }


CASES = [("demo", (96, 96)), ("demo-qwen", (96, 96)), ("demo-qwen", (120, 72)), ("tiny-llava", (130, 100)),
         ("tiny-qwen", (150, 100))]  # fmt: skip


@pytest.mark.parametrize(("model", "size"), CASES)
def test_analytic_flops_equal_the_counted_flops_for_every_selector(models, model, size):
    vlm, image, question = models[model], random_image(1, size), "is there a red dog in the image?"
    item = vlm.prepare(image, question)
    budget = max(2, item.num_visual // 4)
    selectors = [None] + [get_selector(name) for name in vlm.supported_selectors()]
    if "merging_tower" in vlm.input_signals:  # LLaVA: the options that read other tower signals
        selectors += [get_selector("tome", location="tower"), get_selector("prumerge", signal_layer="feature")]
        # MustDrop merging every window after tower layer 0 (its 0.8 threshold merges none of random weights')
        selectors += [get_selector("mustdrop", merge_thr=-1.0), get_selector("mustdrop", vision="off")]
    for selector in selectors:
        name = None if selector is None else selector.name
        tower = "merging_tower" in getattr(selector, "requires", ())  # one tower layer at least halves the patches
        used = None if name is None else max(budget, item.num_visual // 2 + 3) if tower else budget
        # a selector acting on the image (Qwen) runs on the resized image: its smaller tower and prefill are counted
        run_item = resized_for(vlm, image, question, selector, used)
        if run_item is None:
            continue
        outside, inside, answer = counted(vlm, run_item, selector, used)
        cost = answer.cost
        assert outside == cost.flops_vision + cost.flops_llm, (model, selector)
        assert cost.flops == cost.flops_vision + cost.flops_selector + cost.flops_llm
        if name is None:
            assert cost.flops == cost.flops_dense and inside == 0
            full = item.input_ids.numel()
            assert cost.flop_equivalent_tokens == pytest.approx(full, rel=1e-9)
        elif selector_class(name).flops_exact:
            assert inside == cost.flops_selector, (model, selector)
        assert cost.flops < cost.flops_dense or name is None  # a tower selector's run stands in for the stock one


def test_every_builtin_selector_has_a_formula():
    """Each built-in class states its own arithmetic: a ``flops`` formula or, with none, that zero is exact."""
    for name in list_selectors():
        own = vars(selector_class(name))
        assert "flops_exact" in own, name
        assert "flops" in own or own["flops_exact"], name


def test_kv_bytes_and_decode_flops_match_the_cache_and_the_counted_decode_step(models):
    vlm = models["demo"]
    item = vlm.prepare(random_image(2, (96, 96)), "is there a cat in the image?")
    selector, budget = get_selector("fastv"), 20
    answer = vlm.answer([item], selector, budget)[0]
    prefill, _ = vlm.prefill([item], selector, budget, use_cache=True)
    cache = prefill.decode.cache
    stored = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                 for layer in cache.layers)  # fmt: skip
    assert answer.cost.kv_bytes == stored
    with FlopCounterMode(display=False) as counter:
        vlm.loop.decode_step(prefill.decode, torch.tensor([3]))
    assert counter.get_total_flops() == answer.cost.flops_decode_token


def test_flop_equivalent_tokens_inverts_the_dense_language_prefill(models):
    language = models["demo"].shape.language
    for tokens in (1, 37, 160):
        assert flop_equivalent_tokens(
            language, language_prefill(language, [tokens] * language.layers)
        ) == pytest.approx(tokens, rel=1e-9)


def test_signal_sources_name_exactly_the_probes_that_ran(models, monkeypatch):
    """``signal_sources`` against spies on every probe: the outermost probe calls of each answer (a probe
    another one calls, such as the keys inside attention rows or the rows inside coverage's demand, is
    part of the outer one)."""
    import prune_audit.models.llava as llava
    import prune_audit.models.prefill_assembly as assembly
    from prune_audit.compute.cost import SIGNAL_SOURCES
    from prune_audit.models.probe import DecoderProbe

    ran, depth = [], [0]

    def spy(function, probe):
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                ran.append(probe)
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    monkeypatch.setattr(llava, "clip_cls_row", spy(llava.clip_cls_row, "vision_cls_row"))
    monkeypatch.setattr(llava, "clip_logits", spy(llava.clip_logits, "vision_layer_attention"))
    monkeypatch.setattr(assembly, "text_demand", spy(assembly.text_demand, "decoder_demand_rows"))
    for method, probe in (("probabilities", "decoder_attention_rows"), ("values", "decoder_attention_rows"),
                          ("keys", "decoder_key_norms"), ("rope_ones_logits", "decoder_rope_logits")):  # fmt: skip
        monkeypatch.setattr(DecoderProbe, method, spy(getattr(DecoderProbe, method), probe))
    seen = set()
    for model in ("demo", "demo-qwen", "tiny-llava"):
        vlm = models[model]
        for method, probe in (("_merging_tower", "vision_merging_tower"), ("text_relevance", "clip_text_tower"),
                              ("_layer_attention", "vision_layer_attention"),
                              ("_last_layer_cls_row", "vision_last_cls_row")):  # fmt: skip
            if hasattr(vlm, method):
                monkeypatch.setattr(vlm, method, spy(getattr(vlm, method), probe), raising=False)
        image, question = random_image(4, (96, 96)), "is there a red dog in the image?"
        item = vlm.prepare(image, question)
        selectors = [None] + [get_selector(name) for name in vlm.supported_selectors()]
        if "merging_tower" in vlm.input_signals:
            selectors += [get_selector("tome", location="tower"), get_selector("prumerge", signal_layer="feature")]
            # MustDrop merging every window after tower layer 0 (its 0.8 threshold merges none of random weights')
            selectors += [get_selector("mustdrop", merge_thr=-1.0), get_selector("mustdrop", vision="off")]
        for selector in selectors:
            ran.clear()
            budget = None if selector is None else item.num_visual // 2 + 3
            run_item = resized_for(vlm, image, question, selector, budget)
            if run_item is None:
                continue
            [answer] = vlm.answer([run_item], selector, budget, generator=torch.Generator().manual_seed(0))
            expected = tuple(name for name in SIGNAL_SOURCES if name in ran)
            assert answer.cost.signal_sources == expected, (model, selector)
            seen.update(expected)
    # every value is exercised; a clip's step attention in tests/models/test_qwen2_5_vl_video.py
    assert seen == set(SIGNAL_SOURCES) - {"vision_step_attention"}
