"""Prompts (issue 40 item 1): the task owns its instruction, the family/template owns the conversation, composed once.

The expected strings below are re-derived, as literals, from the official evaluations' construction:

* LLaVA-1.5 (``--prompt-template vicuna_v1``; ``scripts/v1_5/eval/{gqa,pope,sqa}.sh`` pass ``--conv-mode
  vicuna_v1``), haotian-liu/LLaVA at commit c121f0432da27facab705978f83c4ada465e46fd:
  ``llava/eval/model_vqa_loader.py`` reads the question file's ``text`` unchanged, prepends ``"<image>\n"``
  (``mm_use_im_start_end`` is false for LLaVA-1.5) and fills ``conv_templates["vicuna_v1"]``
  (``llava/conversation.py`` ``conv_vicuna_v1``: system "A chat between a curious user ... to the user's
  questions." -- not ``conv_llava_v1``'s "curious human" --, roles USER / ASSISTANT, separator style TWO with
  ``sep=" "``: system, sep, "USER: " + message, sep, "ASSISTANT:"), giving
  ``"{system} USER: <image>\n{text} ASSISTANT:"``. LLaVA's question files already carry the short-answer
  instruction for GQA (``llava_gqa_testdev_balanced.jsonl`` in ../shared/data/llava_eval: ``"Is it overcast?\n
  Answer the question using a single word or phrase."``) and POPE (``llava_pope_test.jsonl``). ScienceQA:
  ``llava/eval/model_vqa_science.py`` with ``sqa.sh``'s ``--single-pred-prompt`` strips ``<image>`` from the human
  value, prepends ``"<image>\n"`` and appends ``"\nAnswer with the option's letter from the given choices
  directly."``.
* llava-hf and the other families under lmms-eval (EvolvingLMMs-Lab/lmms-eval, commit
  75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3): the task's ``doc_to_text`` is ``pre_prompt + question + post_prompt``
  with the ``default`` kwargs: ``lmms_eval/tasks/pope/pope.yaml`` and ``gqa/gqa.yaml`` post_prompt
  ``"\\nAnswer the question using a single word or phrase."``; ``scienceqa/scienceqa_img.yaml`` post_prompt
  ``"\\nAnswer with the option's letter from the given choices directly."`` after ``sqa_doc_to_text``'s
  ``"Context: {hint}\\n{question}\\n{A. choice lines}"``. ``lmms_eval/models/simple/llava_hf.py`` puts
  ``"<image>\\n"`` before the text of a single user message and applies the checkpoint's chat template
  (llava-1.5-7b-hf: ``"USER: <image>\\n{text} ASSISTANT:"``); ``models/simple/qwen2_5_vl.py`` sends one user
  message of the image then the text through the processor's chat template (the default system message "You are a
  helpful assistant."); InternVL's chat puts ``<img><IMG_CONTEXT>...</img>`` and a newline before the text under
  its system message; LLaVA-OneVision's llava-hf template puts ``<image>\\n`` before the text.
* Captions (CHAIR): the caption task asks "Describe this image in detail." (LLaVA's detailed-description
  instruction, as CHAIR evaluations of LVLMs ask it), alone: lmms-eval's ``coco_cap`` one-sentence caption prompt
  belongs to another benchmark.
"""

from __future__ import annotations

import json

import pytest
from tiny_models import WORDS
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.data.captions import CaptionQuestion
from prune_audit.data.gqa import GqaQuestion
from prune_audit.data.pope import PopeQuestion
from prune_audit.data.scienceqa import ScienceQaQuestion
from prune_audit.errors import PruneAuditError
from prune_audit.models import family_names, load_vlm
from prune_audit.models.families import adapter_for
from prune_audit.records.manifest import MANIFEST_FILE, read_manifest, run_id_of
from prune_audit.tasks import get_task
from prune_audit.tasks.caption import CaptionTaskQuestion
from prune_audit.tasks.gqa import GqaTaskQuestion
from prune_audit.tasks.prompts import INSTRUCTIONS, compose_prompt
from prune_audit.tasks.scienceqa import ScienceQaTaskQuestion

SHORT = "Answer the question using a single word or phrase."
LETTER = "Answer with the option's letter from the given choices directly."
VICUNA = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user's questions."
)
INTERNVL_SYSTEM = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)

# the task's question as each kind of question file gives it -> the user text the official evaluation asks
POPE_OFFICIAL = PopeQuestion(1, "random", "COCO_val2014_000000000001.jpg", "Is there a dog in the image?", "yes", "dog")
POPE_LLAVA = PopeQuestion(
    2,
    "adversarial",
    "COCO_val2014_000000000001.jpg",
    "Is there a dog in the image?\nAnswer the question using a single word or phrase.",
    "no",
    "dog",
    "adversarial",
)
GQA_LLAVA = GqaTaskQuestion(
    GqaQuestion(
        "201307251",
        "n161313.jpg",
        "Is it overcast?\nAnswer the question using a single word or phrase.",
        "Is it overcast?",
    ),
    201307251,
)
GQA_JSON = GqaTaskQuestion(GqaQuestion("201307251", "n161313.jpg", "Is it overcast?", "Is it overcast?"), 201307251)
SQA = ScienceQaTaskQuestion(
    ScienceQaQuestion(
        "5",
        "5/image.png",
        "Context: A food web.\nWhich eats grass?\nA. fox\nB. rabbit",
        "Which eats grass?",
        "A food web.",
        ("fox", "rabbit"),
        "B",
    ),
    5,
)
CAPTION = CaptionTaskQuestion(CaptionQuestion(42, "COCO_val2014_000000000042.jpg", ("dog",), "0" * 64))
CASES = {  # name: (task, question, the user text as the official evaluation composes it)
    "pope-official-file": (
        "pope",
        POPE_OFFICIAL,
        "Is there a dog in the image?\nAnswer the question using a single word or phrase.",
    ),
    "pope-llava-file": (
        "pope",
        POPE_LLAVA,
        "Is there a dog in the image?\nAnswer the question using a single word or phrase.",
    ),
    "gqa-llava-file": ("gqa", GQA_LLAVA, "Is it overcast?\nAnswer the question using a single word or phrase."),
    "gqa-json": ("gqa", GQA_JSON, "Is it overcast?\nAnswer the question using a single word or phrase."),
    "scienceqa": (
        "scienceqa",
        SQA,
        "Context: A food web.\nWhich eats grass?\nA. fox\nB. rabbit\n"
        "Answer with the option's letter from the given choices directly.",
    ),
    "caption": ("caption", CAPTION, "Describe this image in detail."),
}

# (family, template) -> the conversation around the user text {}, one image placeholder (module docstring)
QWEN = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
)
WRAPPERS = {
    ("llava", "vicuna_v1"): VICUNA + " USER: <image>\n{} ASSISTANT:",
    ("llava", "llava_hf"): "USER: <image>\n{} ASSISTANT:",
    ("llava_next", "vicuna_v1"): VICUNA + " USER: <image>\n{} ASSISTANT:",
    ("llava_next", "llava_hf"): "USER: <image>\n{} ASSISTANT:",
    ("qwen2_vl", "qwen2_vl"): QWEN,
    ("qwen2_5_vl", "qwen2_5_vl"): QWEN,
    ("qwen3_vl", "qwen3_vl"): QWEN,
    ("internvl", "internvl_chatml"): (
        "<|im_start|>system\n" + INTERNVL_SYSTEM + "<|im_end|>\n<|im_start|>user\n"
        "<img><IMG_CONTEXT></img>\n{}<|im_end|>\n<|im_start|>assistant\n"
    ),
    ("llava_onevision", "onevision_chatml"): (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>\n{}<|im_end|>\n<|im_start|>assistant\n"
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str], object]:
    """Every (family, template) the project supports, on a tiny offline checkpoint per family."""
    loaded = {}
    for family in family_names():
        path = adapter_for(family, "test").build_tiny(
            tmp_path_factory.mktemp(family) / "model", words=list(WORDS), text_layers=1
        )
        for template in adapter_for(family, "test").prompt_templates:
            loaded[(family, template)] = load_vlm(path, device="cpu", prompt_template=template)
    return loaded


def full_prompt(vlm, task_name: str, question) -> str:
    return vlm.prompt(get_task(task_name).prompt_text(question))


def test_every_family_and_template_is_pinned(models):
    assert set(models) == set(WRAPPERS)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pair", WRAPPERS, ids="-".join)
def test_full_prompt_is_the_official_construction(models, pair, case):
    task_name, question, user_text = CASES[case]
    assert full_prompt(models[pair], task_name, question) == WRAPPERS[pair].format(user_text)


def test_llava_vicuna_v1_gqa_prompt_in_full(models):
    """The issue's case: LLaVA's GQA line under vicuna_v1 gets the instruction once (it was appended again)."""
    assert full_prompt(models[("llava", "vicuna_v1")], "gqa", GQA_LLAVA) == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: <image>\nIs it overcast?\nAnswer the question "
        "using a single word or phrase. ASSISTANT:"
    )
    assert full_prompt(models[("llava", "vicuna_v1")], "caption", CAPTION) == (
        f"{VICUNA} USER: <image>\nDescribe this image in detail. ASSISTANT:"
    )
    assert full_prompt(models[("llava", "vicuna_v1")], "scienceqa", SQA).endswith(f"B. rabbit\n{LETTER} ASSISTANT:")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pair", WRAPPERS, ids="-".join)
def test_no_instruction_twice_nor_after_another(models, pair, case):
    """Property: in every full prompt each instruction appears at most once, and only the task's own does."""
    task_name, question, _ = CASES[case]
    task = get_task(task_name)
    prompt = full_prompt(models[pair], task_name, question)
    for instruction in INSTRUCTIONS:
        assert prompt.count(instruction) == (instruction == task.instruction), instruction


@pytest.mark.parametrize(
    "text",
    [
        "Is there a cat in the image?",
        "Is there a cat in the image?\n" + SHORT,
        "Is there a cat in the image?\n" + SHORT + "\n",
        "",
    ],
)
@pytest.mark.parametrize("instruction", INSTRUCTIONS)
def test_composition_is_idempotent(text, instruction):
    """Composing an already composed text changes nothing (the instruction is never added twice)."""
    if SHORT in text and instruction != SHORT:
        return  # a contradicting text: refused, below
    once = compose_prompt(text, instruction, "q")
    assert compose_prompt(once, instruction, "q") == once and once.count(instruction) == 1


@pytest.mark.parametrize(
    ("task_name", "question", "carried"),
    [
        (
            "scienceqa",
            ScienceQaTaskQuestion(
                ScienceQaQuestion(
                    "5", "5/image.png", f"Which?\nA. fox\nB. rabbit\n{SHORT}", "Which?", None, ("fox", "rabbit"), "B"
                ),
                5,
            ),
            SHORT,
        ),
        ("gqa", GqaTaskQuestion(GqaQuestion("7", "n1.jpg", f"Is it red?\n{LETTER}", "Is it red?"), 7), LETTER),
        ("caption", CaptionTaskQuestion(CaptionQuestion(1, "a.jpg", (), "0" * 64)), None),
    ],
)
def test_an_instruction_after_a_contradicting_one_is_refused(task_name, question, carried):
    """A question file that already asks another kind of answer is refused in one line rather than contradicted."""
    task = get_task(task_name)
    if carried is None:  # the caption task's own question never carries one
        assert task.prompt_text(question) == "Describe this image in detail."
        return
    with pytest.raises(PruneAuditError) as refused:
        task.prompt_text(question)
    message = str(refused.value)
    assert "\n" not in message and carried in message and task.instruction in message
    assert "pass the task's own question files" in message


def test_manifest_records_the_first_prompt_and_run_prints_the_template(workspace, tmp_path):
    """The manifest's prompt holds the template and the first question's full prompt; run names its template."""
    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--out",
        str(out),
        "--limit",
        "2",
        "--prompt-template",
        "vicuna_v1",
        "--quiet",
    ]
    for path in workspace["pope"]:
        args += ["--pope", str(path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "prompt template: vicuna_v1" in result.output and "Traceback" not in result.output
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    first = next(json.loads(line) for line in workspace["pope"][0].read_text().splitlines())
    assert manifest["prompt"]["template"] == "vicuna_v1"
    assert manifest["prompt"]["first"] == f"{VICUNA} USER: <image>\n{first['text']}\n{SHORT} ASSISTANT:"


def test_a_manifest_without_the_first_prompt_still_reads(workspace, tmp_path):
    """Runs of earlier versions have no prompt.first: their manifests stay valid."""
    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--out",
        str(out),
        "--limit",
        "1",
        "--quiet",
        "--pope",
        str(workspace["pope"][0]),
    ]
    assert CliRunner().invoke(app, args).exit_code == 0
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    del manifest["prompt"]["first"]
    manifest["run_id"] = run_id_of(manifest)  # as an earlier version wrote it
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert read_manifest(out)["prompt"] == {"template": "llava_hf", "system": None}


def test_run_refuses_a_question_file_asking_another_kind_of_answer(workspace, tmp_path):
    """A POPE file whose questions already ask for an option letter: one error line, nothing written."""
    from cli_checks import refused

    rows = [json.loads(line) for line in workspace["pope"][0].read_text().splitlines()[:2]]
    pope = tmp_path / "coco_pope_random.json"
    pope.write_text("".join(json.dumps({**row, "text": f"{row['text']}\n{LETTER}"}) + "\n" for row in rows))
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "run",
            "--model",
            str(workspace["model"]),
            "--images",
            str(workspace["images"]),
            "--pope",
            str(pope),
            "--out",
            str(out),
            "--quiet",
        ],
    )
    refused(result, "contradicts", SHORT, "pass the task's own question files")
    assert not out.exists()


@pytest.mark.parametrize("demo", ["demo", "demo-qwen", "demo-tasks", "demo-qwen-tasks"])
def test_the_demos_declare_their_trainers_bare_pope_question(demo):
    """The bundled demos were trained on POPE questions with and without instructions, and their cards' figures
    ask them bare: each declares that beside its weights; a released checkpoint declares nothing."""
    from prune_audit.demo import DEMO_MODEL_DIR
    from prune_audit.models.task_instructions import DEMO_TASK_INSTRUCTIONS, checkpoint_task_instructions

    assert checkpoint_task_instructions(DEMO_MODEL_DIR.parent / demo) == DEMO_TASK_INSTRUCTIONS == {"pope": ""}
    assert get_task("pope").prompt_text(POPE_OFFICIAL, DEMO_TASK_INSTRUCTIONS) == POPE_OFFICIAL.text
    assert get_task("pope").prompt_text(POPE_OFFICIAL) == f"{POPE_OFFICIAL.text}\n{SHORT}"


def test_a_checkpoints_declared_instruction_is_the_one_a_run_asks(workspace, tmp_path):
    """A checkpoint's task_instructions.json replaces the task's instruction for the tasks it names; the manifest's
    first prompt shows it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(workspace["model"], model)
    (model / "task_instructions.json").write_text(json.dumps({"pope": "Answer yes or no."}))
    out = tmp_path / "run"
    args = [
        "run",
        "--model",
        str(model),
        "--images",
        str(workspace["images"]),
        "--out",
        str(out),
        "--limit",
        "1",
        "--quiet",
        "--pope",
        str(workspace["pope"][0]),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    first = next(json.loads(line) for line in workspace["pope"][0].read_text().splitlines())
    assert json.loads((out / MANIFEST_FILE).read_text())["prompt"]["first"] == (
        f"USER: <image>\n{first['text']}\nAnswer yes or no. ASSISTANT:"
    )


@pytest.mark.parametrize("content", ["[1, 2]", '{"pope": 3}', "not json"])
def test_a_malformed_declaration_is_refused_in_one_line(workspace, tmp_path, content):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(workspace["model"], model)
    (model / "task_instructions.json").write_text(content)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "run",
            "--model",
            str(model),
            "--images",
            str(workspace["images"]),
            "--out",
            str(out),
            "--limit",
            "1",
            "--quiet",
            "--pope",
            str(workspace["pope"][0]),
        ],
    )
    assert result.exit_code == 2 and "task_instructions.json" in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()
