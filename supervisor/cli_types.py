"""Click parameter types the commands share: Finite, a finite number in a
range (seconds, a rate), and POSITIVE, a finite number above zero."""

from __future__ import annotations

import math
from typing import Any

import click


class Finite(click.FloatRange):
    """A finite number (no nan, no inf) in a range: seconds, or a rate."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


POSITIVE = Finite(min=0, min_open=True)
