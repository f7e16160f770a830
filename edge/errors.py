"""User-facing errors, and the options a user picks from a closed set.

A `UserError` is something the user can fix (a missing file, a bad option, an unsupported
architecture). The CLI prints its message on one line and exits with code 2, without a traceback
(`edgefinfer.app.entry_point.run_command`).
Anything else is a bug and keeps its traceback.

A `UserChoice` is an option's closed set of values (a KV layout, ONNX weights, a QNN scheme): parsed
once where the user's text enters, with a UserError for a name outside it, and passed on as a member.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Self


class UserError(Exception):
    """An error caused by the user's input; the message says what is wrong and how to fix it."""


class UserChoice(StrEnum):
    """A closed set of names a user picks one from (an option's value): `parse` turns their text into
    a member once, where it enters, or raises a one-line UserError naming the accepted ones. A
    StrEnum, so a member is written (JSON, metadata, cache keys) as its name; a subclass says what it
    is by overriding `refusal`."""

    @classmethod
    def parse(cls, text: str | Self) -> Self:
        try:
            return cls(text)
        except ValueError:
            raise UserError(cls.refusal(text)) from None

    @classmethod
    def refusal(cls, text: object) -> str:
        """Why `text` names no member, on one line."""
        return f"unknown {cls.__name__} {text!r}: use one of {', '.join(cls)}"
