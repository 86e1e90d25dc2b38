"""specdec: exact speculative decoding for PyTorch language models."""

__version__ = "0.1.0"
