"""Issue 23, items 1, 2, 12 and 14: who owns an output folder, its lock, clean-up and stop signals.

A command creates its output folder or adopts an empty one; any other folder it does not
own is refused (a user's folder, ``/``). Ownership and the lock are taken together, under
the lock, right before the first byte is written, and held to the end, so a command that
passed its planning check while another claimed the folder is refused. Clean-up removes
only this project's exact temporary names. SIGTERM and SIGHUP end like Ctrl-C.

Every refusal: exit code, one ``error:`` line naming cause and fix, no traceback, no signal,
and every pre-existing file's bytes unchanged (``snapshot`` includes hidden files).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_data_safety import cli, demo, invoke, process_env, record_count, refused, snapshot  # noqa: F401 (fixture)

from prune_audit.errors import PruneAuditError
from prune_audit.safety.ownership import OWNER_FILE, check_output_dir, hold_output_dir

HEX = "0123456789abcdef" * 2  # the 32 hex digits of this project's temporary names


def users_folder(root: Path) -> Path:
    """A folder of someone else's files, hidden temporaries included (as the issue's user had)."""
    folder = root / "home"
    (folder / "project" / "src").mkdir(parents=True)
    (folder / ".session.tmp").write_text("session")
    (folder / "project" / "src" / ".report.docx.tmp").write_text("draft")
    (folder / "notes.txt").write_text("notes")
    return folder


def calibrate_args(demo, out: Path, *extra: str) -> list:
    return ["calibrate", demo["pruned"], "--reference", demo["dense"], "--bootstrap", "20", "--out", out, *extra]


# ----- 1. a command may create its folder or adopt an empty one; nothing else ---------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--limit", "2"],
        ["calibrate", "{pruned}", "--bootstrap", "20"],
        ["cascade", "{pruned}", "--reference", "{dense}", "--splits", "5", "--epsilon", "0.5"],
        ["intervene", "{pruned}", "--mode", "remove"],
        ["merge", "{dense}"],
        ["pope", "build", "--annotations", "{annotations}", "--images", "5"],
        ["demo", "train"],
    ],
)
def test_a_folder_of_someone_elses_files_is_refused_and_kept(demo, tmp_path, command):
    folder = users_folder(tmp_path)
    before = snapshot(folder)
    args = [str(demo[a[1:-1]]) if a.startswith("{") else a for a in command]
    refused(invoke(*args, "--out", folder), str(folder), "already holds files", "notes.txt", "new or empty folder")
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == [
        ".session.tmp",
        "notes.txt",
        "project",
    ]


def test_out_root_or_a_link_to_root_is_refused(demo, tmp_path):
    link = tmp_path / "root-link"
    link.symlink_to("/")
    for out in (Path("/"), link):
        refused(invoke("run", "--limit", "2", "--out", out), str(out), "filesystem root", "folder of its own")
        refused(invoke(*calibrate_args(demo, out)), "filesystem root")
    assert [p.name for p in tmp_path.iterdir()] == ["root-link"]


def test_an_empty_folder_is_adopted(demo, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done = invoke(*calibrate_args(demo, empty))
    assert done.exit_code == 0, done.output
    assert json.loads((empty / OWNER_FILE).read_text())["command"] == "calibrate"


def test_a_folder_another_shard_is_claiming_counts_as_empty(tmp_path):
    """Shards of one run claim the folder together: one shard's marker temporary (and the lock files) must
    not make the folder look like a user's to the other shard (torchrun ranks raced on exactly this)."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".prune-audit.lock").write_text("")
    (folder / f".{OWNER_FILE}.{HEX}.tmp").write_text("{}")
    assert check_output_dir(folder, "run") == folder
    (folder / f".session.{HEX}.tmp").write_text("a user's")  # any other hidden file is the user's
    with pytest.raises(PruneAuditError, match="already holds files"):
        check_output_dir(folder, "run")


@pytest.mark.parametrize(("settings", "adopted"), [({"budget": 5}, True), ({"budget": 6}, False)])
def test_a_marker_another_shard_writes_while_the_folder_is_checked_is_read(tmp_path, monkeypatch, settings, adopted):
    """The other shard's marker can appear after it was read as absent and before the folder is listed: the
    check reads it once more and compares its settings (a CI run of the 2-process launch failed on this)."""
    from prune_audit.safety import ownership

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".prune-audit.lock").write_text("")
    real_read_owner = ownership.read_owner
    calls = []

    def marker_written_right_after_the_first_read(directory):
        calls.append(directory)
        if len(calls) == 1:
            (folder / OWNER_FILE).write_text(json.dumps({"command": "run", "settings": {"budget": 5}}))
            return None
        return real_read_owner(directory)

    monkeypatch.setattr(ownership, "read_owner", marker_written_right_after_the_first_read)
    if adopted:
        assert check_output_dir(folder, "run", settings) == folder
    else:
        with pytest.raises(PruneAuditError, match="other settings"):
            check_output_dir(folder, "run", settings)
    assert len(calls) == 2


def test_clean_up_removes_only_the_runs_own_temporaries(demo, tmp_path):
    import shutil

    run = Path(shutil.copytree(demo["dense"], tmp_path / "run"))
    ours = [run / f".manifest.json.{HEX}.tmp", run / f".records.parquet.{HEX}.tmp", run / f".staging-{HEX}"]
    (run / "parts").mkdir()
    ours.append(run / "parts" / f".part-0-{HEX}.parquet.{HEX}.tmp")
    for path in ours:
        path.mkdir() if path.name.startswith(".staging-") else path.write_bytes(b"half")
    (run / "sub").mkdir()
    theirs = [
        run / ".session.tmp",
        run / "sub" / ".report.docx.tmp",
        run / f".notes.{HEX}.tmp",
        run / "sub" / f".manifest.json.{HEX}.tmp",
        run / ".staging-mine" / "keep.txt",
    ]
    for path in theirs:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"the user's")
    resumed = invoke("run", "--limit", "12", "--out", run)
    assert resumed.exit_code == 0, resumed.output
    assert not any(path.exists() for path in ours)
    assert [path.read_bytes() for path in theirs] == [b"the user's"] * len(theirs)


def test_a_command_that_fails_before_writing_removes_the_folder_it_created(demo, tmp_path, monkeypatch):
    import prune_audit.analysis.outputs as outputs

    write_files = outputs.write_files

    def disk_full(directory, files):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "calibration.json"))

    monkeypatch.setattr(outputs, "write_files", disk_full)
    out = tmp_path / "new" / "calibration"
    refused(invoke(*calibrate_args(demo, out)), "no space left on the device", code=1)
    assert list(tmp_path.iterdir()) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(invoke(*calibrate_args(demo, empty)), "no space left", code=1)
    assert list(empty.iterdir()) == [empty / ".prune-audit.lock"]  # adopted folder left as it was: no owner
    monkeypatch.setattr(outputs, "write_files", write_files)
    corrected = invoke(*calibrate_args(demo, empty, "--bins", "5"))  # other settings: not blocked by the failure
    assert corrected.exit_code == 0, corrected.output


def test_hold_removes_created_folders_only_while_they_hold_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with hold_output_dir(tmp_path / "a" / "b", "calibrate", {"bins": 15}):
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        with hold_output_dir(tmp_path / "c", "calibrate", {"bins": 15}) as out:
            (out / "calibration.json").write_text("{}")
            raise KeyboardInterrupt
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        ".prune-audit-owner.json",
        ".prune-audit.lock",
        "calibration.json",
    ]


# ----- 2. ownership and the lock, taken together under the lock, held to the end --------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time
    from prune_audit.safety.ownership import hold_output_dir
    with hold_output_dir(sys.argv[1], sys.argv[2], None if sys.argv[3] == "-" else {"bins": int(sys.argv[3])}):
        print("held", flush=True)
        time.sleep(600)
    """
)


def test_a_held_folder_is_refused_to_a_second_writer_of_any_command(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), "calibrate", "15"],
        stdout=subprocess.PIPE,
        text=True,
        env=process_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(out)
        for command, settings in (("calibrate", {"bins": 15}), ("calibrate", {"bins": 5}), ("run", None)):
            with pytest.raises(PruneAuditError):
                with hold_output_dir(out, command, settings):
                    pytest.fail("a second writer entered")
        with pytest.raises(PruneAuditError, match=f"being written by pid {holder.pid}"):
            with hold_output_dir(out, "calibrate", {"bins": 15}):
                pass
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


def claim_meanwhile(monkeypatch, module, name: str, claim) -> None:
    """Make ``module.name`` (a step between a command's planning check and its first write) run ``claim`` after it."""
    original = getattr(module, name)

    def then_claim(*args, **kwargs):
        result = original(*args, **kwargs)
        claim()
        return result

    monkeypatch.setattr(module, name, then_claim)


def a_run_claims(out: Path):
    def claim() -> None:
        with hold_output_dir(out, "run", writes=("records.parquet",)):
            (out / "records.parquet").write_bytes(b"the run's records")

    return claim


def test_calibrate_refuses_a_folder_a_run_claimed_after_its_planning_check(demo, tmp_path, monkeypatch):
    import prune_audit.analysis.reports as reports

    out = tmp_path / "x"
    claim_meanwhile(monkeypatch, reports, "calibration_report", a_run_claims(out))
    refused(invoke(*calibrate_args(demo, out)), str(out), "outputs of prune-audit run", "pass another --out")
    assert (out / "records.parquet").read_bytes() == b"the run's records"
    assert json.loads((out / OWNER_FILE).read_text())["command"] == "run"  # the run can resume


def test_intervene_refuses_a_folder_a_run_claimed_after_its_planning_check(demo, tmp_path, monkeypatch):
    import prune_audit.runner.intervene as intervene

    out = tmp_path / "x"
    claim_meanwhile(monkeypatch, intervene, "answer_swaps", a_run_claims(out))
    refused(
        invoke("intervene", demo["pruned"], "--mode", "remove", "--bootstrap", "20", "--out", out),
        str(out),
        "outputs of prune-audit run",
    )
    assert (out / "records.parquet").read_bytes() == b"the run's records"
    assert sorted(p.name for p in out.iterdir()) == [".prune-audit-owner.json", ".prune-audit.lock", "records.parquet"]


def test_two_calibrates_with_other_settings_never_mix_owner_and_outputs(demo, tmp_path, monkeypatch):
    import prune_audit.analysis.reports as reports

    out = tmp_path / "cal"

    def other_calibrate_finishes() -> None:
        other = subprocess.run(
            cli(*calibrate_args(demo, out, "--bins", "5")), capture_output=True, text=True, env=process_env()
        )
        assert other.returncode == 0, other.stderr

    claim_meanwhile(monkeypatch, reports, "calibration_report", other_calibrate_finishes)
    refused(invoke(*calibrate_args(demo, out)), str(out), "other settings (bins)", "pass another --out")
    owner = json.loads((out / OWNER_FILE).read_text())["settings"]
    written = json.loads((out / "calibration.json").read_text())
    assert owner["bins"] == 5 and written["settings"]["bins"] == 5, written.get("settings")


# ----- 12. no command replaces another build, checkpoint or command's folder -------------------------------------------


def test_pope_build_into_its_folder_with_other_settings_is_refused(demo, tmp_path):
    out = tmp_path / "pope"
    args = ["pope", "build", "--annotations", demo["annotations"], "--images", "5", "--out", out]
    assert invoke(*args, "--seed", "1").exit_code == 0
    before = snapshot(out)
    refused(invoke(*args, "--seed", "2"), str(out), "other settings (seed)", "pass another --out")
    refused(invoke(*args, "--seed", "1", "--prefix", "other"), "other settings (prefix)")
    assert snapshot(out) == before
    again = invoke(*args, "--seed", "1")  # the same build again writes the same files
    assert again.exit_code == 0, again.output
    assert snapshot(out) == before


def fake_checkpoint(folder: Path, marker: dict | None) -> Path:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "training.json").write_text("{}")
    if marker is not None:
        (folder / OWNER_FILE).write_text(json.dumps(marker))
    return folder


def test_demo_train_never_replaces_a_checkpoint_of_other_settings_or_another_commands_folder(demo, tmp_path):
    from dataclasses import asdict

    from prune_audit.demo.train import DEMO_RECIPES

    owned = fake_checkpoint(tmp_path / "owned", {"command": "demo train", "settings": asdict(DEMO_RECIPES["demo"])})
    legacy = fake_checkpoint(tmp_path / "legacy", None)
    before = snapshot(tmp_path, demo["dense"])
    refused(invoke("demo", "train", "--seed", "2", "--out", owned), str(owned), "other settings (seed)")
    refused(invoke("demo", "train", "--out", legacy), str(legacy), "settings were not recorded")
    refused(invoke("demo", "train", "--out", demo["dense"]), str(demo["dense"]), "outputs of prune-audit run")
    assert snapshot(tmp_path, demo["dense"]) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["legacy", "owned"]  # nothing staged beside them


def test_demo_questions_refuse_a_cache_folder_holding_a_commands_outputs(demo, tmp_path):
    before = snapshot(demo["dense"], demo["calibration"])
    for folder, holder in ((demo["dense"], "run"), (demo["calibration"], "calibrate")):
        refused(
            invoke("demo", "questions", "--cache-dir", folder, "--scenes", "20", "--pope-images", "4"),
            str(folder),
            f"outputs of prune-audit {holder}",
            "--cache-dir",
        )
    assert snapshot(demo["dense"], demo["calibration"]) == before


def test_check_output_dir_writes_nothing(tmp_path):
    folder = users_folder(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(PruneAuditError):
        check_output_dir(folder, "run")
    check_output_dir(tmp_path / "new" / "deeper", "run")
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()


# ----- 14. staging leftovers; SIGTERM and SIGHUP end like Ctrl-C ----------------------------------------------


def test_a_killed_writers_staging_folder_is_removed_by_the_rerun(demo, tmp_path):
    out = tmp_path / "cal"
    assert invoke(*calibrate_args(demo, out)).exit_code == 0
    leftover = out / f".staging-{HEX}"
    leftover.mkdir()
    (leftover / "calibration.json").write_text('{"half": ')  # as a kill between the renames leaves it
    mine = out / ".staging-notes" / "keep.txt"
    mine.parent.mkdir()
    mine.write_text("the user's")
    again = invoke(*calibrate_args(demo, out))
    assert again.exit_code == 0, again.output
    assert not leftover.exists() and mine.read_text() == "the user's"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_say_what_is_saved_like_ctrl_c(demo, tmp_path, signum, code):
    import time

    out = tmp_path / "run"
    args = cli("run", "--limit", "600", "--batch-size", "2", "--out", out)

    def default_signals() -> None:  # as a terminal has them, even when this test session ignores them
        for number in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, signal.SIG_DFL)

    process = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=process_env(),
        preexec_fn=default_signals,
    )
    while (
        process.poll() is None
        and len(list((out / "parts").glob("part-*.parquet")) if (out / "parts").is_dir() else []) < 2
    ):
        time.sleep(0.05)
    # a second command on the same folder while the run writes it is refused, and changes nothing
    before = {p.name for p in out.iterdir()}
    refused(invoke("intervene", demo["pruned"], "--mode", "remove", "--out", out), str(out), "prune-audit run")
    assert {p.name for p in out.iterdir()} == before
    process.send_signal(signum)
    _, stderr = process.communicate()
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr
    saved = record_count(out)
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == (
        f"error: interrupted by {name}: {saved} of 600 questions are saved in {out}; run the same command again to resume"
    )
    assert not [p for p in out.rglob(".*.tmp")], "a temporary file survived the signal"


def test_a_stop_signal_raises_like_ctrl_c_and_an_ignored_one_stays_ignored():
    from prune_audit.safety import progress

    previous = {
        signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    }
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            with progress.stops_like_ctrl_c():
                os.kill(os.getpid(), signal.SIGHUP)  # ignored, as under nohup
                os.kill(os.getpid(), signal.SIGTERM)
        assert progress.interrupt_exit_code(stopped.value) == 143
        assert progress.interrupted_message(stopped.value).startswith("interrupted by SIGTERM: ")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_save_ends_the_command_after_it_is_counted(tmp_path, signum):
    """A part renamed into place and its count in the saved-count line go together (a signal between the two
    made the line undercount under load)."""
    from prune_audit.safety import progress

    # A shell starts background jobs (``cmd &``) ignoring Ctrl-C, which stops_like_ctrl_c keeps ignored:
    # give the signal its default handler so the test holds however pytest was started.
    default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    previous = signal.signal(signum, default)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            with progress.stops_like_ctrl_c():
                progress.report_saved(tmp_path, 2, 10)
                with progress.saving():
                    os.kill(os.getpid(), signum)
                    progress.report_saved(tmp_path, 4, 10)  # still runs: the signal is held
                raise AssertionError("the held signal must end the command right after the save")
        assert progress.interrupted_message(stopped.value).endswith(
            f"4 of 10 questions are saved in {tmp_path}; run the same command again to resume"
        )
        assert progress.interrupt_exit_code(stopped.value) == 128 + signum
    finally:
        signal.signal(signum, previous)
        progress.forget_saved()
