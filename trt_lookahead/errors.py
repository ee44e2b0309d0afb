"""UserError: bad input from a user; the CLI prints its message on one line and exits 2.

`as_int` and `as_float` are the type checks every layer shares (a bool is not a number here).
"""

from __future__ import annotations

import math
import numbers


class UserError(ValueError):
    """A problem with what the user asked for; the message names the problem and the fix. `field`: the argument it
    is about, where it is one argument (the OpenAI server names the request's field from it)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def as_int(name: str, value: object, field: str | None = None) -> int:
    """`value` as an int if it is an integer (Python or numpy, not a bool); else UserError naming `name` (its
    `field` that argument, `name` unless given)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name} must be an integer, got {value!r}", field=field or name)
    return int(value)


def as_float(name: str, value: object) -> float:
    """`value` as a finite float if it is a real number (not a bool); else UserError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"{name} must be a finite number, got {value!r}", field=name)
    return float(value)
