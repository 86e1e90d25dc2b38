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
   noise (EAGLE's trick against the drift of drafting on its own predictions). With
   `--unroll N` (training-time test, as in HASS and EAGLE-3) the head is also trained the way
   it drafts: steps 2..N feed its own predicted features back, each new pair attending to the
   true pairs before it and to its own earlier predictions only, with the loss of step j
   weighted `unroll_decay`^(j-1). `--init DIR` starts from a trained head. Checkpoints to
   OUT/checkpoint.pt; the result (eagle.safetensors + specdec_eagle.json) loads with
   `--method eagle --draft OUT`.

Never trains on the evaluation sets: the data come from corpus.py, which refuses them.
"""

from __future__ import annotations

import random
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from ..types import SpecdecError
from .common import cosine_lr, load_checkpoint, load_shards, save_checkpoint
from .configs import EagleTrainConfig


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
    return load_shards(feats, f"no features in {feats}")


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


def unrolled_predictions(head, E, x_next, f_in, unroll: int = 1):
    """The head's predicted features for `unroll` drafting steps at every position at once.

    x_next [B, T] = x_{t+1}, f_in [B, T, D] = f_t; E the target's embedding. Step 1 is plain
    EAGLE: the pair (f_t, x_{t+1}) at position t, causal over the true pairs, predicts f_{t+1}.
    Step j > 1 is what drafting does j-1 tokens later: the pair (step j-1's prediction at t,
    x_{t+j}) at position t+j-1 attends to the true pairs 0..t and to the pairs of steps 2..j
    made at t (its ancestors in a draft), and predicts f_{t+j}. Returns [pred_1, ..., pred_unroll],
    each [B, T, D] (positions whose x_{t+j} lies past the end hold garbage)."""
    B, T = x_next.shape
    dev = x_next.device
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    x, q, k, v = head.qkv(F.embedding(x_next, E), f_in, pos)
    preds = [head.finish(x, q, k, v, causal=True)]
    keys, vals = [k], [v]
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(T, dtype=torch.bool, device=dev)
    for j in range(2, unroll + 1):
        tok = torch.zeros_like(x_next)
        tok[:, : T - j + 1] = x_next[:, j - 1 :]  # x_{t+j}
        x, q, k, v = head.qkv(F.embedding(tok, E), preds[-1], pos + j - 1)
        keys.append(k)
        vals.append(v)
        allowed = torch.cat([causal] + [eye] * (j - 1), dim=1)  # [T, j*T]
        preds.append(head.finish(x, q, torch.cat(keys, 2), torch.cat(vals, 2), mask=allowed[None, None]))
    return preds


def unrolled_loss(head, E, W, x_next, f_in, f_out, mask, unroll: int = 1, decay: float = 0.8):
    """Feature regression and token cross-entropy of `unroll` drafting steps
    (unrolled_predictions), step j weighted decay^(j-1); f_out = f_{t+1}, mask [B, T] valid
    positions, W the target's LM head rows over the vocabulary subset [S, D].
    Returns (regression, cross-entropy, [top-1 agreement with the target per step])."""
    T = x_next.shape[1]
    reg_sum = cls_sum = weight = 0.0
    tops = []
    for j, pred in enumerate(unrolled_predictions(head, E, x_next, f_in, unroll), start=1):
        valid = torch.zeros_like(mask)
        valid[:, : T - j + 1] = mask[:, j - 1 :]
        if not valid.any():
            break
        t = torch.zeros_like(f_out)
        t[:, : T - j + 1] = f_out[:, j - 1 :]
        p, t = pred[valid], t[valid]  # prediction of f_{t+j}, and f_{t+j}
        with torch.no_grad():
            target_p = (t @ W.T).softmax(-1)
        logq = (p @ W.T).log_softmax(-1)
        w = decay ** (j - 1)
        reg_sum = reg_sum + w * F.smooth_l1_loss(p, t)
        cls_sum = cls_sum + w * -(target_p * logq).sum(-1).mean()
        weight += w
        with torch.no_grad():
            tops.append((logq.argmax(-1) == target_p.argmax(-1)).float().mean().item())
    return reg_sum / weight, cls_sum / weight, tops


def train_step(head, opt, E, W, batch, cfg, gen: torch.Generator, lr: float, bf16: bool):
    """One optimiser step on batch = (x_next, f_in, f_out, mask) (on the head's device): noise
    on the input features, unrolled_loss under bf16 autocast if `bf16`, gradient clipping
    (cfg: anything with noise, cls_weight, unroll, unroll_decay: EagleTrainConfig, the GPU tool's).
    Returns (regression, cross-entropy, top-1 at step 1, top-1 at the last unrolled step)."""
    x_next, f_in, f_out, mask = batch
    for g in opt.param_groups:
        g["lr"] = lr
    noisy = f_in + (torch.rand(f_in.shape, generator=gen, device=f_in.device) - 0.5) * 2 * cfg.noise
    with torch.autocast(f_in.device.type, dtype=torch.bfloat16, enabled=bf16):
        reg, cls, tops = unrolled_loss(head, E, W, x_next, noisy, f_out, mask, cfg.unroll, cfg.unroll_decay)
    loss = reg + cfg.cls_weight * cls
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
    opt.step()
    return reg.item(), cls.item(), tops[0], tops[-1]


def _hf_state(target) -> dict:
    from ..models.loader import _read_state_dict

    if getattr(target.model, "gguf_native", False):  # a GGUF target: its last layer, dequantised
        return target.model.hf_layer_state(target.model.cfg.num_layers - 1)
    from ..models import families

    cfg = target.model.cfg
    if cfg.model_type in families.FAMILY_TYPES:  # (its last layer as a Llama layer reads it)
        return families.hf_llama_layer_state(cfg, _read_state_dict(Path(target.path)), cfg.num_layers - 1)
    return {k: v.float() for k, v in _read_state_dict(Path(target.path)).items()}


def _batches(rows, batch_rows: int, seq_len: int, rng: random.Random):
    idx = list(range(len(rows)))
    while True:
        rng.shuffle(idx)
        for s in range(0, len(idx) - batch_rows + 1, batch_rows):
            yield pack_windows([rows[i] for i in idx[s : s + batch_rows]], seq_len, rng)


def pack_windows(chosen, seq_len: int, rng: random.Random, device=None):
    """A random window of seq_len + 1 positions from each (tokens, features [L, D]) row (tokens
    a list or a LongTensor), padded into (x_next [B,T] = x_{t+1}, f_in [B,T,D] = f_t, f_out =
    f_{t+1}, mask [B,T] of valid positions) on `device`."""
    items = []
    for toks, f in chosen:
        L = len(toks)
        lo = rng.randint(0, max(0, L - seq_len - 1))
        items.append((toks[lo : lo + seq_len + 1], f[lo : lo + seq_len + 1]))
    T = max(len(t) for t, _ in items) - 1
    B, D = len(items), items[0][1].shape[1]
    x_next = torch.zeros(B, T, dtype=torch.long, device=device)
    f_in = torch.zeros(B, T, D, device=device)
    f_out = torch.zeros(B, T, D, device=device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    for b, (t, f) in enumerate(items):
        n = len(t) - 1
        if n <= 0:
            continue
        x_next[b, :n] = torch.as_tensor(t[1:])
        f_in[b, :n] = f[:-1].float()
        f_out[b, :n] = f[1:].float()
        mask[b, :n] = True
    return x_next, f_in, f_out, mask


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
    if cfg.init:
        from ..drafters.eagle import load_eagle

        start, _ = load_eagle(cfg.init, target)
        head.load_state_dict({k: v.float() for k, v in start.state_dict().items()})
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = out / "checkpoint.pt"
    step, ema, before = load_checkpoint(ckpt, "head", head, opt)
    rng = random.Random(cfg.seed + step)
    gen = torch.Generator().manual_seed(cfg.seed + step)
    stream = _batches(rows, cfg.batch_rows, cfg.seq_len, rng)
    from ..models.llama import cpu_has_bf16

    bf16 = cpu_has_bf16() if cfg.bf16 is None else cfg.bf16
    if bf16:  # rms_norm's weight stays fp32 under autocast: correct, only not fused
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    head.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="train eagle", disable=quiet, dynamic_ncols=True)
    t0 = time.perf_counter()
    while step < cfg.steps:
        lr = cosine_lr(step, cfg.steps, cfg.warmup, cfg.lr)
        cur = train_step(head, opt, E, W, next(stream), cfg, gen, lr, bf16)
        step += 1
        if ema is not None and len(ema) != len(cur):  # a checkpoint from before the last-step figure
            ema = tuple(ema) + (ema[-1],)
        ema = cur if ema is None else tuple(0.95 * a + 0.05 * b for a, b in zip(ema, cur))
        bar.set_postfix(reg=f"{ema[0]:.3f}", ce=f"{ema[1]:.3f}", top1=f"{ema[2]:.3f}",
                        **({f"top1@{cfg.unroll}": f"{ema[3]:.3f}"} if cfg.unroll > 1 else {}), lr=f"{lr:.1e}")
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
        "final": {"reg": round(ema[0], 4), "ce": round(ema[1], 4), "top1": round(ema[2], 4),
                  f"top1_step{cfg.unroll}": round(ema[-1], 4)} if ema else None,
        "train_seconds": round(before + time.perf_counter() - t0, 1),
        "saved_dtype": "bfloat16",
        "trained_in": "bfloat16 autocast" if bf16 else "float32",
    })
    return out
