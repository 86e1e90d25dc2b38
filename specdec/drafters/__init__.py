"""Drafting methods. Importing this package fills `REGISTRY` (method name -> factory)."""

from . import draft_model, eagle, hybrid, medusa, ngram  # noqa: F401  (registration side effects)
from .base import REGISTRY, Draft, DraftContext, Drafter

__all__ = ["REGISTRY", "Draft", "DraftContext", "Drafter"]
