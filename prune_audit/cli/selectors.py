"""``prune-audit selectors``: list every registered selector, its options, whether it runs on a model family, and
its fidelity."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from prune_audit.cli.common import handle_errors

if TYPE_CHECKING:
    from prune_audit.cli.terminal import Page
    from prune_audit.models.base import VisionLanguageModel


@handle_errors
def selectors(
    model: Annotated[
        Optional[str],
        typer.Option(
            help="Say what runs on this model family (a family name such as llava_next, a model folder or "
            "hub id, or demo / demo-qwen; default: the bundled demo model) and show the options' values "
            "for its depth; a checkpoint's config is read, not its weights."
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of the list.")] = False,
    fidelity: Annotated[
        bool, typer.Option("--fidelity", help="Print each selector's fidelity to its official code.")
    ] = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="With --fidelity: print the Markdown table of docs/fidelity.md.")
    ] = False,
) -> None:
    """List every registered selector: stage, required signals, whether it runs on --model's family (and why not),
    options with their allowed values, reference.

    Options are passed to `run`, `study` and `visualize` as --option KEY=VALUE, spelled as listed.
    Layer options are given on the 32-layer reference and scaled to the model's depth: the list says
    which decoder layers they reach on --model.
    """
    from prune_audit.errors import PruneAuditError

    if markdown and not fidelity:
        raise PruneAuditError("--markdown applies only with --fidelity; add --fidelity or drop --markdown")
    if markdown and json_output:
        raise PruneAuditError("--markdown and --json exclude each other; pass one of them")
    if fidelity:
        if model is not None:
            raise PruneAuditError(
                "--model does not apply with --fidelity (fidelity does not depend on the model); "
                "drop --model or --fidelity"
            )
        _print_fidelity(json_output, markdown)
        return
    name, depth, adapter = _model_target(model)
    rows = _selector_rows(depth, adapter)
    if json_output:
        import json

        print(json.dumps(rows, indent=2))
        return
    _print_selectors(rows, name, depth, adapter)


def _model_target(model: str | None) -> tuple[str, int | None, type[VisionLanguageModel]]:
    """(the name shown for ``--model``, its decoder depth from the config (None for a family name: no checkpoint
    read), its family adapter)."""
    from pathlib import Path

    from prune_audit.demo import DEMO_MODELS
    from prune_audit.demo.assets import is_demo_name
    from prune_audit.errors import PruneAuditError
    from prune_audit.models.families import adapter_for, family_names
    from prune_audit.models.loading import checkpoint_family

    name = model or "demo"
    if name in family_names() and not Path(name).exists():
        return name, None, adapter_for(name, name)
    try:
        adapter, depth = checkpoint_family(DEMO_MODELS[name] if is_demo_name(name) else name)
    except PruneAuditError as error:
        if Path(name).exists():
            raise
        raise PruneAuditError(f"{error}, or name a model family: {', '.join(family_names())}") from None
    return name, depth, adapter


def _selector_rows(depth: int | None, adapter: type[VisionLanguageModel]) -> list[dict[str, Any]]:
    """One row per registered selector: its option domains described for a model of ``depth`` layers, whether it
    runs on ``adapter``'s family and, if not, why (``VisionLanguageModel.selector_support``), and how where it runs
    on each of an image's grids (``runs_as``: ``per_grid_selectors``)."""
    from prune_audit.pruners import list_selectors, selector_class
    from prune_audit.pruners.base import option_defaults
    from prune_audit.pruners.options import option_domains
    from prune_audit.pruners.serving import serving_need

    support = adapter.selector_support()
    rows = []
    for name in list_selectors():
        cls = selector_class(name)
        defaults = option_defaults(cls)
        rows.append(
            {
                "name": name,
                "stage": cls.stage,
                "requires": sorted(cls.requires),
                "serving": serving_need(cls),
                "family": adapter.family,
                "runs": support[name] is None,
                "refusal": support[name],
                "runs_as": None if support[name] else adapter.per_grid_selectors.get(name),
                "options": defaults,
                "domains": {
                    key: domain.describe_for(depth, defaults[key]) for key, domain in option_domains(cls).items()
                },
                "docs": {key: _option_doc(cls, key) for key in defaults},
                "summary": cls.summary,
                "paper": cls.reference.paper,
                "repository": cls.reference.repository,
            }
        )
    return rows


def _option_doc(cls: type, key: str) -> str:
    import dataclasses

    return next(field.metadata.get("doc", "") for field in dataclasses.fields(cls) if field.name == key)


def _print_selectors(
    rows: list[dict[str, Any]], model: str, depth: int | None, adapter: type[VisionLanguageModel]
) -> None:
    """Each selector as a block of lines wrapped at word boundaries; option values as --option takes them."""
    from prune_audit.cli.terminal import Page
    from prune_audit.pruners.options import spell
    from prune_audit.pruners.serving import SERVING_NEEDS

    page = Page()
    scope = (
        f"{model} ({depth} decoder layers; another model: --model PATH or a family name)"
        if depth is not None
        else "any depth (a family name reads no checkpoint: --model PATH gives a model's layers)"
    )
    page.paragraph(
        f"{len(rows)} selectors. Options are passed as --option KEY=VALUE; allowed values are shown for {scope}."
    )
    runs = [row["name"] for row in rows if row["runs"]]
    page.paragraph(
        f"On {adapter.display_name} ({adapter.family}: {adapter.token_grids} per image, "
        f"{adapter.input_positions} positions after input-level selection) {len(runs)} run: "
        f"{', '.join(runs)}.",
        hang=4,
    )
    for row in rows:
        page.blank()
        needs = ", ".join(row["requires"]) or "nothing"
        page.paragraph(f"{row['name']}: {row['stage']} stage, needs {needs}", hang=4)
        verdict = (
            ("runs" + (f" ({row['runs_as']})" if row["runs_as"] else ""))
            if row["runs"]
            else (f"refused: {row['refusal']}")
        )
        page.paragraph(f"on {adapter.family}: {verdict}", indent=2, hang=4)
        page.paragraph(f"in a serving engine: needs {SERVING_NEEDS[row['serving']]}", indent=2, hang=4)
        if row["summary"]:
            page.paragraph(row["summary"], indent=2)
        page.paragraph(f"paper: {row['paper']}", indent=2, hang=4)
        page.paragraph(f"code: {row['repository']}", indent=2, hang=4)
        _print_options(page, row, spell)
    page.show()


def _print_options(page: Page, row: dict[str, Any], spell: Any) -> None:
    if not row["options"]:
        page.paragraph("options: none", indent=2)
        return
    page.paragraph("options (KEY=DEFAULT):", indent=2)
    for key, default in row["options"].items():
        page.paragraph(f"{key}={spell(default)}: {row['docs'][key] or key}", indent=4, hang=8)
        page.paragraph(f"allowed: {row['domains'][key]}", indent=8, hang=10)


def _print_fidelity(json_output: bool, markdown: bool) -> None:
    """The fidelity of every selector: a list on the terminal, the Markdown of docs/fidelity.md, or JSON."""
    import json

    from prune_audit.pruners.fidelity import NOT_YET_DONE, fidelity_entries, fidelity_markdown, fidelity_rows

    if json_output:
        print(json.dumps(fidelity_rows(), indent=2))
        return
    if markdown:
        print(fidelity_markdown(), end="")
        return
    from prune_audit.cli.terminal import Page

    page = Page()
    page.paragraph(
        "Fidelity of each selector to its official code (the table of docs/fidelity.md: --markdown; "
        "reference-exact options are passed as --option KEY=VALUE)."
    )
    entries = fidelity_entries()
    for row in fidelity_rows():
        page.blank()
        page.paragraph(row["selector"])
        for label, key in (
            ("paper", "paper"),
            ("official code", "official repository (commit read)"),
            ("default here", "default here"),
            ("reference-exact options", "reference-exact options"),
            ("measured agreement", "measured agreement"),
            ("fp16 / bf16 agreement", "fp16 / bf16 agreement"),
        ):
            page.paragraph(f"{label}: {row[key]}", indent=2, hang=4)
        page.paragraph("remaining differences:", indent=2)
        for difference in entries[row["selector"]].differences:
            page.paragraph(f"- {difference}", indent=4, hang=6)
    if NOT_YET_DONE:
        page.blank()
        page.paragraph("Not yet done:")
        for item in NOT_YET_DONE:
            page.paragraph(f"- {item}", indent=2, hang=4)
    page.show()
