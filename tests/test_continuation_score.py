"""Scoring a given answer under pruning (the ``Continuation`` answer mode, ``PrunedModel.score``): teacher forcing
through the pruned KV cache, checked against the stock Hugging Face forward (dense) and against greedy decoding
(pruned: a continuation equal to the greedy answer gets the greedy answer's probabilities and ``is_greedy``)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import stock_inputs

from prune_audit.errors import PruneAuditError


@pytest.fixture(scope="module")
def tiny(workspace):
    from prune_audit import load

    return load(str(workspace["model"]), device="cpu", threads=1)


def stock_continuation(vlm, prepared, continuation_ids: list[int]) -> tuple[float, bool]:
    """Log-probability and greedy flag of ``continuation_ids`` after the prompt, from one stock forward over the
    prompt and the continuation (the official teacher-forced definition; no pruning loop involved)."""
    inputs = stock_inputs(vlm, prepared)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([continuation_ids])], dim=1)
    with torch.no_grad():
        logits = vlm.model(**inputs).logits[0].double()
    start = prepared.input_ids.numel() - 1  # the logits at position i predict token i + 1
    predicting = logits[start : start + len(continuation_ids)]
    targets = torch.tensor(continuation_ids)
    log_prob = torch.log_softmax(predicting, dim=-1).gather(1, targets[:, None]).sum().item()
    return log_prob, bool((predicting.argmax(dim=-1) == targets).all())


def test_dense_score_equals_the_stock_forward(tiny, workspace):
    from prune_audit import pruned
    from prune_audit.data.images import open_rgb
    from prune_audit.models.answers import continuation_token_ids

    images = sorted(workspace["images"].glob("*.png"))[:2]
    questions = ["Is there a cat in the image?", "Is there a dog?"]
    answers = [" a cat in the image", "there"]
    with pruned(tiny, "none") as model:
        results = model.score(images, questions, answers, batch_size=2)
    for image, question, answer, result in zip(images, questions, answers, results):
        ids = continuation_token_ids(tiny.tokenizer, answer)
        assert len(ids) == len(result.token_probs) > 0
        log_prob, greedy = stock_continuation(tiny, tiny.prepare(open_rgb(image), question), ids)
        assert result.log_probability == pytest.approx(log_prob, abs=1e-4)
        assert result.is_greedy == greedy
        assert result.confidence == pytest.approx(math.exp(result.log_probability))
        assert result.text == answer


@pytest.mark.parametrize("selector, budget", [("divprune", 6), ("fastv", 6)])
def test_pruned_score_of_the_greedy_answer_is_its_generation(tiny, workspace, selector, budget):
    from prune_audit import pruned

    images = sorted(workspace["images"].glob("*.png"))[:3]
    question = "Is there a cat in the image?"
    with pruned(tiny, selector, budget) as model:
        generated = model.generate(images, [question] * 3, max_new_tokens=4)
        scored = model.score(images, [question] * 3, [g.text for g in generated], batch_size=2)
        off = model.score(images[0], question, generated[0].text + " the")
    # decoding then encoding may split a generated word differently; compare where the tokens round trip
    round_trips = [(g, s) for g, s in zip(generated, scored) if len(g.token_probs) == len(s.token_probs)]
    assert round_trips and all(g.kept_stages == s.kept_stages for g, s in zip(generated, scored))
    for generation, score in round_trips:  # rel: float32 logits from batches of other shapes
        assert score.token_probs == pytest.approx(generation.token_probs, rel=1e-6)
        assert score.confidence == pytest.approx(generation.sequence_probability, rel=1e-6)
        assert score.is_greedy == bool(generation.text)
    assert off.token_probs[: len(scored[0].token_probs)] == pytest.approx(scored[0].token_probs, rel=1e-6)
    assert off.log_probability < scored[0].log_probability or not scored[0].is_greedy


def test_empty_answer_scores_one(tiny, workspace):
    from prune_audit import pruned

    image = sorted(workspace["images"].glob("*.png"))[0]
    with pruned(tiny, "none") as model:
        result = model.score(image, "Is there a cat?", "  ")
    assert (result.log_probability, result.is_greedy, result.confidence) == (0.0, True, 1.0)


@pytest.mark.parametrize("answers, message", [(["a", "b"], "2 answers for 1 questions"), ([3], "list of strings")])
def test_bad_answers_are_one_line(tiny, workspace, answers, message):
    from prune_audit import pruned

    image = sorted(workspace["images"].glob("*.png"))[0]
    with pruned(tiny, "none") as model, pytest.raises(PruneAuditError, match=message):
        model.score(image, "Is there a cat?", answers)
