"""Distil a small draft model from a target (`specdec train draft`).

Two stages, both resumable and both with progress bars:

1. collect: the target labels local text with its own next-token distributions, kept
   sparse (top-K log-probabilities per position):
   - chat: the target *answers* instruction prompts built from local material
     (corpus.instruction_prompts), half greedy, half sampled; each generated position
     keeps the target's distribution from the decode step that produced it (no extra
     forward), so the draft learns what the target says, on its own outputs;
   - text: windows of the Python standard library's sources and Debian's docs, scored by
     one target forward each (every position labelled).
   Shards go to OUT/data/shard_NNNN.pt; a shard that exists is not recomputed.
2. train: a small Llama (same tokenizer, tied embeddings, initialised from a projection
   of the target's embedding) minimises the cross-entropy to the target's top-K
   distribution, with its output head restricted to a frequency-ranked subset of the
   vocabulary (still exact at decode time: q is simply 0 elsewhere). Checkpoints to
   OUT/checkpoint.pt; the result is a Hugging Face folder in OUT that `--draft OUT` loads,
   with `specdec_draft.json` naming the target, the vocabulary subset and the recipe.

Never trains on the evaluation sets (corpus.check_not_eval guards the paths).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..types import SpecdecError
from . import corpus
from .common import cosine_lr, load_checkpoint, load_shards, save_checkpoint
from .configs import CollectConfig, StudentConfig, TrainConfig

DRAFT_META = "specdec_draft.json"


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="row", disable=quiet, dynamic_ncols=True)


def _topk(logits: torch.Tensor, k: int):
    logp = logits.float().log_softmax(-1)
    v, i = logp.topk(k, dim=-1)
    return i.to(torch.int32), v.to(torch.float16)


# -- stage 1: collect ------------------------------------------------------------------------
def _chat_rows(target, prompts: list[str], greedy: bool, cfg: CollectConfig, gen: torch.Generator,
               chat: bool | None = None):
    """Answer prompts with the target (batched); yield (tokens, labelled_from, topk ids, topk logp).
    chat=False continues the raw text (code completion) instead of using the chat template."""
    from ..sampling import sample
    from ..text import encode_prompt

    model, tok = target.model, target.tokenizer
    enc = [encode_prompt(tok, p, chat)[-(cfg.seq_len * 4):] for p in prompts]
    B = len(enc)
    lens = torch.tensor([len(e) for e in enc])
    T = int(lens.max())
    cache = model.new_cache(B, T + cfg.max_new_tokens + 1)
    toks = torch.zeros(B, T, dtype=torch.long)
    for b, e in enumerate(enc):
        toks[b, : len(e)] = torch.tensor(e)
    logits, _ = model(toks, torch.arange(T)[None].expand(B, T), cache, logits_at=(lens - 1)[:, None])
    cache.truncate(lens)
    logits = logits[:, 0]
    outs = [[] for _ in range(B)]
    ids_k = [[] for _ in range(B)]
    lp_k = [[] for _ in range(B)]
    done = [False] * B
    eos = set(target.eos_ids)
    for _ in range(cfg.max_new_tokens):
        ki, kv = _topk(logits, cfg.topk)
        if greedy:
            nxt = logits.argmax(-1)
        else:
            nxt = sample((logits.float() / 0.8).softmax(-1), gen)
        for b in range(B):
            if not done[b]:
                outs[b].append(int(nxt[b]))
                ids_k[b].append(ki[b])
                lp_k[b].append(kv[b])
                done[b] = int(nxt[b]) in eos
        if all(done):
            break
        pos = cache.lengths[:, None].clone()
        logits, _ = model(nxt[:, None], pos, cache)
        logits = logits[:, 0]
    for b in range(B):
        if outs[b]:
            yield enc[b] + outs[b], len(enc[b]), torch.stack(ids_k[b]), torch.stack(lp_k[b])


def user_turn_frame(tok, eos_ids) -> tuple[list[int], set[int]]:
    """Where a self-written user turn starts and ends in the chat template: the token ids up
    to the start of a user message, and the ids that end one (EOS and the first token after
    the message)."""
    from ..text import has_chat_template

    if not has_chat_template(tok):
        raise SpecdecError("--self-prompts needs a target whose tokenizer has a chat template")
    mark = "\x00USER\x00"
    rendered = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True)
    if mark not in rendered:
        raise SpecdecError("cannot find where a user turn starts in this tokenizer's chat template")
    prefix, suffix = rendered.split(mark, 1)
    pre = [int(i) for i in tok.encode(prefix, add_special_tokens=False)]
    end_ids = set(int(e) for e in eos_ids)
    suffix_ids = tok.encode(suffix, add_special_tokens=False)
    if suffix_ids:
        end_ids.add(int(suffix_ids[0]))
    return pre, end_ids


def _self_prompts(target, n: int, cfg: CollectConfig, gen: torch.Generator) -> list[str]:
    """User turns written by the target itself: the chat template up to where a user message
    starts, sampled (temperature 1, top-p 0.95) until the turn ends (the idea of Magpie, Xu et
    al. 2024: an instruction-tuned model's prompts follow the distribution it was tuned on, so
    its answers to them cover what users ask without any outside data). Turns that do not end
    within `self_prompt_tokens` or are shorter than 3 tokens are dropped, so fewer than n may
    come back."""
    from ..sampling import sample

    model = target.model
    tok = target.tokenizer
    pre, end_ids = user_turn_frame(tok, target.eos_ids)
    B, T, L = n, len(pre), cfg.self_prompt_tokens
    cache = model.new_cache(B, T + L + 1)
    toks = torch.tensor(pre)[None].expand(B, T).contiguous()
    logits, _ = model(toks, torch.arange(T)[None].expand(B, T), cache, logits_at=torch.full((B, 1), T - 1))
    logits = logits[:, 0]
    outs: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for _ in range(L):
        probs = logits.float().softmax(-1)
        sp, si = probs.sort(-1, descending=True)
        sp[(sp.cumsum(-1) - sp) > 0.95] = 0  # top-p 0.95
        nxt = si.gather(-1, sample(sp / sp.sum(-1, keepdim=True), gen)[:, None])[:, 0]
        for b in range(B):
            if not done[b]:
                t = int(nxt[b])
                done[b] = t in end_ids
                if not done[b]:
                    outs[b].append(t)
        if all(done):
            break
        logits, _ = model(nxt[:, None], cache.lengths[:, None].clone(), cache)
        logits = logits[:, 0]
    return [tok.decode(o).strip() for o, d in zip(outs, done) if d and len(o) >= 3]


def _text_windows(tokenizer, cfg: CollectConfig, rng: random.Random) -> list[list[int]]:
    if cfg.text_windows <= 0:
        return []
    files = corpus.stdlib_files()
    docs = corpus.doc_files()
    pool = [(p, 0.7) for p in files] + [(p, 0.3) for p in docs]
    windows = []
    order = rng.sample(pool, len(pool))
    for path, _ in order:
        text = corpus.read_text(path)
        if not text or len(text) < 200:
            continue
        ids = tokenizer.encode(text)
        if len(ids) < 64:
            continue
        start = rng.randrange(0, max(1, len(ids) - cfg.seq_len))
        windows.append(ids[start : start + cfg.seq_len])
        if len(windows) >= cfg.text_windows:
            break
    return windows


def collect(target, out: Path, cfg: CollectConfig, quiet: bool = False, pool=None) -> Path:
    """Stage 1 (see module docstring). Returns the data folder. pool: answers the prompts' shards
    elsewhere (distributed.ray_collect.AnswerPool: on Ray actors, for `train --ray`); its owner
    closes it."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "collect.json").write_text(json.dumps(asdict(cfg), indent=1))
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = corpus.instruction_prompts(cfg.seed, cfg.chat_prompts)

    def shard_path(i):
        return data / f"shard_{i:04d}.pt"

    def answer(prompts: list[str], names: list[str], desc: str, chat: bool | None) -> None:
        """Shards of the target's answers, shard_rows prompts each, alternating greedy and
        sampled batches; a shard that exists is skipped."""
        bar = _progress(len(prompts), desc, quiet)
        if pool is not None:  # on Ray actors (greedy batches equal; sampled ones seeded per shard)
            shards = [(name, prompts[s : s + cfg.shard_rows]) for name, s in zip(names, range(0, len(prompts), cfg.shard_rows))]
            bar.update(sum(len(p) for name, p in shards if (data / name).exists()))
            pool.answer(data, [(name, p) for name, p in shards if not (data / name).exists()], chat, bar)
            bar.close()
            return
        for name, s in zip(names, range(0, len(prompts), cfg.shard_rows)):
            chunk = prompts[s : s + cfg.shard_rows]
            if (data / name).exists():
                bar.update(len(chunk))
                continue
            rows = []
            for j in range(0, len(chunk), cfg.chat_batch):
                greedy = (j // cfg.chat_batch) % 2 == 0
                rows += list(_chat_rows(target, chunk[j : j + cfg.chat_batch], greedy, cfg, gen, chat))
                bar.update(len(chunk[j : j + cfg.chat_batch]))
            torch.save(rows, data / name)
        bar.close()

    def n_shards(n: int) -> int:
        return -(-n // cfg.shard_rows)

    answer(prompts, [shard_path(i).name for i in range(n_shards(len(prompts)))], "collect chat", None)
    shard_id = n_shards(len(prompts))
    # open-ended chat and raw code completion, in shards of their own (added to the recipe
    # later, so they must not shift the numbering of the other shards)
    for prefix, extra, chat, desc in (
        ("g", corpus.generic_prompts(cfg.seed, cfg.generic_prompts), None, "collect chat (open)"),
        ("c", corpus.code_completion_prompts(cfg.seed, cfg.code_prompts, body_lines=cfg.code_body_lines), False, "collect code"),
    ):
        answer(extra, [f"shard_{prefix}{n:04d}.pt" for n in range(n_shards(len(extra)))], desc, chat)
    # self-written prompts: each shard's prompts come from a generator seeded by the shard's
    # number, so a resumed run writes the same shards
    todo = [n for n in range(n_shards(cfg.self_prompts)) if not (data / f"shard_m{n:04d}.pt").exists()]
    bar = _progress(sum(min(cfg.shard_rows, cfg.self_prompts - n * cfg.shard_rows) for n in todo),
                    "write prompts", quiet) if todo else None
    for n in todo:
        want = min(cfg.shard_rows, cfg.self_prompts - n * cfg.shard_rows)
        g = torch.Generator().manual_seed(cfg.seed * 100_003 + n)
        written: list[str] = []
        for j in range(0, want, cfg.chat_batch):
            written += _self_prompts(target, min(cfg.chat_batch, want - j), cfg, g)
            bar.update(min(cfg.chat_batch, want - j))
        if written:
            answer(written, [f"shard_m{n:04d}.pt"], f"answer prompts {n + 1}/{n_shards(cfg.self_prompts)}", None)
        else:  # no turn ended in time: an empty shard, so a resumed run does not retry it
            torch.save([], data / f"shard_m{n:04d}.pt")
    if bar is not None:
        bar.close()

    windows = _text_windows(target.tokenizer, cfg, rng)
    bar = _progress(len(windows), "collect text", quiet)
    for s in range(0, len(windows), cfg.shard_rows):
        p = shard_path(shard_id)
        shard_id += 1
        chunk = windows[s : s + cfg.shard_rows]
        if p.exists():
            bar.update(len(chunk))
            continue
        rows = []
        for j in range(0, len(chunk), cfg.text_batch):
            part = chunk[j : j + cfg.text_batch]
            B, T = len(part), max(len(w) for w in part)
            toks = torch.zeros(B, T, dtype=torch.long)
            for b, w in enumerate(part):
                toks[b, : len(w)] = torch.tensor(w)
            cache = target.model.new_cache(B, T)
            logits, _ = target.model(toks, torch.arange(T)[None].expand(B, T), cache)
            ki, kv = _topk(logits, cfg.topk)
            for b, w in enumerate(part):
                # position t's distribution predicts token t+1: label tokens 1..len-1
                rows.append((w, 1, ki[b, : len(w) - 1], kv[b, : len(w) - 1]))
            bar.update(B)
        torch.save(rows, p)
    bar.close()
    return data


def load_rows(data: Path) -> list:
    return load_shards(data, f"no training data in {data}; run the collect stage first")


# -- stage 2: train ----------------------------------------------------------------------------
def vocab_subset(rows, target_vocab: int, size: int, always: list[int]) -> list[int]:
    """The `size` token ids the target most often puts first or labels in the data."""
    counts = torch.zeros(target_vocab, dtype=torch.long)
    for tokens, start, ki, _ in rows:
        counts += torch.bincount(torch.tensor(tokens[start:], dtype=torch.long), minlength=target_vocab)
        counts += torch.bincount(ki[:, :4].reshape(-1).long(), minlength=target_vocab)
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    top = counts.topk(min(size, target_vocab)).indices
    return sorted(int(i) for i in top)


def build_student(target, scfg: StudentConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.hf_config
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    cfg = LlamaConfig(
        vocab_size=target.model.vocab_size,
        hidden_size=scfg.hidden_size,
        intermediate_size=scfg.intermediate_size,
        num_hidden_layers=scfg.num_layers,
        num_attention_heads=scfg.num_heads,
        num_key_value_heads=scfg.num_kv_heads,
        max_position_embeddings=scfg.max_position,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
        tie_word_embeddings=True,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None),
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    student = LlamaForCausalLM(cfg)
    # embedding init: the target's embedding projected on its top principal directions
    with torch.no_grad():
        E = target.model.embed.weight.float()
        _, _, V = torch.linalg.svd(E - E.mean(0), full_matrices=False)
        proj = E @ V[: scfg.hidden_size].T  # [vocab, hidden]
        proj = proj / proj.std() * 0.02  # the usual init scale, the target's geometry
        student.model.embed_tokens.weight.copy_(proj)
    return student


def _batches(rows, batch_rows: int, seq_len: int, rng: random.Random):
    """Endless stream of (tokens [B,T], label ids [B,T,K], label logp [B,T,K], mask [B,T])."""
    idx = list(range(len(rows)))
    while True:
        rng.shuffle(idx)
        for s in range(0, len(idx) - batch_rows + 1, batch_rows):
            chosen = [rows[i] for i in idx[s : s + batch_rows]]
            items = []
            for tokens, start, ki, kv in chosen:
                # the window keeps the tail: every response label plus as much prompt as fits
                hi = len(tokens) - 1  # the last token is never an input that has a label
                lo = max(0, hi - seq_len)
                items.append((tokens[lo:hi], start - 1 - lo, ki, kv, hi))
            T = max(len(t) for t, *_ in items)
            K = items[0][2].shape[-1]
            B = len(items)
            toks = torch.zeros(B, T, dtype=torch.long)
            lab_i = torch.zeros(B, T, K, dtype=torch.long)
            lab_v = torch.full((B, T, K), -1e4, dtype=torch.float32)
            mask = torch.zeros(B, T, dtype=torch.bool)
            for b, (t, first, ki, kv, hi) in enumerate(items):
                toks[b, : len(t)] = torch.tensor(t)
                # label row j of ki covers position (start-1)+j in the original sequence
                n = ki.shape[0]
                for_pos = torch.arange(n) + first  # positions within the window
                keep = (for_pos >= 0) & (for_pos < len(t))
                fp = for_pos[keep]
                lab_i[b, fp] = ki[keep].long()
                lab_v[b, fp] = kv[keep].float()
                mask[b, fp] = True
            yield toks, lab_i, lab_v, mask


def read_init(init: Path, target) -> tuple[StudentConfig, dict]:
    """(its shape, its specdec_draft.json) of a draft folder to fine-tune from (`--init`), checked
    to be a draft `specdec train draft` wrote for a target of this vocabulary."""
    meta_path = init / DRAFT_META
    if not (init / "config.json").is_file() or not meta_path.is_file():
        raise SpecdecError(f"--init {init}: not a draft folder from `specdec train draft` (needs config.json and "
                           f"{DRAFT_META})")
    try:
        meta = json.loads(meta_path.read_text())
        scfg = StudentConfig(**meta["student"])
    except (ValueError, KeyError, TypeError) as e:
        raise SpecdecError(f"--init {init}: cannot read the draft's shape from {DRAFT_META} ({e})") from None
    if meta.get("target_vocab_size") not in (None, target.model.vocab_size):
        raise SpecdecError(f"--init {init}: drafted for a vocabulary of {meta['target_vocab_size']} tokens, "
                           f"this target has {target.model.vocab_size}")
    return scfg, meta


def _load_init(student, init: Path) -> None:
    """The weights of the draft folder `init` (read_init checked it) into `student` (same shape)."""
    from transformers import LlamaForCausalLM

    src = LlamaForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    missing, unexpected = student.load_state_dict(src.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:  # (the head is the tied embedding)
        raise SpecdecError(f"--init {init}: its weights do not fit the student ({len(missing)} missing, "
                           f"{len(unexpected)} unexpected)")
    student.tie_weights()


def train(target, out: Path, scfg: StudentConfig, tcfg: TrainConfig, seq_len: int = 256, quiet: bool = False,
          save_dtype: torch.dtype = torch.float32, init: Path | None = None):
    """Stage 2 (see module docstring). Returns the output folder. init: a draft folder to start from
    (fine-tuning it on this data; scfg must be its shape, see read_init) unless a checkpoint in `out`
    resumes the run."""
    from tqdm import tqdm

    rows = load_rows(out / "data")
    subset = vocab_subset(rows, target.model.vocab_size, scfg.head_vocab, target.eos_ids)
    sub = torch.tensor(subset, dtype=torch.long)
    remap = torch.full((target.model.vocab_size,), -1, dtype=torch.long)
    remap[sub] = torch.arange(len(subset))
    student = build_student(target, scfg)
    opt = torch.optim.AdamW(student.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.98))
    ckpt = out / "checkpoint.pt"
    step, ema, before = load_checkpoint(ckpt, "student", student, opt)
    init_meta = None
    if init is not None:
        init_meta = read_init(init, target)[1]
        if step == 0:
            _load_init(student, init)
    rng = random.Random(tcfg.seed + step)
    stream = _batches(rows, tcfg.batch_rows, seq_len, rng)
    student.train()
    bar = tqdm(total=tcfg.steps, initial=step, desc="train draft", disable=quiet, dynamic_ncols=True)
    t0 = time.perf_counter()
    while step < tcfg.steps:
        toks, lab_i, lab_v, mask = next(stream)
        lr = cosine_lr(step, tcfg.steps, tcfg.warmup, tcfg.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        hidden = student.model(input_ids=toks).last_hidden_state  # [B, T, H]
        h = hidden[mask]  # [M, H]
        logits = h @ student.lm_head.weight[sub].T  # [M, S]
        logq = logits.float().log_softmax(-1)
        li, lv = lab_i[mask], lab_v[mask]  # [M, K]
        j = remap[li]  # [M, K] index into the subset, -1 outside
        p = lv.exp() * (j >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        loss = -(p * logq.gather(1, j.clamp_min(0))).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            top1 = (logq.argmax(-1) == j[:, 0]).float().mean().item()
        ema = (loss.item(), top1) if ema is None else (0.95 * ema[0] + 0.05 * loss.item(), 0.95 * ema[1] + 0.05 * top1)
        bar.set_postfix(loss=f"{ema[0]:.3f}", top1=f"{ema[1]:.3f}", lr=f"{lr:.1e}")
        bar.update(1)
        if step % tcfg.save_every == 0 or step == tcfg.steps:
            save_checkpoint(ckpt, "student", student, opt, step, ema, before + time.perf_counter() - t0)
    bar.close()
    save_draft(student, target, out, subset, scfg, tcfg, ema, before + time.perf_counter() - t0, save_dtype,
               None if init is None else {"path": str(init), **{k: init_meta.get(k) for k in INIT_KEYS}})
    return out


INIT_KEYS = ("train", "collect", "final_train_loss", "final_train_top1", "recipe", "recipe_notes", "init")


def save_draft(student, target, out: Path, subset, scfg, tcfg, ema, seconds: float,
               save_dtype: torch.dtype = torch.float32, init: dict | None = None) -> None:
    """Write the draft as a Hugging Face folder (weights in save_dtype; loaders cast them to
    the target's dtype) plus specdec_draft.json (with `init`: what the draft it was fine-tuned
    from says about itself)."""
    student.eval()
    student.to(save_dtype).save_pretrained(str(out), safe_serialization=True)
    student.float()
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(out))
    collect_cfg = json.loads((out / "data" / "collect.json").read_text()) if (out / "data" / "collect.json").exists() else {}
    meta = {
        "kind": "distilled draft model",
        "target": target.name,
        "target_vocab_size": target.model.vocab_size,
        "vocab_subset": subset,
        "student": asdict(scfg),
        "train": asdict(tcfg),
        "collect": collect_cfg,
        "final_train_loss": round(ema[0], 4) if ema else None,
        "final_train_top1": round(ema[1], 4) if ema else None,
        "train_seconds": round(seconds, 1),
        "saved_dtype": str(save_dtype).replace("torch.", ""),
    }
    if init is not None:
        meta["init"] = init
    (out / DRAFT_META).write_text(json.dumps(meta))
