"""The Python pruning API (``from prune_audit import load, pruned``) and the docs snippet of it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prune_audit.errors import PruneAuditError

PYTHON_API_DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def readme_pruning_snippet() -> str:
    """The ```python block after ``<!-- python-api-pruning -->`` in docs/python-api.md."""
    text = PYTHON_API_DOC.read_text()
    start = text.index("```python\n", text.index("<!-- python-api-pruning -->")) + len("```python\n")
    return text[start : text.index("\n```", start)]


@pytest.fixture(scope="module")
def tiny(workspace):
    from prune_audit import load

    return load(str(workspace["model"]), device="cpu", threads=1)


def test_import_stays_light():
    code = "import sys, prune_audit; print('torch' in sys.modules, callable(prune_audit.load))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_readme_snippet_runs_on_the_demo():
    environment = {**os.environ, "PYTHONPATH": str(PYTHON_API_DOC.parents[1])}
    completed = subprocess.run(
        [sys.executable, "-c", readme_pruning_snippet()], env=environment, capture_output=True, text=True, check=False
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    first, second = completed.stdout.strip().splitlines()
    assert re.search(r" \[\d+\] \[\d+\] [\d.e-]+$", first)  # FastV: one stage, its layer and kept count
    assert second.startswith("[(")


def test_answers_match_the_run_path(tiny, workspace):
    """The API's yes/no answers are those of VisionLanguageModel.answer on the same prepared prompts."""
    from prune_audit import pruned
    from prune_audit.data.images import open_rgb
    from prune_audit.pruners.registry import get_selector

    images = sorted(workspace["images"].glob("*.png"))[:3]
    questions = ["Is there a circle in the image?"] * 3
    with pruned(tiny, "divprune", budget=6) as model:
        results = model.answer(images, questions, batch_size=2)
    direct = tiny.answer([tiny.prepare(open_rgb(p), q) for p, q in zip(images, questions)], get_selector("divprune"), 6)
    assert [r.p_yes for r in results] == pytest.approx([a.p_yes for a in direct], abs=1e-6)
    assert [r.kept_stages for r in results] == [a.kept_stages for a in direct]
    assert all(len(r.kept_stages[0]) == 6 and r.stage_layers == [0] and r.grid == (4, 4) for r in results)
    assert all(r.cost.flops < r.cost.flops_dense for r in results)


def test_generate_choose_and_in_llm_provenance(tiny, workspace):
    from prune_audit import pruned

    image = min(workspace["images"].glob("*.png"))
    with pruned(tiny, "pdrop", budget=8) as model:
        [out] = model.generate(image, ["Is there a circle in the image?"], max_new_tokens=3)
        assert out.sequence_probability == out.confidence and len(out.token_probs) <= 3
        assert len(out.kept_stages) == len(out.stage_layers) >= 1
    with pruned(tiny) as dense:
        choice = dense.choose(image, "Is there a circle in the image?", letters=("a",))
        assert choice.text == "a" and choice.kept_stages == [] and choice.confidence == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p, vlm: p(vlm, "fastv"), "needs --budget"),
        (lambda p, vlm: p(vlm, "nope", budget=4), "unknown selector 'nope'"),
        (lambda p, vlm: p(vlm, "fastv", budget=4, nope=1), "unknown option 'nope'"),
        (lambda p, vlm: p(vlm, "fastv", budget=4.5), "budget must be a whole number"),
        (lambda p, vlm: p(vlm, "fastv", budget=4, layer=-3), "layer must be an integer"),
        (lambda p, vlm: p(vlm, "none", budget=4), "needs --selector"),
        (lambda p, vlm: p(object(), "none"), "takes a model from prune_audit.load()"),
    ],
)
def test_bad_options_fail_in_one_line(tiny, call, message):
    from prune_audit import pruned

    with pytest.raises(PruneAuditError, match=message) as raised:
        with call(pruned, tiny):
            pass
    assert "\n" not in str(raised.value)


def test_bad_calls_fail_in_one_line(tiny, workspace):
    from prune_audit import pruned

    image = min(workspace["images"].glob("*.png"))
    with pruned(tiny, "random", budget=4) as model:
        for call, message in [
            (lambda: model.answer([image, image], ["q"]), "2 images for 1 questions"),
            (lambda: model.answer(image, []), "non-empty"),
            (lambda: model.answer("missing.png", "q"), "image not found"),
            (lambda: model.generate(image, "q", max_new_tokens=0), "from 1 to 1,000,000"),
            (lambda: model.generate(image, "q", max_new_tokens=2**64), "from 1 to 1,000,000"),
            (lambda: model.choose(image, "q", letters=("a", "a")), "repeat"),
            (lambda: model.answer(image, "q", batch_size=True), "batch_size must be a whole number"),
            (lambda: model.answer(image, "q", batch_size=0), "batch_size must be at least 1"),
        ]:
            with pytest.raises(PruneAuditError, match=message):
                call()
    with pytest.raises(PruneAuditError, match="after its `with pruned"):
        model.answer(image, "q")


def test_load_refuses_bad_arguments_before_reading_weights():
    from prune_audit import load

    for kwargs, message in [
        ({"device": "gpu"}, "--device must be"),
        ({"threads": 10_000}, "more than the"),
        ({"model": "/no/such/folder"}, "not found"),
        ({"threads": 1.5}, "whole number"),
    ]:
        with pytest.raises(PruneAuditError, match=message):
            load(**kwargs)
