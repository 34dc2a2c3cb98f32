"""``prune-audit selectors``: list every registered selector."""

from __future__ import annotations

from typing import Annotated

import typer

from prune_audit.cli.common import handle_errors


@handle_errors
def selectors(
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    fidelity: Annotated[
        bool, typer.Option("--fidelity", help="Print each selector's fidelity to its official code (docs/fidelity.md).")
    ] = False,
) -> None:
    """List every registered selector: stage, required signals, default options and reference."""
    import json

    from prune_audit.pruners import list_selectors, selector_class
    from prune_audit.pruners.base import option_defaults
    from prune_audit.pruners.options import option_domains

    if fidelity:
        _print_fidelity(json_output)
        return

    rows = []
    for name in list_selectors():
        cls = selector_class(name)
        rows.append(
            {
                "name": name,
                "stage": cls.stage,
                "requires": sorted(cls.requires),
                "options": option_defaults(cls),
                "domains": {name: domain.describe_all() for name, domain in option_domains(cls).items()},
                "summary": cls.summary,
                "paper": cls.reference.paper,
                "repository": cls.reference.repository,
            }
        )
    if json_output:
        print(json.dumps(rows, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Registered selectors", show_lines=True)
    for column in ("name", "stage", "requires", "default options: allowed values", "reference"):
        table.add_column(column, overflow="fold")
    for row in rows:
        options = "\n".join(f"{k}={v!r}: {row['domains'][k]}" for k, v in row["options"].items()) or "-"
        reference = f"{row['paper']}\n{row['repository']}"
        table.add_row(row["name"], row["stage"], ", ".join(row["requires"]) or "-", options, reference)
    Console().print(table)


def _print_fidelity(json_output: bool) -> None:
    """The fidelity table: the text of docs/fidelity.md, or its rows as JSON."""
    import json

    from prune_audit.pruners.fidelity import fidelity_markdown, fidelity_rows

    if json_output:
        print(json.dumps(fidelity_rows(), indent=2))
    else:
        print(fidelity_markdown(), end="")
