"""The ``prune-audit`` command line. Start-up imports only typer (no torch)."""

from __future__ import annotations

from typing import Annotated

import typer

from prune_audit.cli import calibrate as calibrate_cli
from prune_audit.cli import cascade as cascade_cli
from prune_audit.cli import demo as demo_cli
from prune_audit.cli import fitprune as fitprune_cli
from prune_audit.cli import interchange as interchange_cli
from prune_audit.cli import intervene as intervene_cli
from prune_audit.cli import pope as pope_cli
from prune_audit.cli import reproduce as reproduce_cli
from prune_audit.cli import run as run_cli
from prune_audit.cli import score as score_cli
from prune_audit.cli import selectors as selectors_cli
from prune_audit.cli import study as study_cli
from prune_audit.cli import visualize as visualize_cli
from prune_audit.cli.help_text import TaskListingCommand, unwrap_help

app = typer.Typer(
    name="prune-audit",
    help="Audit visual-token pruning in vision-language models: which tokens a pruner keeps, "
    "whether the queried object survives, and whether the pruned model's confidence is still usable.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from prune_audit import __version__

        print(f"prune-audit {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Options before the command (the group's help text is the Typer app's)."""


app.command("selectors")(selectors_cli.selectors)
app.command("run", cls=TaskListingCommand)(run_cli.run)
app.command("merge")(run_cli.merge)
app.command("visualize")(visualize_cli.visualize)
app.command("calibrate")(calibrate_cli.calibrate)
app.command("cascade")(cascade_cli.cascade)
app.command("intervene")(intervene_cli.intervene)
app.command("study", cls=TaskListingCommand)(study_cli.study)
app.command("score", cls=TaskListingCommand)(score_cli.score)
app.command("reproduce")(reproduce_cli.reproduce)
app.command("export")(interchange_cli.export)
app.command("import")(interchange_cli.import_)
app.add_typer(pope_cli.app, name="pope")
app.add_typer(demo_cli.app, name="demo")
app.add_typer(fitprune_cli.app, name="fitprune")


@app.command("version")
def version() -> None:
    """Print the prune-audit version."""
    from prune_audit import __version__

    print(__version__)


unwrap_help(app)

if __name__ == "__main__":
    app()
