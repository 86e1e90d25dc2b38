"""How much to speculate: the online cost models behind every choice (docs/design.md, "The policy").

fits (step-time fit, drafting-time lines), acceptance (how often guesses hold), probing (when a
declined choice is tried again), guard (in a batch, speculate only while it measures faster) and
load (the one chooser: each step's cap and each row's source). Pure: counts and seconds in,
decisions out; nothing here knows about models, drafters or the scheduler.
"""

from .acceptance import CARRIED_COUNTS, Acceptance, Hindsight, NodeOdds, best_prefix, carried, counts_ok
from .fits import FIT_DECAY, DecayedLine, StepModel, band, ema
from .guard import BatchGuard
from .load import AFTER_STEPS, SETTLE_STEPS, Choice, LoadPolicy, Quote, SourceStats
from .probing import PROBE_EVERY, PROBE_ROOM, ProbeSchedule

__all__ = ["AFTER_STEPS", "CARRIED_COUNTS", "FIT_DECAY", "PROBE_EVERY", "PROBE_ROOM", "SETTLE_STEPS", "Acceptance",
           "BatchGuard", "Choice", "DecayedLine", "Hindsight", "LoadPolicy", "NodeOdds", "ProbeSchedule", "Quote",
           "SourceStats", "StepModel", "band", "best_prefix", "carried", "counts_ok", "ema"]
