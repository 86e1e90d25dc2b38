"""Drafting methods. `REGISTRY` maps a method name to its factory, importing the method's module
on first use (`base.METHODS`)."""

from .base import METHODS, REGISTRY, Draft, DraftContext, Drafter, register

__all__ = ["METHODS", "REGISTRY", "Draft", "DraftContext", "Drafter", "register"]
