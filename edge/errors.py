"""User-facing errors.

A `UserError` is something the user can fix (a missing file, a bad option, an unsupported
architecture). The CLI prints its message on one line and exits with code 2, without a traceback
(`edgefinfer.app.entry_point.run_command`).
Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by the user's input; the message says what is wrong and how to fix it."""
