"""Small pieces shared by the training commands: the learning-rate schedule, the
resumable checkpoint (module + optimizer + step + running figures + seconds spent) and the
data shards the collect stages write."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..types import SpecdecError


def cosine_lr(step: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warm-up to `peak`, then a cosine decay to 0 at `steps`."""
    return peak * min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * step / steps))


def load_checkpoint(path: Path, key: str, module, opt) -> tuple[int, object, float]:
    """(step, ema, seconds) from `path` if it exists (restoring module and optimizer), else (0, None, 0)."""
    if not path.exists():
        return 0, None, 0.0
    state = torch.load(path, weights_only=False)
    module.load_state_dict(state[key])
    opt.load_state_dict(state["opt"])
    return state["step"], state.get("ema"), state.get("seconds", 0.0)


def save_checkpoint(path: Path, key: str, module, opt, step: int, ema, seconds: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({key: module.state_dict(), "opt": opt.state_dict(), "step": step, "ema": ema, "seconds": seconds}, tmp)
    tmp.replace(path)


def load_shards(folder: Path, missing: str) -> list:
    """Every row of the `shard_*.pt` files in `folder`, in shard order; SpecdecError(missing)
    when there are none."""
    rows = []
    for p in sorted(folder.glob("shard_*.pt")):
        rows += torch.load(p, weights_only=False)
    if not rows:
        raise SpecdecError(missing)
    return rows
