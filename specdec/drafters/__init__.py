"""Draft sources: the protocol (`base`) and the built-in sources. Which method builds which
sources is specdec.methods' table; importing this package imports no source module."""

from .base import Draft, DraftContext, Drafter, Offer, RowInfo

__all__ = ["Draft", "DraftContext", "Drafter", "Offer", "RowInfo"]
