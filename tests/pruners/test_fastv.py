"""FastV: the top-k of the last prompt row's head-mean attention by hand, in the model dtype, and from the layer before
the cut on a tiny LLaVA; its average-matched default schedule."""

from __future__ import annotations

import pytest
import torch
from rederivation import TOKENS, tiny_llava, tiny_llava_paths, top_k_sorted  # noqa: F401 (tiny_llava, tiny_llava_paths: fixtures)
from selector_cases import signals

from prune_audit.pruners import LayerSignals, Stage, get_selector


def test_fastv_is_top_k_of_last_row_head_mean_probability():
    probs = torch.rand(2, 3, 6, generator=torch.Generator().manual_seed(0))
    probs[:, -1] = torch.tensor([[0.10, 0.40, 0.05, 0.20, 0.30, 0.00], [0.30, 0.20, 0.05, 0.20, 0.00, 0.10]])
    # head means: .20 .30 .05 .20 .15 .05 -> top 3: 1, then 0 and 3 tied at .20
    kept = get_selector("fastv").prune(Stage(2, 3), signals(6, text_probs=probs), {})
    assert kept.tolist() == [0, 1, 3]
    probs[:, :-1] = 1.0  # other rows do not matter
    assert get_selector("fastv").prune(Stage(2, 3), signals(6, text_probs=probs), {}).tolist() == [0, 1, 3]


# --- score_dtype=model and signal_layer on a tiny LLaVA ---------------------------------------------------------------


def test_model_dtype_scores_rank_the_rounded_probabilities():
    """FastV in fp16 as the reference: fp16 probabilities, head mean, fp16 score; ties to the lower index."""
    generator = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(32, 8, TOKENS + 60, generator=generator) * 0.02, dim=-1)[..., :TOKENS]
    signals = LayerSignals(
        alive=torch.arange(TOKENS), grid=(24, 24), layer=2, num_layers=32, text_probs=probs, model_dtype=torch.float16
    )
    reference = probs.half().float()[:, -1].mean(dim=0).half().float()
    expected = torch.sort(torch.sort(-reference, stable=True).indices[:128]).values
    kept = get_selector("fastv", score_dtype="model").prune(Stage(2, 128), signals, {})
    assert torch.equal(kept, expected)
    assert not torch.equal(kept, get_selector("fastv").prune(Stage(2, 128), signals, {}))


@pytest.mark.parametrize("signal_layer", ["previous", "current"])
def test_fastv_ranks_with_the_attention_of_the_layer_before_the_cut(tiny_llava, signal_layer):
    vlm, items, outputs = tiny_llava
    selector = get_selector("fastv", budget_rule="paper", signal_layer=signal_layer)
    for item, output in zip(items, outputs):
        prefill, _ = vlm.prefill([item], selector, 20)
        (layer,) = prefill.stage_layers[0]
        source = layer - 1 if signal_layer == "previous" else layer  # nothing is pruned before the cut
        start, end = item.image_span
        scores = output.attentions[source][0, :, -1, start:end].mean(dim=0)
        assert prefill.kept_stages[0][0] == top_k_sorted(scores, 20)


# --- the default schedule ---------------------------------------------------------------------------------------------


def test_fastv_default_is_average_matched():
    kept = [get_selector("fastv").schedule(32, 576, budget)[0].keep for budget in (192, 128, 64)]
    assert kept == [166, 98, 30]  # (32 B - 2 * 576) / 30, spec section 14
