"""README.md stays a short front page whose links, figures and timings can be trusted (issue 29, item 8).

- at most ``MAX_README_LINES`` lines (the details live in docs/);
- every relative link and image in README.md and docs/*.md names a file of the repository (and, with
  ``#anchor``, a heading of that Markdown file);
- every PNG they embed is written by ``benchmarks/demo_numbers.sh`` (under ``OUT/figures/``, same name);
- every wall time is written ``N s wall (CPU M s, load A-B)``, so no timing appears without the CPU time
  and the load it was measured at (the 2-core machine is shared: wall time alone says little).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
DEMO_NUMBERS = REPO_ROOT / "benchmarks" / "demo_numbers.sh"
MAX_README_LINES = 300
MARKDOWN_FILES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
# where every timing is a wall time ("took N s" must say "wall"); docs/benchmarks.md also quotes thread CPU times
PROSE_TIMED_FILES = [README, REPO_ROOT / "docs" / "usage.md"]

# [text](target) and ![alt](target), the target up to the first space or closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
DURATION = r"\d[\d,.]*\s*(?:ms|s|min|h)\b(?:\s+\d[\d,.]*\s*s\b)?"
# a wall time: "125 s wall", "12 min 40 s wall", "**12 min 40 s**\nwall"
WALL_TIME = re.compile(rf"({DURATION})\**\s+wall\b")
# what must follow it: "(CPU 215 s, load 0.7)" or "(CPU 604 s, ..., load 5-7 ...)"
CPU_AND_LOAD = re.compile(rf"\s*\(CPU\s+{DURATION}[^)]*?\bload\s+(?:average\s+)?\d")


def prose(path: Path) -> str:
    """The file without its fenced code blocks (commands and output are not links or claims)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+\s+(.*)$", prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_targets(path: Path, pattern: re.Pattern = LINK) -> list[str]:
    return [target for target in pattern.findall(prose(path)) if not re.match(r"[a-z]+:", target)]


def test_readme_is_a_short_front_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detailed sections to docs/"


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda path: path.name)
def test_relative_links_resolve(path):
    broken = []
    for target in relative_targets(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or REPO_ROOT not in linked.parents and linked != REPO_ROOT:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{path.name}: " + "; ".join(broken)


def test_every_embedded_png_is_written_by_demo_numbers():
    script = DEMO_NUMBERS.read_text(encoding="utf-8")
    embedded = {
        Path(target).name
        for path in MARKDOWN_FILES
        for target in relative_targets(path, IMAGE)
        if target.endswith(".png")
    }
    assert embedded, "README.md embeds no figure: the pattern no longer finds them"
    missing = sorted(name for name in embedded if f"/figures/{name}" not in script)
    assert not missing, f"not written under OUT/figures by benchmarks/demo_numbers.sh: {missing}"


def one_line(path: Path) -> str:
    return " ".join(prose(path).split())  # sentences wrap across lines


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda path: path.name)
def test_every_wall_time_states_cpu_time_and_load(path):
    text = one_line(path)
    bare = [match.group(0) for match in WALL_TIME.finditer(text) if not CPU_AND_LOAD.match(text, match.end())]
    assert not bare, f"{path.name}: write each wall time as 'N s wall (CPU M s, load A-B)': {bare}"


@pytest.mark.parametrize("path", PROSE_TIMED_FILES, ids=lambda path: path.name)
def test_no_timing_escapes_the_wall_time_convention(path):
    """A timing written without the word "wall" ("took 55 s") would escape the check above."""
    text = one_line(path)
    untagged = [
        sentence
        for sentence in re.split(r"(?<=[.;])\s", text)
        if re.search(rf"\btook\s+\**{DURATION}", sentence) and not WALL_TIME.search(sentence)
    ]
    assert not untagged, f"{path.name}: timings without 'wall': {untagged}"


def test_the_wall_time_convention_is_recognised():
    """The patterns above find the convention, and a wall time without CPU time or load."""
    good = "took 55 s wall (CPU 70 s, load 1.1-1.6) and **12 min 40 s** wall (CPU 604 s, load average 5-7)"
    assert [bool(CPU_AND_LOAD.match(good, m.end())) for m in WALL_TIME.finditer(good)] == [True, True]
    bad = "took 125 s wall, 215 s of CPU"
    assert [bool(CPU_AND_LOAD.match(bad, m.end())) for m in WALL_TIME.finditer(bad)] == [False]
