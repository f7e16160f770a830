"""User-facing errors.

A `UserError` is something the user can fix (a missing file, a bad option, an unsupported
architecture). The CLI prints its message on one line and exits with code 2, without a traceback.
Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by the user's input; the message says what is wrong and how to fix it."""


def run_command(command, argv: list[str] | None = None, prog_name: str | None = None) -> int:
    """Run a click command the way every edgefinfer entry point does: a user error, bad option or
    Ctrl-C prints one line (exit 2, or 130 when interrupted); a bug keeps its traceback."""
    import click

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
