"""Train an EAGLE head for a target (`specdec train eagle`).

Three resumable stages, each with a progress bar:

1. data: token sequences. Reuses the shards of `specdec train draft` (`--data DIR`: the
   target's own answers to instruction prompts built from local material, plus windows of
   the Python standard library and Debian docs), or collects them the same way into OUT/data.
2. features: the target runs over each sequence once (prefill only) and its final hidden
   states are stored in fp16, one file per data shard in OUT/features/ (streamed: a shard
   at a time is in memory; a shard already done is skipped).
3. train: the head (drafters/eagle.py: fc + one decoder layer initialised from the target's
   last layer) learns to predict f_{t+1} from (f_t, x_{t+1}): smooth-L1 on the feature plus
   `--cls-weight` x cross-entropy between the target head's distributions of the true and the
   predicted feature, over a frequency-ranked vocabulary subset. Input features get uniform
   noise (EAGLE's trick against the drift of drafting on its own predictions). Checkpoints to
   OUT/checkpoint.pt; the result (eagle.safetensors + specdec_eagle.json) loads with
   `--method eagle --draft OUT`.

Never trains on the evaluation sets: the data come from corpus.py, which refuses them.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..types import SpecdecError
from .common import cosine_lr, load_checkpoint, save_checkpoint


@dataclass
class EagleTrainConfig:
    steps: int = 900
    batch_rows: int = 16
    seq_len: int = 256
    lr: float = 3e-3  # with cls_weight 1.0: 53% one-step top-1 where 1e-3 / 0.1 (EAGLE's paper) gave 34%
    warmup: int = 30
    cls_weight: float = 1.0
    noise: float = 0.1
    head_vocab: int = 8192
    max_rows: int = 0  # 0 = every data row
    save_every: int = 50
    seed: int = 0


def extract_features(target, data: Path, feats: Path, seq_len: int, max_rows: int = 0, quiet: bool = False) -> None:
    """Stage 2: OUT/features/shard_NNNN.pt = list of (tokens, fp16 features [L, D])."""
    from tqdm import tqdm

    shards = sorted(data.glob("shard_*.pt"))
    if not shards:
        raise SpecdecError(f"no data shards in {data}; run `specdec train draft --stage collect --out DIR` "
                           "and pass --data DIR/data, or let `specdec train eagle` collect them")
    feats.mkdir(parents=True, exist_ok=True)
    model = target.model
    budget = max_rows or None
    bar = tqdm(total=len(shards), desc="features", unit="shard", disable=quiet, dynamic_ncols=True)
    seen = 0
    for sp in shards:
        out = feats / sp.name
        rows = torch.load(sp, weights_only=False)
        if budget is not None:
            rows = rows[: max(0, budget - seen)]
        seen += len(rows)
        if out.exists() or not rows:
            bar.update(1)
            continue
        seqs = [list(r[0])[-seq_len:] for r in rows]
        result = []
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        for s in range(0, len(order), 8):
            idx = order[s : s + 8]
            T = max(len(seqs[i]) for i in idx)
            toks = torch.zeros(len(idx), T, dtype=torch.long)
            for b, i in enumerate(idx):
                toks[b, : len(seqs[i])] = torch.tensor(seqs[i])
            cache = model.new_cache(len(idx), T)
            _, hidden = model(toks, torch.arange(T)[None].expand(len(idx), T), cache,
                              logits_at=torch.empty(len(idx), 0, dtype=torch.long))
            for b, i in enumerate(idx):
                result.append((seqs[i], hidden[b, : len(seqs[i])].to(torch.float16).clone()))
        tmp = out.with_suffix(".tmp")
        torch.save(result, tmp)
        tmp.replace(out)
        bar.update(1)
        if budget is not None and seen >= budget:
            break
    bar.close()


def _load_features(feats: Path) -> list:
    rows = []
    for p in sorted(feats.glob("shard_*.pt")):
        rows += torch.load(p, weights_only=False)
    if not rows:
        raise SpecdecError(f"no features in {feats}")
    return rows


def init_head(target):
    """An EagleHead initialised from the target's last decoder layer; fc passes the feature."""
    from ..drafters.eagle import head_from_target

    cfg = target.model.cfg
    head = head_from_target(cfg)
    src = _hf_state(target)
    last = cfg.num_layers - 1
    pre = f"model.layers.{last}."
    with torch.no_grad():
        q, k, v = (src[pre + f"self_attn.{n}_proj.weight"] for n in "qkv")
        head.wqkv.weight.copy_(torch.cat([q, k, v]))
        head.wo.weight.copy_(src[pre + "self_attn.o_proj.weight"])
        head.w_gate_up.weight.copy_(torch.cat([src[pre + "mlp.gate_proj.weight"], src[pre + "mlp.up_proj.weight"]]))
        head.w_down.weight.copy_(src[pre + "mlp.down_proj.weight"])
        head.attn_norm.copy_(src[pre + "input_layernorm.weight"])
        head.mlp_norm.copy_(src[pre + "post_attention_layernorm.weight"])
        D = cfg.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, D:] = torch.eye(D)
        head.fc.weight[:, :D].normal_(0, 0.02)
        head.fc.bias.zero_()
    return head.float()


def _hf_state(target) -> dict:
    from ..models.loader import _read_state_dict

    return {k: v.float() for k, v in _read_state_dict(Path(target.path)).items()}


def _batches(rows, batch_rows: int, seq_len: int, rng: random.Random):
    idx = list(range(len(rows)))
    while True:
        rng.shuffle(idx)
        for s in range(0, len(idx) - batch_rows + 1, batch_rows):
            chosen = [rows[i] for i in idx[s : s + batch_rows]]
            items = []
            for toks, f in chosen:
                L = len(toks)
                lo = rng.randint(0, max(0, L - seq_len - 1))
                items.append((toks[lo : lo + seq_len + 1], f[lo : lo + seq_len + 1]))
            T = max(len(t) for t, _ in items) - 1
            B, D = len(items), items[0][1].shape[1]
            x_next = torch.zeros(B, T, dtype=torch.long)  # x_{t+1}
            f_in = torch.zeros(B, T, D)  # f_t
            f_out = torch.zeros(B, T, D)  # f_{t+1}
            mask = torch.zeros(B, T, dtype=torch.bool)
            for b, (t, f) in enumerate(items):
                n = len(t) - 1
                if n <= 0:
                    continue
                x_next[b, :n] = torch.tensor(t[1:])
                f_in[b, :n] = f[:-1].float()
                f_out[b, :n] = f[1:].float()
                mask[b, :n] = True
            yield x_next, f_in, f_out, mask


def train_eagle(target, out: Path, cfg: EagleTrainConfig, data: Path | None = None, quiet: bool = False) -> Path:
    """Stages 2 and 3 (the caller provides data or runs collect first). Returns `out`."""
    from tqdm import tqdm

    from ..drafters.eagle import save_eagle, target_fingerprint
    from .distill import load_rows, vocab_subset

    data = data or out / "data"
    feats_dir = out / "features"
    extract_features(target, data, feats_dir, cfg.seq_len * 2, cfg.max_rows, quiet)
    rows = _load_features(feats_dir)
    subset = vocab_subset(load_rows(data), target.model.vocab_size, cfg.head_vocab, target.eos_ids)
    sub = torch.tensor(subset, dtype=torch.long)
    W = target.model.lm_head_weight().detach().float()[sub]  # [S, D], frozen
    E = target.model.embed.weight.detach().float()
    head = init_head(target)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = out / "checkpoint.pt"
    step, ema, before = load_checkpoint(ckpt, "head", head, opt)
    rng = random.Random(cfg.seed + step)
    gen = torch.Generator().manual_seed(cfg.seed + step)
    stream = _batches(rows, cfg.batch_rows, cfg.seq_len, rng)
    head.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="train eagle", disable=quiet, dynamic_ncols=True)
    t0 = time.perf_counter()
    while step < cfg.steps:
        x_next, f_in, f_out, mask = next(stream)
        lr = cosine_lr(step, cfg.steps, cfg.warmup, cfg.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        B, T = x_next.shape
        noisy = f_in + (torch.rand(f_in.shape, generator=gen) - 0.5) * 2 * cfg.noise
        pred = head(F.embedding(x_next, E), noisy, torch.arange(T)[None].expand(B, T))
        p, t = pred[mask], f_out[mask]
        reg = F.smooth_l1_loss(p, t)
        with torch.no_grad():
            target_p = (t @ W.T).softmax(-1)
        logq = (p @ W.T).log_softmax(-1)
        cls = -(target_p * logq).sum(-1).mean()
        loss = reg + cfg.cls_weight * cls
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        with torch.no_grad():
            top1 = (logq.argmax(-1) == target_p.argmax(-1)).float().mean().item()
        cur = (reg.item(), cls.item(), top1)
        ema = cur if ema is None else tuple(0.95 * a + 0.05 * b for a, b in zip(ema, cur))
        bar.set_postfix(reg=f"{ema[0]:.3f}", ce=f"{ema[1]:.3f}", top1=f"{ema[2]:.3f}", lr=f"{lr:.1e}")
        bar.update(1)
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt, "head", head, opt, step, ema, before + time.perf_counter() - t0)
    bar.close()
    head.eval()
    n_tokens = sum(len(t) for t, _ in rows)
    save_eagle(head.to(torch.bfloat16), out, {
        "kind": "EAGLE head",
        "target": target.name,
        "target_vocab_size": target.model.vocab_size,
        "target_fingerprint": target_fingerprint(target.model),
        "vocab_subset": subset,
        "train": asdict(cfg),
        "data": str(data),
        "feature_rows": len(rows),
        "feature_tokens": n_tokens,
        "final": {"reg": round(ema[0], 4), "ce": round(ema[1], 4), "top1": round(ema[2], 4)} if ema else None,
        "train_seconds": round(before + time.perf_counter() - t0, 1),
        "saved_dtype": "bfloat16",
    })
    return out
