"""The cost models that decide how much to speculate live in `specdec.core.policy`; this name
re-exports them for code that imports `specdec.adaptive`."""

from .core.policy import (  # noqa: F401
    CARRIED_COUNTS, FIT_DECAY, PROBE_EVERY, BatchGuard, DecayedLine, LoadPolicy, NodeOdds, StepModel,
    best_prefix, carried, counts_ok,
)
