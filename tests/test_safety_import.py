"""Issues 44 (items 5-7) and 47 (items 3-5): ``import`` is as strict as ``run``'s own records.

A kept-set file is an audit input: each line passes the rules a run's records pass (``records.consistency``,
one definition), and the header becomes a manifest every reader accepts. Every case is refused the data safety
way (``refused``: exit 2, one ``error:`` line naming cause and fix, no traceback) and writes nothing. The lines
come from small runs on the tiny LLaVA (16 visual tokens, 4 decoder layers), exported and edited.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_data_safety import invoke, refused
from test_interchange import PROVENANCE, assert_same_records, generating_args, question_args
from test_run_cli import base_args
from test_task_parquet import pope_parquet

from prune_audit.errors import PruneAuditError
from prune_audit.records.consistency import record_problem
from prune_audit.records.store import RecordStore

LIMIT = 4


@pytest.fixture(scope="module")
def exported(workspace, tmp_path_factory) -> dict[str, Path]:
    """Runs of divprune@6 and fastv@6 (``LIMIT`` questions), each exported to JSON Lines."""
    root = tmp_path_factory.mktemp("import-safety")
    made = {"root": root}
    for name in ("divprune", "fastv"):
        run = root / f"run-{name}"
        result = invoke(*base_args(workspace, run, "--selector", name, "--budget", "6", "--limit", LIMIT, "--quiet"))
        assert result.exit_code == 0, result.output
        made[name] = run
        made[f"{name}.jsonl"] = root / f"{name}.jsonl"
        assert invoke("export", run, "--out", made[f"{name}.jsonl"]).exit_code == 0
    return made


def entries(exported, name: str) -> tuple[dict, list[dict]]:
    header, *lines = [json.loads(text) for text in exported[f"{name}.jsonl"].read_text().splitlines()]
    return header, lines


def import_edited(exported, workspace, tmp_path: Path, edit, name: str = "divprune"):
    """``import`` of the run's exported file after ``edit(header, lines)``; the output folder must stay absent."""
    header, lines = entries(exported, name)
    edit(header, lines)
    path = tmp_path / "kept.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in [header, *lines]))
    out = tmp_path / "out"
    result = invoke(
        "import", path, "--geometry", workspace["model"], *question_args(workspace), "--out", out, "--quiet"
    )
    assert not out.exists(), sorted(out.rglob("*"))
    return result


def in_first(change):
    """An edit of the first question line only."""
    return lambda header, lines: change(lines[0])


# ----- issue 44 item 5, issue 47 item 3: numbers past their columns ------------------------------------------


def test_a_cost_past_int64_is_refused_before_writing(exported, workspace, tmp_path):
    result = import_edited(exported, workspace, tmp_path, in_first(lambda line: line["cost"].update(flops=1e30)))
    refused(result, "line 2", "flops must be a whole number of at most", 'drop "cost"')


def test_a_stage_of_10_15_tokens_is_refused_before_writing(exported, workspace, tmp_path):
    edit = in_first(lambda line: line["stages"][0].update(tokens=10**15))
    result = import_edited(exported, workspace, tmp_path, edit)
    refused(result, "line 2: stage 0", "the image has 16", "at most the image's tokens")


# ----- issue 44 item 6: kept sets and headers that cannot be ------------------------------------------------


def test_more_visual_tokens_than_the_image_has_are_refused(exported, workspace, tmp_path):
    result = import_edited(exported, workspace, tmp_path, in_first(lambda line: line["stages"][0].update(tokens=5000)))
    refused(result, "line 2: stage 0", "5000 visual tokens, but the image has 16")


def test_merged_tokens_whose_cells_are_also_kept_are_refused(exported, workspace, tmp_path):
    def merge_kept(line):
        line["stages"][0]["merged"] = [[line["stages"][0]["kept"][0]]]

    result = import_edited(exported, workspace, tmp_path, in_first(merge_kept))
    refused(result, "line 2: stage 0", "both kept and merged", "reaches the model through its own token")


def test_an_input_stage_header_over_decoder_layer_kept_sets_is_refused(exported, workspace, tmp_path):
    def input_stage(header, lines):
        header["selector"]["stage"] = "input"

    result = import_edited(exported, workspace, tmp_path, input_stage, name="fastv")
    refused(result, "line 1 (header)", "selector stage 'input'", "inside the decoder", "give the stage")


@pytest.mark.parametrize(
    "budget, needle",
    [
        ("lots", "a share such as 11%"),
        (10**30, "more than the 16 visual tokens"),
        (16, "keeps 16 visual tokens on average"),
    ],
)
def test_a_budget_the_kept_sets_do_not_realise_is_refused(exported, workspace, tmp_path, budget, needle):
    """``lots`` (a manifest every reader refuses: issue 47 item 4), past the image, or 16 while lines keep 6."""
    result = import_edited(exported, workspace, tmp_path, lambda header, lines: header.update(budget=budget))
    refused(result, "line 1 (header)", needle, "give the budget" if budget != "lots" else "budget")


# ----- issue 44 item 7: probabilities and costs that contradict themselves -------------------------------------


@pytest.mark.parametrize(
    "answer, needle",
    [
        ({"text": "yes", "probability": 0.5, "p_yes": 0.9, "p_no": 0.9}, "p_yes and p_no sum to 1.8"),
        ({"text": "A", "probability": 0.25, "letter_probs": [0.9, 0.9, 0.9, 0.9]}, "letter_probs sum to 3.6"),
        (
            {
                "text": "red cube",
                "probability": 0.9,
                "sequence_probability": 0.9,
                "mean_token_probability": 0.1,
                "answer_tokens": 3,
                "stopped": True,
            },
            "is not mean token probability 0.1 to the power of its 3 tokens",
        ),
        (
            {"text": "a red cube on the left", "probability": 1.0, "token_probs": [], "stopped": True},
            "an answer of 0 tokens is the empty text",
        ),
    ],
)
def test_probabilities_that_cannot_be_are_refused(exported, workspace, tmp_path, answer, needle):
    result = import_edited(exported, workspace, tmp_path, in_first(lambda line: line.update(answer=answer)))
    refused(result, "line 2: answer", needle, "give the probabilities the model gave")


def test_an_answer_text_its_probabilities_contradict_is_refused(exported, workspace, tmp_path):
    def contradict(line):
        line["answer"].update(text="no", p_yes=0.95, p_no=0.01)

    result = import_edited(exported, workspace, tmp_path, in_first(contradict))
    refused(result, "line 2: answer text 'no', but its probabilities answer 'yes'", "give the text")


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"flops": 1}, "is not flops_vision + flops_selector + flops_llm"),
        ({"kv_bytes": 1234.5}, "kv_bytes must be a whole number"),
    ],
)
def test_costs_that_contradict_themselves_are_refused(exported, workspace, tmp_path, change, needle):
    result = import_edited(exported, workspace, tmp_path, in_first(lambda line: line["cost"].update(change)))
    refused(result, 'line 2: "cost"', needle, 'drop "cost"')


# ----- one definition: run's own records pass the same rules ---------------------------------------------------


def test_run_records_pass_the_rules_the_import_checks(exported):
    for name in ("divprune", "fastv"):
        for record in pq.read_table(exported[name] / "records.parquet").to_pylist():
            assert record_problem(record) is None


def test_a_run_record_breaking_a_rule_is_never_written(exported, tmp_path):
    record = pq.read_table(exported["divprune"] / "records.parquet").to_pylist()[0]
    manifest = json.loads((exported["divprune"] / "manifest.json").read_text())
    store = RecordStore(tmp_path / "run", manifest)
    with pytest.raises(PruneAuditError, match="p_yes and p_no sum to 1.8"):
        store.append([{**copy.deepcopy(record), "p_yes": 0.9, "p_no": 0.9}])
    assert not (tmp_path / "run").exists()


# ----- issue 47 items 4 and 5: what import writes, every input kind ---------------------------------------------


def test_an_imported_run_is_read_by_every_reader(exported, workspace, tmp_path):
    out = tmp_path / "imported"
    result = invoke(
        "import",
        exported["fastv.jsonl"],
        "--geometry",
        workspace["model"],
        *question_args(workspace),
        "--out",
        out,
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    question_id = pq.read_table(out / "records.parquet")["question_id"][0].as_py()
    for command in (
        ["visualize", "--run", out, "--question-id", question_id, "--out", tmp_path / "figure.png"],
        ["export", out, "--out", tmp_path / "again.jsonl"],
    ):
        result = invoke(*command)
        assert result.exit_code == 0, result.output


def test_a_parquet_question_run_round_trips_with_its_signal_sources(workspace, tmp_path):
    """``run --questions pope.parquet; export; import --questions pope.parquet``: the same records, latency aside;
    ``signal_sources`` travels in the cost."""
    parquet = pope_parquet(workspace, tmp_path / "test-00000-of-00001.parquet")
    common = ["--annotations", workspace["instances"], "--questions", parquet]
    run = tmp_path / "run"
    result = invoke(
        "run",
        "--model",
        workspace["model"],
        *common,
        "--selector",
        "cls_attn",
        "--budget",
        "6",
        "--limit",
        LIMIT,
        "--out",
        run,
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    assert invoke("export", run, "--out", tmp_path / "kept.jsonl").exit_code == 0
    out = tmp_path / "imported"
    result = invoke(
        "import", tmp_path / "kept.jsonl", "--geometry", workspace["model"], *common, "--out", out, "--quiet"
    )
    assert result.exit_code == 0, result.output
    assert_same_records(run, out, LIMIT)
    sources = [pq.read_table(folder / "records.parquet")["signal_sources"].to_pylist() for folder in (run, out)]
    assert sources[0] == sources[1] and sources[0][0] == ["vision_cls_row"]
    assert "signal_sources" not in PROVENANCE


def test_the_manifest_an_import_would_write_passes_the_readers_check(exported):
    """The last check before the first byte: the manifest is the one ``read_manifest`` accepts (a header budget
    ``lots`` is refused earlier, at the header; this is the same check every reader applies)."""
    from prune_audit.records.interchange import read_kept_sets
    from prune_audit.runner.imported import check_imported_manifest

    kept_sets = read_kept_sets(exported["divprune.jsonl"])
    manifest = json.loads((exported["divprune"] / "manifest.json").read_text())
    check_imported_manifest(kept_sets, manifest)
    with pytest.raises(PruneAuditError, match="would be refused by every reader .manifest field 'budget'"):
        check_imported_manifest(kept_sets, {**manifest, "budget": "lots"})


@pytest.mark.parametrize("sources", [[["vision_cls_row"]], ["a_probe_nobody_ran"], "vision_cls_row"])
def test_signal_sources_outside_the_known_names_are_refused(exported, workspace, tmp_path, sources):
    result = import_edited(
        exported, workspace, tmp_path, in_first(lambda line: line["cost"].update(signal_sources=sources))
    )
    refused(result, 'line 2: cost "signal_sources" must be null or a list of vision_cls_row')


def test_an_answer_longer_than_the_task_generates_is_refused(workspace, tmp_path):
    """10**20 answer tokens (past the int64 column) under caption's limit: refused naming the limit."""
    coco = json.loads(Path(workspace["instances"]).read_text())
    image = coco["images"][0]
    answer = {
        "text": "a square",
        "probability": 1.0,
        "sequence_probability": 1.0,
        "mean_token_probability": 1.0,
        "answer_tokens": 10**20,
        "stopped": True,
    }
    line = {"question_id": image["id"], "split": "caption", "image": image["file_name"], "stages": [], "answer": answer}
    header = {
        "format": "prune-audit-kept-sets",
        "version": 2,
        "task": "caption",
        "max_new_tokens": 4,
        "selector": "none",
        "budget": None,
    }
    path = tmp_path / "kept.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in [header, line]))
    out = tmp_path / "out"
    questions = generating_args(workspace, tmp_path, "caption")[2:]
    result = invoke("import", path, "--geometry", workspace["model"], *questions, "--out", out)
    refused(result, "line 2: answer of 100000000000000000000 tokens", "at most 4", "give the header the limit")
    assert not out.exists()


def test_merged_tokens_may_share_a_cell_but_never_carry_one_twice():
    from prune_audit.pruners.pool import adaptive_windows
    from prune_audit.records.consistency import stage_cells_problem

    bins = [window.tolist() for window in adaptive_windows(24, 24, 128)]  # 11 x 11 bins over 24 cells overlap
    assert len({cell for cells in bins for cell in cells}) < sum(map(len, bins))
    assert stage_cells_problem([], bins) is None
    assert "carries grid cell 3 twice" in stage_cells_problem([], [[3, 3]])
