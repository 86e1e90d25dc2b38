"""specdec: exact speculative decoding for PyTorch language models.

    import specdec

    spec = specdec.load()  # the embedded default model, --method auto
    out = spec.generate("Name three rivers.", max_new_tokens=32)
    print(out.text, out.stats.tau)

`load` returns a `Speculator` (specdec.api); `SpecConfig` (specdec.config) holds every setting.
Importing the package loads nothing heavy: torch and the model code load on first use.
"""

__version__ = "0.1.0"
__all__ = ["Completion", "SpecConfig", "Speculator", "SpecdecError", "load"]


def load(model=None, draft=None, method="auto", **settings):
    """A Speculator for `model` with `method` and `draft`: see specdec.api.load."""
    from .api import load as load_speculator

    return load_speculator(model, draft, method, **settings)


def __getattr__(name: str):
    if name in ("Completion", "Speculator"):
        from . import api

        return getattr(api, name)
    if name == "SpecConfig":
        from .config import SpecConfig

        return SpecConfig
    if name == "SpecdecError":
        from .types import SpecdecError

        return SpecdecError
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
