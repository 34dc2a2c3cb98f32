"""Issue 47, item 2, and issue 44, item 8 (``--max-new-tokens 2**64``): prompts and generations are checked
against the model's positions, and the generation limit against its domain, before anything runs.

CLI refusals are checked as everywhere (``cli_checks.refused``): exit 2, one ``error:`` line naming the cause and
the fix, no traceback, nothing written. The tiny models have 512 positions, as the demos.
"""

from __future__ import annotations

import json

import pytest
from cli_checks import refused
from tiny_models import WORDS, random_image
from typer.testing import CliRunner

from prune_audit import load, pruned
from prune_audit.answer_modes import MAX_NEW_TOKENS, Greedy
from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError
from prune_audit.models.context import max_positions, prompt_positions
from prune_audit.models.qwen import QwenModel

runner = CliRunner()
LONG_QUESTION = "Is there a " + "red " * 700 + "circle in the image?"


@pytest.fixture(scope="module")
def tiny(workspace):
    return load(str(workspace["model"]), device="cpu", threads=1)


def pope_file(workspace, folder, texts: list[str]):
    """A POPE question file asking ``texts`` about the workspace's first image."""
    image = min(workspace["images"].glob("*.png")).name
    path = folder / "questions.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question_id": i + 1, "image": image, "text": text, "label": "no"}) + "\n"
            for i, text in enumerate(texts)
        )
    )
    return path


def test_a_prompt_past_the_model_positions_is_refused_before_anything_is_written(workspace, tmp_path):
    """The long question last of three: the whole list is checked before the first answer."""
    questions = pope_file(workspace, tmp_path, ["Is there a circle in the image?"] * 2 + [LONG_QUESTION])
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "run",
            "--model",
            str(workspace["model"]),
            "--pope",
            str(questions),
            "--images",
            str(workspace["images"]),
            "--out",
            str(out),
            "--batch-size",
            "1",
        ],
    )
    line = refused(
        result, "question", "/3 needs", "positions", "has 512 (max_position_embeddings)", "shorten the question"
    )
    assert "--max-new-tokens" not in line  # POPE answers by its first token
    assert not out.exists()


def test_a_generation_limit_past_the_model_positions_is_refused(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", "--task", "gqa", "--max-new-tokens", "3000", "--limit", "2", "--out", str(out)])
    refused(result, "question gqa/", "+ 3000 new tokens", "has 512 (max_position_embeddings)", "lower --max-new-tokens")
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "study"])
@pytest.mark.parametrize("value", [str(2**64), str(MAX_NEW_TOKENS + 1), "0", "-3"])
def test_the_generation_limit_is_bounded(command, value, tmp_path):
    out = tmp_path / "out"
    extra = ["--selectors", "none"] if command == "study" else []
    result = runner.invoke(app, [command, "--task", "gqa", f"--max-new-tokens={value}", *extra, "--out", str(out)])
    refused(result, f"--max-new-tokens must be a whole number from 1 to {MAX_NEW_TOKENS:,}, got {value}")
    assert not out.exists()


def test_the_python_api_checks_the_same_limits(tiny, workspace):
    image = min(workspace["images"].glob("*.png"))
    with pruned(tiny, "none") as model:
        for call, message in [
            (lambda: model.answer(image, LONG_QUESTION), r"question 'Is there a red red .*\.\.\.' needs \d+ positions"),
            (lambda: model.generate(image, "Is there a circle?", max_new_tokens=600), r"\+ 600 new tokens.* has 512"),
            (lambda: model.generate(image, "q", max_new_tokens=2**64), "from 1 to 1,000,000"),
            (lambda: model.score(image, "Is there a circle?", "red " * 600), r"\+ 600 answer tokens"),
        ]:
            with pytest.raises(PruneAuditError, match=message):
                call()


def test_a_default_generation_limit_stops_at_the_last_position(tiny, workspace):
    """A task's default limit (captions: 1024) is cut where the model's positions end instead of refused."""
    item = tiny.prepare(random_image(0), "Is there a circle in the image?")
    room = max_positions(tiny) - prompt_positions(tiny, item)
    [answer] = tiny.answer([item], mode=Greedy(1024))
    tokens = len(answer.reduced.token_probs)
    assert tokens <= room and (answer.reduced.stopped or tokens == room)


def test_qwen_counts_its_positions_not_its_tokens(tmp_path):
    """M-RoPE ids advance by the image's larger side over its visual tokens: a Qwen prompt longer than the model's
    positions in tokens still fits when its ids do, and one id more is refused."""
    vlm = load(str(QwenModel.build_tiny(tmp_path / "qwen", words=WORDS, max_position_embeddings=64)), device="cpu")
    image, words = random_image(0, (112, 112)), ["is"]
    while prompt_positions(vlm, vlm.prepare(image, " ".join(words))) < 64:
        words.append("is")
    fitting = vlm.prepare(image, " ".join(words))
    assert prompt_positions(vlm, fitting) == 64 < fitting.input_ids.numel()
    assert len(vlm.answer([fitting])) == 1
    with pytest.raises(PruneAuditError, match="needs 65 positions"):
        vlm.answer([vlm.prepare(image, " ".join([*words, "is"]))])
