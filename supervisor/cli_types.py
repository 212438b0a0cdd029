"""Click parameter types the commands share: Finite, a finite number in a
range (seconds, a rate), and POSITIVE, a finite number above zero; and
the options of seconds and of counts."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import click
from click.decorators import FC

# A plain decimal (blanks around it are ignored): float() alone would also
# take "1_0" (as 10), non-ASCII digits ("\u0661" as 1), "inf" and "nan".
DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


class Finite(click.FloatRange):
    """A finite number (no nan, no inf) in a range: seconds, or a rate.
    Given as text, a plain decimal (DECIMAL), as the variables that hold
    seconds are read (supervisor/entrypoint/config.py)."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not DECIMAL.fullmatch(value.strip()):
            self.fail(f"{value!r} is not a decimal number.", param, ctx)
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


POSITIVE = Finite(min=0, min_open=True)


def seconds_option(
    name: str, default: float, help: str, kind: Finite = POSITIVE
) -> Callable[[FC], FC]:
    """A finite number of seconds (above zero unless kind says otherwise)."""
    return click.option(name, default=default, show_default=True, type=kind, help=help)


def count_option(name: str, default: int, help: str, minimum: int = 1) -> Callable[[FC], FC]:
    """A whole number, at least minimum: connections, errors, containers."""
    counts = click.IntRange(min=minimum)
    return click.option(name, default=default, show_default=True, type=counts, help=help)
