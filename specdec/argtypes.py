"""argparse value types of specdec's flags: whole numbers in a range, numbers in [0, 1). Each
refuses a bad value with one line that says what was expected (OneLineParser prints it)."""

from __future__ import annotations

import argparse

from .types import MAX_GUESSES


def int_at_least(lowest: int, highest: int | None = None):
    """An argparse type: a whole number >= lowest (and <= highest, if given)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
        if v < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {v}")
        if highest is not None and v > highest:
            raise argparse.ArgumentTypeError(f"must be <= {highest}, got {v}")
        return v

    return parse


def unit_interval(s: str) -> float:
    """An argparse type: a number in [0, 1)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {s!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {s}")
    return v


def positive_float(s: str) -> float:
    """An argparse type: a finite number > 0 (seconds)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0.0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)
guesses = int_at_least(0, MAX_GUESSES)
one_to_max_guesses = int_at_least(1, MAX_GUESSES)  # --tree-nodes, --tree-depth
