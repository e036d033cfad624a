"""argparse ``type=`` functions for the numeric flags of every process.

Each raises ``argparse.ArgumentTypeError``, so argparse prints its message
(a plain ``ValueError`` would be reported as "invalid ... value" alone).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_in(low: int, high: int | None = None, *, meaning: str | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when ``high`` is None); ``meaning`` names the
    range in the error ("must be {meaning}, got N") instead of the bounds."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = meaning or (f">= {low}" if high is None else f"in [{low}, {high}]")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def finite_float(low: float, *, inclusive: bool) -> Callable[[str], float]:
    """A finite number above ``low`` (or at least ``low`` when ``inclusive``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (low <= value if inclusive else low < value) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if inclusive else '>'} {low:g}, "
                                             f"got {text}")
        return value
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
tcp_port = int_in(1, 65535, meaning="a TCP port (1-65535)")
positive_float = finite_float(0, inclusive=False)
non_negative_float = finite_float(0, inclusive=True)
