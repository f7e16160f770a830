"""How every `edgefinfer` entry point runs its click command (the CLI, `python -m edgefinfer.distill`,
`python -m edgefinfer.app.serve_command`)."""

from __future__ import annotations

import click

from edgefinfer.errors import UserError


def run_command(command, argv: list[str] | None = None, prog_name: str | None = None) -> int:
    """Run a click command the way every edgefinfer entry point does: a user error, bad option or
    Ctrl-C prints one line (exit 2, or 130 when interrupted); a bug keeps its traceback."""
    try:
        command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        return 2
    except click.UsageError as e:
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        return 2
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        return 2
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        return 130
    return 0
