"""Train Medusa heads for a target (`specdec train medusa`).

Uses the same data and feature stages as `specdec train eagle` (train/eagle.py): the
target's fp16 final hidden states for local text, one file per shard. Head i learns, from
f_t, the target's distribution of x_{t+1+i} (the softmax of the target head at f_{t+i}),
by cross-entropy over the frequency-ranked vocabulary subset; the target stays frozen.
Afterwards the per-head top-k accuracies against the target's own argmax are measured on
held-out rows (the last 5% of the data) and the static tree is chosen from them
(drafters/medusa.choose_tree). Resumable checkpoints in OUT/checkpoint.pt.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..types import SpecdecError
from .common import cosine_lr, load_checkpoint, save_checkpoint
from .configs import MedusaTrainConfig


def _targets(f, W, H):
    """Soft labels per head: [T-H, H, S] = softmax(W f_{t+i}) for i = 1..H."""
    T = f.shape[0] - H
    return torch.stack([(f[i : i + T] @ W.T).softmax(-1) for i in range(1, H + 1)], 1)


def train_medusa(target, out: Path, cfg: MedusaTrainConfig, data: Path, features: Path | None = None,
                 quiet: bool = False) -> Path:
    from tqdm import tqdm

    from ..drafters.eagle import target_fingerprint
    from ..drafters.medusa import MedusaHeads, choose_tree, save_medusa
    from .distill import load_rows, vocab_subset
    from .eagle import _load_features, extract_features

    feats_dir = features or out / "features"
    if features is None:
        extract_features(target, data, feats_dir, cfg.seq_len * 2, cfg.max_rows, quiet)
    elif not any(feats_dir.glob("shard_*.pt")):
        raise SpecdecError(f"--features {feats_dir} holds no feature shards (make them with `specdec train eagle`)")
    rows = [r for r in _load_features(feats_dir) if len(r[0]) > cfg.num_heads + 2]
    if len(rows) < 20:
        raise SpecdecError(f"too little data to train Medusa heads ({len(rows)} usable rows)")
    n_val = max(1, len(rows) // 20)
    train_rows, val_rows = rows[:-n_val], rows[-n_val:]
    subset = vocab_subset(load_rows(data), target.model.vocab_size, cfg.head_vocab, target.eos_ids)
    W = target.model.lm_head_weight().detach().float()[torch.tensor(subset)]
    H = cfg.num_heads
    heads = MedusaHeads(target.model.cfg.hidden_size, H)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    ckpt = out / "checkpoint.pt"
    out.mkdir(parents=True, exist_ok=True)
    step, ema, before = load_checkpoint(ckpt, "heads", heads, opt)
    rng = random.Random(cfg.seed + step)
    bar = tqdm(total=cfg.steps, initial=step, desc="train medusa", disable=quiet, dynamic_ncols=True)
    t0 = time.perf_counter()
    heads.train()
    while step < cfg.steps:
        lr = cosine_lr(step, cfg.steps, cfg.warmup, cfg.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        fs, ps = [], []
        for toks, f in rng.sample(train_rows, min(cfg.batch_rows, len(train_rows))):
            lo = rng.randint(0, max(0, len(toks) - cfg.seq_len - H))
            f = f[lo : lo + cfg.seq_len + H].float()
            with torch.no_grad():
                ps.append(_targets(f, W, H))
            fs.append(f[: f.shape[0] - H])
        f = torch.cat(fs)  # [M, D]
        p = torch.cat(ps)  # [M, H, S]
        logq = (heads(f) @ W.T).log_softmax(-1)  # [M, H, S]
        per_head = -(p * logq).sum(-1).mean(0)  # [H]
        loss = (per_head * torch.tensor([0.8**i for i in range(H)])).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}")
        bar.update(1)
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt, "heads", heads, opt, step, ema, before + time.perf_counter() - t0)
    bar.close()
    heads.eval()
    acc = measure_accuracy(heads, val_rows, W, cfg.topk)
    tree = choose_tree(acc, cfg.tree_nodes)
    save_medusa(heads.to(torch.bfloat16), out, {
        "kind": "Medusa heads", "target": target.name, "target_vocab_size": target.model.vocab_size,
        "target_fingerprint": target_fingerprint(target.model), "vocab_subset": subset,
        "accuracy": acc, "tree": [list(t) for t in tree], "train": asdict(cfg), "data": str(data),
        "final_loss": round(ema, 4) if ema else None, "train_seconds": round(before + time.perf_counter() - t0, 1),
    })
    return out


@torch.no_grad()
def measure_accuracy(heads, rows, W, topk: int) -> list[list[float]]:
    """acc[i][r]: share of held-out positions where head i's r-th guess is the target's argmax."""
    H = heads.num_heads
    hits = torch.zeros(H, topk)
    n = 0
    for _, f in rows:
        f = f.float()
        T = f.shape[0] - H
        if T <= 0:
            continue
        label = torch.stack([(f[i : i + T] @ W.T).argmax(-1) for i in range(1, H + 1)], 1)  # [T, H]
        guess = (heads(f[:T].to(heads.proj[0].weight.dtype)).float() @ W.T).topk(topk, dim=-1).indices  # [T, H, k]
        hits += (guess == label[:, :, None]).float().sum(0)
        n += T
    return (hits / max(n, 1)).tolist()
