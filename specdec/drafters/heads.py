"""What the head drafters (EAGLE, Medusa) share: the fingerprint of the target a head was trained
for, the check that refuses a head trained for another target, loading a head folder, and the
target's LM head rows over a head's vocabulary subset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..types import SpecdecError


def target_fingerprint(model, legacy: bool = False) -> str:
    """A short hash of the target's LM head (a head trained for it must see the same one).
    The sampled rows are rounded to bfloat16 first, so the same target loaded in float32 or
    bfloat16 (`--dtype`) gives the same hash; `legacy`: the hash of the unrounded rows, which
    older heads recorded."""
    if hasattr(model, "lm_head_rows"):  # (a GGUF model reads the sampled rows alone, not the whole table)
        rows, take = model.cfg.vocab_size, model.lm_head_rows
    else:
        w = model.lm_head_weight()
        rows, take = w.shape[0], w.__getitem__
    sample = take(torch.arange(0, rows, max(1, rows // 256))).detach().float().contiguous()
    if not legacy:
        sample = sample.to(torch.bfloat16).float()
    return hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]


def subset_head(target_model, vocab_subset) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the sorted vocabulary subset as ids or None, the target's LM head over it [S, D]): only the
    subset's rows are read (a GGUF target reads them from its file, with no float table of the
    whole vocabulary); the whole head without a subset."""
    if vocab_subset is None:
        return None, target_model.lm_head_weight().detach().contiguous()
    subset = torch.tensor(sorted(set(int(i) for i in vocab_subset)), dtype=torch.long)
    return subset, target_model.lm_head_rows(subset).detach().contiguous()


def check_trained_for(meta: dict, hidden: int, target, path, what: str, command: str) -> None:
    """Refuse a head whose recorded target differs from `target` (hidden size, vocabulary,
    or the hash of the LM head it was trained against)."""
    cfg = getattr(target.model, "cfg", None)
    if cfg is None:
        raise SpecdecError(f"a {what} needs a native target model (Llama family); this target runs through the "
                           "transformers adapter")
    problems = []
    if hidden != cfg.hidden_size:
        problems.append(f"hidden size {hidden} vs the target's {cfg.hidden_size}")
    if meta.get("target_vocab_size") != cfg.vocab_size:
        problems.append(f"vocabulary {meta.get('target_vocab_size')} vs the target's {cfg.vocab_size}")
    recorded = meta.get("target_fingerprint")
    if not problems and recorded not in (target_fingerprint(target.model), target_fingerprint(target.model, legacy=True)):
        problems.append("the target's weights differ from those it was trained on (LM-head hash "
                        f"{recorded} vs {target_fingerprint(target.model)})")
    if problems:
        raise SpecdecError(f"the {what} in {path} was trained for another target ({meta.get('target')}): "
                           + "; ".join(problems) + f". Train one for this model with `{command}`")


def load_head(path, target, meta_name: str, weights_name: str, build, hidden_of, what: str, command: str):
    """(module, meta) from a head folder: `meta_name` (JSON) and `weights_name` (safetensors);
    `build(meta)` makes the module, `hidden_of(meta)` is the hidden size it was trained for.
    Refuses a folder without the JSON, or a head trained for another target, with one line
    naming the training command."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / meta_name).is_file():
        raise SpecdecError(f"{path} is not {what} folder (no {meta_name}); train one with `{command} --out DIR`")
    meta = json.loads((path / meta_name).read_text())
    check_trained_for(meta, hidden_of(meta), target, path, what.split(" ", 1)[1], command)
    from ..models.llama import without_init

    with without_init():  # (every weight is loaded next: a random init would be thrown away)
        module = build(meta)
    module.load_state_dict(load_file(str(path / weights_name)))
    return module.to(target.model.dtype).eval(), meta
