"""Declared option domains of the selectors: one place per option, checked on construction and on parsing.

Every option of a selector is a dataclass field made with :func:`option`, which
stores its :class:`Domain` in the field metadata. The registry, the CLI parser
(``--option KEY=VALUE``) and the selector's own ``__post_init__`` all read that one
declaration, so a value is refused with the same one-line message wherever it
enters: ``option NAME=VALUE of selector S is not allowed: NAME must be DOMAIN``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prune_audit.integers import parse_integer

_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}
_NONE = {"none", "null"}


class Domain:
    """The type and the allowed values of one option."""

    optional: bool = False

    def describe(self) -> str:
        raise NotImplementedError

    def contains(self, value: Any) -> bool:
        """True when ``value`` (already typed) is allowed."""
        raise NotImplementedError

    def convert(self, text: str) -> Any:
        """The typed value of ``text``; ValueError when it has the wrong type."""
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        if self.optional and text.strip().lower() in _NONE:
            return None
        return self.convert(text.strip())

    def allows(self, value: Any) -> bool:
        return (value is None and self.optional) or (value is not None and self.contains(value))

    def describe_all(self) -> str:
        return f"{self.describe()} or none" if self.optional else self.describe()

    def describe_for(self, depth: int | None, value: Any = None) -> str:
        """The allowed values as they bear on a model of ``depth`` decoder layers (None: no model), and
        what ``value`` means there; only domains tied to the model's depth say more than :meth:`describe_all`."""
        return self.describe_all()


@dataclass(frozen=True)
class Real(Domain):
    """A finite number in an interval; ``open_low``/``open_high`` exclude the bounds."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    optional: bool = False

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
            return f"a finite number in {left}{self.low:g}, {self.high:g}{right}"
        if self.low is not None:
            return f"a finite number {'>' if self.open_low else '>='} {self.low:g}"
        if self.high is not None:
            return f"a finite number {'<' if self.open_high else '<='} {self.high:g}"
        return "a finite number"

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.open_high else value > self.high))

    def convert(self, text: str) -> float:
        return float(text)


@dataclass(frozen=True)
class Integer(Domain):
    """An integer in ``[low, high]`` (either bound may be open-ended)."""

    low: int | None = None
    high: int | None = None
    optional: bool = False

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"an integer in [{self.low}, {self.high}]"
        if self.low is not None:
            return f"an integer >= {self.low}"
        return "an integer" if self.high is None else f"an integer <= {self.high}"

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def convert(self, text: str) -> int:
        return parse_integer(text)


@dataclass(frozen=True)
class Flag(Domain):
    """A boolean: true/false, 1/0, yes/no."""

    def describe(self) -> str:
        return "true or false"

    def contains(self, value: Any) -> bool:
        return isinstance(value, bool)

    def convert(self, text: str) -> bool:
        lowered = text.lower()
        if lowered not in _TRUE | _FALSE:
            raise ValueError(text)
        return lowered in _TRUE


@dataclass(frozen=True)
class Choice(Domain):
    """One of a fixed set of names."""

    values: tuple[str, ...] = ()

    def describe(self) -> str:
        return "one of " + ", ".join(self.values)

    def contains(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.values

    def convert(self, text: str) -> str:
        return text


@dataclass(frozen=True)
class Text(Domain):
    """A non-empty string without surrounding blanks (a file path: FitPrune's schedule file)."""

    optional: bool = False

    def describe(self) -> str:
        return "a non-empty text"

    def contains(self, value: Any) -> bool:
        return isinstance(value, str) and bool(value) and value == value.strip()

    def convert(self, text: str) -> str:
        if not text:
            raise ValueError(text)
        return text


def spell(value: Any) -> str:
    """A typed option value as ``--option KEY=VALUE`` takes it: none, true/false, names bare."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def option(default: Any, domain: Domain, doc: str = "") -> Any:
    """A selector option: a dataclass field whose metadata holds its domain and a one-line description."""
    if not domain.allows(default):
        raise ValueError(f"default {default!r} is outside its own domain ({domain.describe_all()})")
    return dataclasses.field(default=default, metadata={"domain": domain, "doc": doc})


def option_domains(cls: type, strict: bool = True) -> dict[str, Domain]:
    """Every option of a selector class with its declared domain.

    ``strict``: an option without a domain is a TypeError (registered selectors);
    otherwise it is skipped (ad-hoc selectors built in tests or notebooks).
    """
    domains = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        domain = field.metadata.get("domain")
        if domain is None and not strict:
            continue
        if domain is None:
            raise TypeError(f"option {field.name!r} of {cls.__name__} declares no domain; make it with option()")
        domains[field.name] = domain
    return domains


def describe_options(cls: type, depth: int | None = None) -> str:
    """``name (domain, default d); ...`` for error messages and listings; ``depth``: the model's decoder layers,
    when known (a layer option then names the model's own layers beside the reference's, ``Domain.describe_for``)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
    parts = [
        f"{name} ({domain.describe_all() if depth is None else domain.describe_for(depth)}, "
        f"default {spell(defaults[name])})"
        for name, domain in option_domains(cls).items()
    ]
    return "; ".join(parts) or "none"


def refusal(selector: str, name: str, value: Any, domain: Domain, depth: int | None = None) -> ValueError:
    """The one-line error for ``name=value``, the value spelled as on the command line; ``depth``: the model's
    decoder layers, when known (a layer option then names the model's own layers, ``Domain.describe_for``)."""
    return ValueError(
        f"option {name}={spell(value)} of selector {selector!r} is not allowed: {name} must be "
        f"{domain.describe_for(depth)}"
    )


def check_options(selector: Any) -> None:
    """Raise the one-line ValueError for the first option of ``selector`` outside its domain."""
    for name, domain in option_domains(type(selector), strict=False).items():
        value = getattr(selector, name)
        if not domain.allows(value):
            raise refusal(type(selector).name, name, value, domain)


def parse_options(cls: type, pairs: Sequence[str], depth: int | None = None) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> typed options of selector class ``cls``, each checked against its domain
    (``depth``: the model's decoder layers, when known, for the refusal's words).

    Raises:
        ValueError: one line naming the option, the value and the allowed domain.
    """
    domains = option_domains(cls)
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--option must look like KEY=VALUE, got {pair!r}")
        if key in options:
            raise ValueError(f"--option {key} is given twice; pass each option of selector {cls.name!r} once")
        if key not in domains:
            raise ValueError(
                f"unknown option {key!r} of selector {cls.name!r}; valid options: {describe_options(cls, depth)}"
            )
        domain = domains[key]
        try:
            value = domain.parse(text)
        except ValueError:
            raise refusal(cls.name, key, text, domain, depth) from None
        if not domain.allows(value):
            raise refusal(cls.name, key, text, domain, depth)
        options[key] = value
    return options


__all__ = [
    "Domain",
    "Real",
    "Integer",
    "Flag",
    "Choice",
    "option",
    "spell",
    "option_domains",
    "describe_options",
    "check_options",
    "parse_options",
]
