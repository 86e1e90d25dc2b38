"""The `--weights` choice (what a model's matrix products compute with) and its check, apart
from the loader so that the CLI's parser reads them without importing torch."""

from __future__ import annotations

from ..types import SpecdecError


WEIGHTS = ("auto", "blocks", "fp32", "int16", "int8")
WEIGHTS_HELP = (
    "what a model's matrix products compute with. A GGUF file (and the default model) always "
    "computes from its own quantised blocks (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
    "Q5_K, Q6_K) through the row-stable kernels, with no fp32 copy: auto or blocks; fp32, int16 "
    "and int8 are refused there. A Hugging Face folder computes with its float weights (auto)")


def check_weights_choice(weights: str, is_gguf: bool) -> None:
    """One clear error for a --weights choice that does not apply to this model."""
    if weights not in WEIGHTS:
        raise SpecdecError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if is_gguf and weights not in ("auto", "blocks"):
        raise SpecdecError(f"--weights {weights}: a GGUF model computes from its own blocks (no fp32 copy, no "
                           "integer re-packing); use --weights auto")
    if weights in ("int16", "int8"):
        raise SpecdecError(f"--weights {weights}: no model runs on the integer kernels now (a GGUF file computes from "
                           "its blocks on the row-stable kernels, a Hugging Face folder with its float weights); "
                           "use --weights auto")
    if not is_gguf and weights not in ("auto", "fp32"):
        raise SpecdecError(f"--weights {weights} needs a GGUF model (--model FILE.gguf or the default model)")
