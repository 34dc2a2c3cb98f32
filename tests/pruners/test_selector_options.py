"""Every selector option declares its type and domain; bad values are refused in one line before anything runs.

Parametrized over every registered selector and every declared option, so a new
option is covered as soon as it exists (issue 12 item 2).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from prune_audit.pruners import get_selector, list_selectors, selector_class
from prune_audit.pruners.options import Choice, Domain, Flag, Integer, Real, Text, option_domains
from prune_audit.pruners.registry import selector_from_strings

DECLARED = [(name, option) for name in list_selectors() for option in option_domains(selector_class(name))]


def defaults(name: str) -> dict:
    return {f.name: f.default for f in dataclasses.fields(selector_class(name)) if f.init}


def bad_texts(domain: Domain) -> list[str]:
    """Values outside ``domain``, as typed on the command line."""
    if isinstance(domain, Real):
        texts = ["nan", "inf", "-inf", "abc", ""]
        if domain.low is not None:
            texts.append(str(domain.low if domain.open_low else domain.low - 1))
        if domain.high is not None:
            texts.append(str(domain.high if domain.open_high else domain.high + 1))
        return texts
    if isinstance(domain, Integer):
        texts = ["1.5", "abc", "nan", "true"]
        if domain.low is not None:
            texts.append(str(domain.low - 1))
        if domain.high is not None:
            texts.append(str(domain.high + 1))
        return texts
    if isinstance(domain, Flag):
        return ["maybe", "2", ""]
    if isinstance(domain, Text):
        return [""]
    assert isinstance(domain, Choice)
    return ["bogus", domain.values[0].upper() + "x", ""]


def good_text(domain: Domain, default: object) -> str:
    if isinstance(domain, Choice):
        return domain.values[-1]
    if default is None:
        return "none"
    return str(default).lower()


@pytest.mark.parametrize("name, option", DECLARED)
def test_default_lies_in_the_declared_domain(name, option):
    domain = option_domains(selector_class(name))[option]
    assert domain.allows(defaults(name)[option])
    assert domain.describe_all()


@pytest.mark.parametrize("name, option", DECLARED)
def test_out_of_domain_values_are_refused_naming_option_value_and_domain(name, option):
    domain = option_domains(selector_class(name))[option]
    for text in bad_texts(domain):
        with pytest.raises(ValueError) as error:
            selector_from_strings(name, [f"{option}={text}"])
        message = str(error.value)
        assert "\n" not in message
        assert f"{option}={text} of selector {name!r} is not allowed" in message
        assert f"{option} must be {domain.describe_all()}" in message


@pytest.mark.parametrize("name, option", DECLARED)
def test_in_domain_values_parse_to_the_declared_type(name, option):
    domain = option_domains(selector_class(name))[option]
    text = good_text(domain, defaults(name)[option])
    try:
        selector = selector_from_strings(name, [f"{option}={text}"])
    except ValueError as error:  # a valid value may still be refused by a cross-option rule, in one line
        assert "\n" not in str(error)
        return
    value = getattr(selector, option)
    assert domain.allows(value)
    assert value == domain.parse(text)


@pytest.mark.parametrize("name, option", DECLARED)
def test_construction_checks_the_same_domain(name, option):
    """Python callers (``get_selector``) meet the same check as the CLI."""
    with pytest.raises(ValueError, match=f"option {option}=.* of selector {name!r} is not allowed"):
        get_selector(name, **{option: float("nan")})


@pytest.mark.parametrize("name", list_selectors())
def test_unknown_key_and_malformed_pairs_are_refused(name):
    with pytest.raises(ValueError, match=f"unknown option 'no_such_option' of selector {name!r}; valid options: "):
        selector_from_strings(name, ["no_such_option=1"])
    with pytest.raises(ValueError, match="--option must look like KEY=VALUE"):
        selector_from_strings(name, ["novalue"])


def test_cli_refuses_nan_before_writing_anything(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "prune_audit.cli.main", "run", "--selector", "scope", "--budget", "10",
         "--option", "alpha=nan", "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: option alpha=nan of selector 'scope' is not allowed: alpha must be a finite number >= 0"
    )
    assert "Traceback" not in result.stderr and not out.exists()
