"""Issue 29, items 9-11: what a newcomer reads on the terminal.

``selectors`` wraps at word boundaries and spells option values as ``--option`` takes them,
with layer ranges for ``--model``; ``--fidelity`` is a readable list. ``run`` titles its
summary with the model's name, states the last stage only when it differs from the first
and names the manifest. ``visualize`` prints the question, every panel's answer and the
selectors not drawn. Every ``--help`` is consistent with what the command does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners import list_selectors, selector_class
from prune_audit.pruners.options import option_domains, spell

REPO_ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
PYTHON_REPR = re.compile(r"=(None|True|False|'[^']*')(\W|$)")


def invoke(*args: str, columns: int = 80):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns)})


def refused(result, *needles: str) -> None:
    """Exit 2, one ``error:`` line on stderr naming cause and fix, no traceback."""
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in line, line


def words_whole(text: str, width: int) -> None:
    """Every line fits ``width`` unless it is one word too long to break (kept whole, never split)."""
    for line in text.splitlines():
        assert len(line) <= width or len(line.split()) == 1 or len(line.strip().split()[-1]) > width // 2, line


# ----- item 9: selectors ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def listing() -> dict[str, object]:
    """`selectors` at 80 columns and its JSON (the demo model), and `selectors --model demo-qwen`."""
    text = invoke("selectors", columns=80)
    rows = invoke("selectors", "--json")
    qwen = invoke("selectors", "--model", "demo-qwen", columns=120)
    for result in (text, rows, qwen):
        assert result.exit_code == 0, result.output
    return {"text": text.stdout, "rows": json.loads(rows.stdout), "qwen": qwen.stdout}


def test_selectors_wrap_at_word_boundaries_at_80_columns(listing):
    text = listing["text"]
    words_whole(text, 80)
    tokens = set(text.split())
    for row in listing["rows"]:
        assert f"{row['name']}:" in tokens  # every identifier appears whole
        for signal in row["requires"]:
            assert signal in tokens or f"{signal}," in tokens
        assert row["repository"] in text


def test_selectors_spell_option_values_as_the_cli_takes_them(listing):
    text = listing["text"]
    assert not PYTHON_REPR.search(text), PYTHON_REPR.search(text).group(0)
    for needle in ("theta=none:", "ties=argmax:", "reliability=true:", "plain_attention=false:", "tau=1.0:"):
        assert needle in text


@pytest.mark.parametrize("name", list_selectors())
def test_every_listed_default_parses_back_to_itself(name):
    cls = selector_class(name)
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
    for key, domain in option_domains(cls).items():
        assert domain.parse(spell(defaults[key])) == defaults[key], key


def test_layer_ranges_are_those_of_the_model_given(listing):
    demo, qwen = " ".join(listing["text"].split()), " ".join(listing["qwen"].split())
    assert "demo (12 decoder layers" in demo and "demo-qwen (8 decoder layers" in qwen
    assert "on its 12 layers, decoder layers 1 to 11 (2 prunes at layer 1)" in demo
    assert "on its 8 layers, decoder layers 1 to 7 (2 prunes at layer 1)" in qwen
    fastv = next(row for row in listing["rows"] if row["name"] == "fastv")
    assert "decoder layers 1 to 11" in fastv["domains"]["layer"] and fastv["options"]["layer"] == 2


def test_selectors_not_a_terminal_wrap_at_80_columns():
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    result = subprocess.run(
        [sys.executable, "-m", "prune_audit.cli.main", "selectors"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    words_whole(result.stdout, 80)
    assert max(len(line) for line in result.stdout.splitlines()) > 60  # the width is used, not a narrow default


def test_fidelity_is_a_readable_list():
    result = invoke("selectors", "--fidelity", columns=70)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert not any(line.lstrip().startswith("|") for line in text.splitlines())  # no Markdown table
    words_whole(text, 70)
    lines = text.splitlines()
    for name in list_selectors():
        assert name in lines  # each selector heads its block
    assert text.count("remaining differences:") == len(list_selectors())
    assert "official code: Theia-4869/CDPruner (9541616c)" in " ".join(text.split())


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--markdown"], ("--markdown applies only with --fidelity", "add --fidelity")),
        (["--fidelity", "--markdown", "--json"], ("--markdown and --json exclude each other",)),
        (["--fidelity", "--model", "demo-qwen"], ("--model does not apply with --fidelity", "drop --model")),
        (["--model", "no/such/folder/here"], ("no/such/folder/here",)),
    ],
)
def test_selectors_refuse_options_that_do_not_fit(args, needles):
    refused(invoke("selectors", *args), *needles)


# ----- item 10: run and visualize ---------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    """Demo runs of 12 questions: dense, fastv (one stage) and e2s (three stages), with their output."""
    root = tmp_path_factory.mktemp("terminal")
    out = {}
    for name, extra in {
        "dense": [],
        "fastv": ["--selector", "fastv", "--budget", "64"],
        "e2s": ["--selector", "e2s", "--budget", "64"],
    }.items():
        result = invoke("run", "--limit", "12", "--quiet", "--out", root / name, *extra, columns=80)
        assert result.exit_code == 0, result.output
        out[name] = (root / name, result.stdout)
    return out


def test_run_summary_title_is_the_model_name_on_one_line(runs):
    for name, (_, output) in runs.items():
        title = output.splitlines()[0]
        selector = "none" if name == "dense" else name
        assert title.startswith(f"demo | selector {selector} | "), title
        assert "/" not in title


def test_run_summary_states_the_last_stage_only_when_it_differs(runs):
    for name in ("dense", "fastv"):
        output = runs[name][1]
        assert "lost objects, stage first (decoder layer" in output and "stage last" not in output
    assert "lost objects, stage last (decoder layer 8)" in runs["e2s"][1]


def test_run_summary_names_records_and_manifest(runs):
    for run_dir, output in runs.values():
        assert f"records: {run_dir / 'records.parquet'}\n" in output
        assert f"manifest: {run_dir / 'manifest.json'}\n" in output


@pytest.fixture(scope="module")
def image() -> Path:
    from prune_audit.demo.assets import demo_assets

    return sorted(demo_assets().images_dir.glob("*.png"))[0]


def test_visualize_prints_the_question_and_every_answer(image, tmp_path):
    out = tmp_path / "tokens.png"
    result = invoke("visualize", image, "--selector", "none", "--selector", "fastv", "--budget", "25%", "--out", out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("question: Is there a")
    assert re.fullmatch(r"  none \(unpruned\): answer (yes|no) \(confidence [01]\.\d{3}\)", lines[1])
    assert re.fullmatch(
        r"  fastv, budget 36 \(layer average\): answer (yes|no) \(confidence [01]\.\d{3}\)", lines[2]
    )  # 25% of 144
    assert lines[-1] == f"wrote {out}" and out.is_file()


def test_visualize_prints_the_selectors_not_drawn_wrapped(capsys, tmp_path, monkeypatch):
    from prune_audit.cli.visualize import _print_figure
    from prune_audit.runner.visualize import DrawnFigure, PanelAnswer

    monkeypatch.setenv("COLUMNS", "50")
    path = tmp_path / "a-rather-long-folder-name-that-does-not-fit" / "tokens.png"
    notes = (
        "not drawn: cdpruner (needs --clip-text PATH)",
        "also available: cls_attn, coverage, dart, e2s, pdrop, pool, scope, tome (--selector NAME)",
    )
    _print_figure(
        DrawnFigure(path, "Is there a square in the image?", (PanelAnswer("none (unpruned)", "yes", 0.9991),), notes)
    )
    text = capsys.readouterr().out
    words_whole(text, 50)
    assert "  none (unpruned): answer yes (confidence 0.999)" in text
    assert "not drawn: cdpruner (needs --clip-text PATH)" in text and "cls_attn," in text.split()
    assert text.splitlines()[-1] == f"wrote {path}"


def test_visualize_run_prints_the_recorded_question_and_answer(runs, tmp_path):
    import pyarrow.parquet as pq

    run_dir = runs["fastv"][0]
    row = pq.read_table(run_dir / "records.parquet").to_pylist()[0]
    out = tmp_path / "record.png"
    result = invoke(
        "visualize", "--run", run_dir, "--question-id", row["question_id"], "--split", row["split"], "--out", out
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"question: {row['split']} #{row['question_id']} about {row['object']} (label {row['label']})"
    assert (
        lines[1] == f"  fastv, budget 64 (layer average): answer {row['answer']} (confidence {row['confidence']:.3f})"
    )
    assert lines[-1] == f"wrote {out}"


def test_visualize_budget_share_out_of_range_is_one_line(image, tmp_path):
    out = tmp_path / "tokens.png"
    refused(
        invoke("visualize", image, "--selector", "fastv", "--budget", "150%", "--out", out),
        "--budget 150%",
        "(0%, 100%]",
    )
    assert not out.exists()


# ----- item 11: help ----------------------------------------------------------------------------


def command_paths(command, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for name, child in getattr(command, "commands", {}).items():
        paths += command_paths(child, (*prefix, name))
    return paths


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, ...], str]:
    texts = {}
    for path in command_paths(typer.main.get_command(app)):
        result = invoke(*path, "--help", columns=200)
        assert result.exit_code == 0, result.output
        texts[path] = " ".join(result.stdout.split())
    return texts


def test_no_negative_flags_and_no_braces_in_usage(helps):
    for path, text in helps.items():
        assert "--no-" not in text, path
        usage = text.split("Usage: ", 1)[1].split("  ")[0]
        assert "{" not in usage, (path, usage)
    assert "calibrate [OPTIONS] RUN_DIRS..." in helps[("calibrate",)]
    assert "cascade [OPTIONS] PRUNED_RUNS..." in helps[("cascade",)]
    assert "merge [OPTIONS] RUN_DIRS..." in helps[("merge",)]
    assert "intervene [OPTIONS] RUN_DIR " in helps[("intervene",)]
    assert "visualize [OPTIONS] [IMAGE]" in helps[("visualize",)]


def test_study_help_names_its_default_grid(helps):
    from prune_audit.runner.study.defaults import DEFAULT_BUDGETS, DEFAULT_SELECTORS

    text = helps[("study",)]
    assert f"{' and '.join(DEFAULT_SELECTORS)} at {' and '.join(DEFAULT_BUDGETS)} of its 144 visual tokens" in text
    assert "--force Compare runs" in text


def test_visualize_help_budget_and_stage(helps):
    text = helps[("visualize",)]
    assert "a share of the image's tokens (11%), or all" in text
    assert "With --run: the stage whose retention" in text and "With --run: Stage" not in text


def test_cascade_help_has_no_stage_and_says_reference_is_required(helps):
    text = helps[("cascade",)]
    assert "--stage" not in text and "retention" not in text.split("Options")[1]
    assert "--reference PATH Required. Run answering" in text and "(required)" not in text


def test_cascade_still_accepts_the_hidden_stage_and_states_none(runs, tmp_path):
    out = tmp_path / "cascade"
    result = invoke(
        "cascade",
        runs["fastv"][0],
        "--reference",
        runs["dense"][0],
        "--epsilon",
        "0.5",
        "--splits",
        "5",
        "--stage",
        "last",
        "--out",
        out,
        columns=120,
    )
    assert result.exit_code == 0, result.output
    assert "stage" not in result.stdout.replace("two-stage", "") and (out / "cascade.json").is_file()


def test_cascade_without_reference_is_one_line(runs, tmp_path):
    refused(invoke("cascade", runs["fastv"][0], "--out", tmp_path / "cascade"), "--reference RUN is required")
    assert not (tmp_path / "cascade").exists()


def test_run_summary_names_a_cached_hub_model_by_its_id(tmp_path):
    from prune_audit.cli.run import model_label

    snapshot = tmp_path / "hub" / "models--llava-hf--llava-1.5-7b-hf" / "snapshots" / "8c85e9a4"
    snapshot.mkdir(parents=True)
    assert model_label(str(snapshot)) == "llava-hf/llava-1.5-7b-hf"
    assert model_label("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"
    assert model_label(str(tmp_path / "hub")) == "hub"


def test_a_reader_that_stops_early_ends_the_listing_quietly():
    """`prune-audit selectors --fidelity | head` ends without an error line (the pipe's reader went away)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = f"{sys.executable} -m prune_audit.cli.main selectors --fidelity | head -c 10 > /dev/null"
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
        cwd=root,
    )
    assert done.stderr == "" and done.returncode in (0, 141), done.stderr
