#!/usr/bin/env python3
"""Train an EAGLE head on one CUDA GPU in a single time-boxed run.

`specdec train eagle` is built for CPUs: the target writes its training answers a few
rows at a time and the head trains a few hundred small steps an hour. On a GPU the same
recipe runs at a scale that matters, in one process:

1. generate: the target answers prompts in large batches (transformers' `generate`, fp32
   with TF32 matmuls), alternating greedy and sampled (T 0.8, top-p 0.95) batches, until
   `--gen-seconds` are spent. Prompts: user turns the target writes itself (Magpie-style,
   as `specdec train draft --self-prompts`), and the chat / code prompts of `--prompts`
   (a JSON file written by `--export-prompts` from local material: never the evaluation
   sets). Code prompts are continued as raw text, chat prompts through the chat template.
2. features: one fp32 forward (TF32 off) per batch of sequences gives the target's final
   normed hidden state at every position, kept on the GPU in fp16. Token sequences from
   `--tokens` (written by `--export-tokens` from `specdec train draft` shards) join here.
3. train: the head (init from `--init`, else from the target's last layer) trains with
   `specdec train eagle`'s loss (specdec.train.eagle.unrolled_loss: feature regression +
   cross-entropy over the vocabulary subset, `--unroll` drafting steps, input noise) in
   bf16 autocast for `--train-seconds`, with a cosine schedule that runs on the clock
   (warm-up in steps, then the fraction of the time spent). Top-1 agreement per drafting step on held-out rows is printed before and
   after. The head is saved to OUT (eagle.safetensors + specdec_eagle.json, loadable with
   `--method eagle --draft OUT`) every `--save-seconds` and at the end, so a run cut short
   still leaves a head. The generated token sequences go to OUT/gen_tokens.pt.

What it does not know: anything about CPUs (it needs CUDA, except `--device cpu` for a
dry run), the evaluation sets (it never reads them), multi-GPU.

    # on the development machine
    python tools/eagle_gpu.py --export-prompts prompts.json
    python tools/eagle_gpu.py --export-tokens DRAFT/data tokens.pt
    # on the GPU machine
    python tools/eagle_gpu.py --model SmolLM2-135M-Instruct.Q4_1.gguf --init HEAD \\
        --prompts prompts.json --tokens tokens.pt --out OUT --gen-seconds 150 --train-seconds 270
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class GpuEagleConfig:
    gen_seconds: float = 150.0
    gen_batch: int = 384
    max_new_tokens: int = 320
    max_prompt_tokens: int = 768
    self_prompt_tokens: int = 96
    train_seconds: float = 270.0
    batch_rows: int = 48
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 100
    cls_weight: float = 1.0
    noise: float = 0.1
    unroll: int = 5
    unroll_decay: float = 0.8
    head_vocab: int = 8192
    holdout: float = 0.015
    seed: int = 1


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- preparation on the development machine ---------------------------------------------------
def export_prompts(out: Path, seed: int, chat: int, generic: int, code: int) -> None:
    from specdec.train import corpus

    prompts = {"chat": corpus.instruction_prompts(seed, chat) + corpus.generic_prompts(seed, generic),
               "code": corpus.code_completion_prompts(seed, code, per_file=4)}
    random.Random(seed).shuffle(prompts["chat"])
    out.write_text(json.dumps(prompts))
    log(f"{len(prompts['chat'])} chat and {len(prompts['code'])} code prompts -> {out}")


def export_tokens(data: Path, out: Path) -> None:
    seqs = []
    for p in sorted(data.glob("shard_*.pt")):
        seqs += [list(r[0]) for r in torch.load(p, weights_only=False)]
    if not seqs:
        raise SystemExit(f"no shard_*.pt rows in {data}")
    save_tokens(seqs, out)
    log(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens -> {out}")


def save_tokens(seqs: list[list[int]], path: Path) -> None:
    """lens + the tokens concatenated, as uint16 where the ids fit (half the bytes)."""
    import numpy as np

    flat = np.array([t for s in seqs for t in s], dtype=np.int64)
    small = flat.size == 0 or flat.max() < 65536
    torch.save({"lens": torch.tensor([len(s) for s in seqs]),
                "tokens": flat.astype(np.uint16 if small else np.int32)}, path)


def tiny_target(tokenizer_dir: Path, out: Path) -> Path:
    """A randomly initialised 2-layer Llama with the tokenizer of `tokenizer_dir`, for a dry
    run of the whole pipeline in seconds (checks the device path, learns nothing useful)."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def read_tokens(path: Path) -> list[list[int]]:
    d = torch.load(path, weights_only=False)
    flat = [int(t) for t in d["tokens"].tolist()]
    out, at = [], 0
    for n in d["lens"].tolist():
        out.append(flat[at : at + n])
        at += n
    return out


# -- generation --------------------------------------------------------------------------------
@torch.no_grad()
def hf_generate(hf, prompts: list[list[int]], max_new: int, sample: bool, stop: set[int], pad: int,
                temperature: float = 0.8, top_p: float = 0.95) -> list[tuple[list[int], list[int], bool]]:
    """Left-padded batched generation; returns (prompt, generated up to and including the first
    stop token, whether a stop token came)."""
    dev = next(hf.parameters()).device
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if sample else dict(do_sample=False)
    out = hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new,
                      eos_token_id=sorted(stop), pad_token_id=pad, **kw)
    res = []
    for p, g in zip(prompts, out[:, T:].tolist()):
        end = next((i for i, t in enumerate(g) if t in stop), None)
        res.append((p, g if end is None else g[: end + 1], end is not None))
    return res


def self_prompt_texts(hf, tok, eos_ids, n: int, max_tokens: int, pad: int) -> list[str]:
    """User turns the target writes itself (see specdec.train.distill._self_prompts)."""
    from specdec.train.distill import user_turn_frame

    pre, stop = user_turn_frame(tok, eos_ids)
    res = hf_generate(hf, [pre] * n, max_tokens, True, stop, pad, temperature=1.0, top_p=0.95)
    return [tok.decode(g[:-1]).strip() for _, g, ended in res if ended and len(g) >= 4]


def generate_data(hf, target, prompts: dict, cfg: GpuEagleConfig) -> tuple[list[list[int]], dict]:
    from specdec.text import encode_prompt

    tok = target.tokenizer
    eos = set(int(e) for e in target.eos_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    chat = iter(prompts.get("chat", []))
    code = iter(prompts.get("code", []))
    kinds = itertools.cycle(["self", "chat", "self", "code"])
    seqs: list[list[int]] = []
    stats = {"batches": 0, "rows": 0, "tokens": 0, "by_kind": {}}
    t0 = time.perf_counter()
    sample = False
    while time.perf_counter() - t0 < cfg.gen_seconds:
        kind = next(kinds)
        if kind == "self":
            texts = self_prompt_texts(hf, tok, eos, cfg.gen_batch, cfg.self_prompt_tokens, pad)
            enc = [encode_prompt(tok, t, None) for t in texts]
        else:
            texts = list(itertools.islice(chat if kind == "chat" else code, cfg.gen_batch))
            enc = [encode_prompt(tok, t, None if kind == "chat" else False) for t in texts]
        enc = [e[-cfg.max_prompt_tokens:] for e in enc if e]
        if not enc:  # this kind's prompts are used up (or no self-written turn ended)
            continue
        enc.sort(key=len)
        mode = "sampled" if sample else "greedy"
        res = hf_generate(hf, enc, cfg.max_new_tokens, sample, eos, pad)
        sample = not sample
        new = [p + g for p, g, _ in res if len(g) >= 2]
        seqs += new
        n_tok = sum(len(g) for _, g, _ in res)
        k = stats["by_kind"].setdefault(kind, {"rows": 0, "generated": 0})
        k["rows"] += len(new)
        k["generated"] += n_tok
        stats["batches"] += 1
        stats["rows"] += len(new)
        stats["tokens"] += sum(map(len, new))
        log(f"generate batch {stats['batches']} ({kind}, {mode}): {len(new)} rows, "
            f"{n_tok} new tokens; {stats['rows']} rows / {stats['tokens']} tokens in "
            f"{time.perf_counter() - t0:.0f} s")
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    return seqs, stats


# -- features ----------------------------------------------------------------------------------
@torch.no_grad()
def features(hf, seqs: list[list[int]], max_len: int, token_budget: int = 65536):
    """[(tokens LongTensor [L], fp16 features [L, D])] on the GPU, fp32 forward without TF32."""
    dev = next(hf.parameters()).device
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    seqs = [s[-max_len:] for s in seqs if len(s) >= 2]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = [None] * len(seqs)
    s = 0
    while s < len(order):
        e = s
        while e < len(order) and (e - s + 1) * len(seqs[order[e]]) <= token_budget:
            e += 1
        e = max(e, s + 1)
        idx = order[s:e]
        T = max(len(seqs[i]) for i in idx)
        toks = torch.zeros(len(idx), T, dtype=torch.long)
        for b, i in enumerate(idx):
            toks[b, : len(seqs[i])] = torch.tensor(seqs[i])
        toks = toks.to(dev)
        # right padding under a causal mask: real positions never see the pads
        h = hf.model(input_ids=toks).last_hidden_state
        for b, i in enumerate(idx):
            n = len(seqs[i])
            out[i] = (toks[b, :n].clone(), h[b, :n].to(torch.float16).clone())
        s = e
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


# -- training ----------------------------------------------------------------------------------
def clock_lr(step: int, frac: float, warmup: int, peak: float) -> float:
    """Linear warm-up over `warmup` steps, then a cosine to 0 as `frac` (time spent / budget) -> 1."""
    return peak * min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def make_batch(rows, idx, seq_len: int, rng: random.Random, dev):
    from specdec.train.eagle import pack_windows

    return pack_windows([rows[i] for i in idx], seq_len, rng, dev)


@torch.no_grad()
def evaluate(head, E, W, rows, cfg: GpuEagleConfig, dev) -> list[float]:
    from specdec.train.eagle import unrolled_loss

    head.eval()
    rng = random.Random(0)
    sums, n = None, 0
    for s in range(0, len(rows), cfg.batch_rows):
        idx = list(range(s, min(len(rows), s + cfg.batch_rows)))
        x_next, f_in, f_out, mask = make_batch(rows, idx, cfg.seq_len, rng, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            _, _, tops = unrolled_loss(head, E, W, x_next, f_in, f_out, mask, cfg.unroll, cfg.unroll_decay)
        sums = tops if sums is None else [a + b for a, b in zip(sums, tops)]
        n += 1
    head.train()
    return [round(a / n, 4) for a in sums]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export-prompts", metavar="FILE", help="write chat/code prompts from local material and exit")
    ap.add_argument("--export-tokens", nargs=2, metavar=("DATA_DIR", "FILE"),
                    help="write the token sequences of `specdec train draft` shards and exit")
    ap.add_argument("--prompt-counts", default="3072,1024,4096", help="chat,generic,code prompts for --export-prompts")
    ap.add_argument("--model", help="target (anything specdec loads: GGUF, HF folder). Default: the embedded default")
    ap.add_argument("--init", help="EAGLE head folder to start from (same target)")
    ap.add_argument("--prompts", help="JSON from --export-prompts")
    ap.add_argument("--tokens", action="append", default=[], help="token file from --export-tokens (repeatable)")
    ap.add_argument("--out", help="output head folder")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny-target", metavar="TOKENIZER_DIR",
                    help="dry run: a random 2-layer target with this tokenizer instead of --model")
    for f, v in asdict(GpuEagleConfig()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--save-seconds", type=float, default=90.0)
    ap.add_argument("--target-name", help="name recorded in the head's metadata (default: the loaded model's)")
    args = ap.parse_args()
    cfg = GpuEagleConfig(**{f: getattr(args, f) for f in asdict(GpuEagleConfig())})

    if args.export_prompts:
        chat, generic, code = (int(x) for x in args.prompt_counts.split(","))
        export_prompts(Path(args.export_prompts), cfg.seed, chat, generic, code)
        return 0
    if args.export_tokens:
        export_tokens(Path(args.export_tokens[0]), Path(args.export_tokens[1]))
        return 0
    if not args.out:
        ap.error("--out is required for training (or use --export-prompts / --export-tokens)")

    from safetensors.torch import load_file

    from specdec.drafters.eagle import EAGLE_META, EAGLE_WEIGHTS, save_eagle, target_fingerprint
    from specdec.models.loader import load_model
    from specdec.train.eagle import init_head, train_step

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("eagle_gpu: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU "
                         "machine, or pass --device cpu for a (slow) dry run")
    for f in [args.prompts, args.init, *args.tokens]:
        if f and not Path(f).exists():
            raise SystemExit(f"eagle_gpu: {f} does not exist")
    t_all = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny_target:
        args.model = str(tiny_target(Path(args.tiny_target), out / "tiny_target"))
    target = load_model(args.model, quiet=False)
    fp = target_fingerprint(target.model)
    log(f"target {target.name} from {target.path}; LM-head fingerprint {fp}; device {dev} "
        f"({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), torch {torch.__version__}")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).to(dev).eval()

    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else {}
    new, gen_stats = generate_data(hf, target, prompts, cfg)
    save_tokens(new, out / "gen_tokens.pt")
    old = [s for p in args.tokens for s in read_tokens(Path(p))]
    log(f"generated {len(new)} sequences ({gen_stats['tokens']} tokens); {len(old)} sequences from --tokens")

    t0 = time.perf_counter()
    rows = features(hf, old + new, max_len=2 * cfg.seq_len)
    n_tokens = sum(t.shape[0] for t, _ in rows)
    log(f"features of {len(rows)} rows / {n_tokens} tokens in {time.perf_counter() - t0:.0f} s")
    del hf
    torch.cuda.empty_cache() if dev.type == "cuda" else None

    V = target.model.vocab_size
    counts = torch.zeros(V, dtype=torch.long, device=dev)
    for t, _ in rows:
        counts += torch.bincount(t, minlength=V)
    eos = torch.tensor(sorted(set(int(e) for e in target.eos_ids)), dtype=torch.long, device=dev)
    counts[eos] = counts.max() + 1
    subset = sorted(int(i) for i in counts.topk(min(cfg.head_vocab, V)).indices.tolist())
    sub = torch.tensor(subset, dtype=torch.long)
    W = target.model.lm_head_weight().detach().float()[sub].to(dev)
    E = target.model.embed.weight.detach().float().to(dev)

    rng = random.Random(cfg.seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    n_hold = max(1, int(len(rows) * cfg.holdout))
    held = [rows[i] for i in order[:n_hold]]
    train_rows = [rows[i] for i in order[n_hold:]]

    head = init_head(target)
    init_meta = {}
    if args.init:  # read directly: a fingerprint that differs only here is reported, not fatal
        init_meta = json.loads((Path(args.init) / EAGLE_META).read_text())
        head.load_state_dict({k: v.float() for k, v in load_file(str(Path(args.init) / EAGLE_WEIGHTS)).items()})
        log(f"init from {args.init}: its fingerprint {init_meta.get('target_fingerprint')}, this target's {fp}")
    head = head.to(dev).float()
    before = evaluate(head, E, W, held, cfg, dev)
    log(f"held-out top-1 per drafting step before: {before}")

    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    meta_base = {
        "kind": "EAGLE head",
        "target": args.target_name or init_meta.get("target") or target.name,
        "target_vocab_size": V,
        "target_fingerprint": fp,
        "vocab_subset": subset,
        "train": {**asdict(cfg), "init": args.init, "tool": "tools/eagle_gpu.py"},
        "data": {"generated": gen_stats, "from_tokens_files": len(old), "prompts": args.prompts},
        "feature_rows": len(rows),
        "feature_tokens": n_tokens,
        "saved_dtype": "bfloat16",
        "trained_in": f"bfloat16 autocast on {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}",
    }

    def save(step, ema, after=None):
        h = copy.deepcopy(head).to(torch.bfloat16).cpu().eval()
        save_eagle(h, out, {**meta_base, "steps_done": step,
                            "final": {"reg": round(ema[0], 4), "ce": round(ema[1], 4), "top1": round(ema[2], 4),
                                      f"top1_step{cfg.unroll}": round(ema[3], 4)} if ema else None,
                            "heldout_top1_before": before, "heldout_top1_after": after,
                            "train_seconds": round(time.perf_counter() - t_train, 1)})

    # the schedule runs on the clock (warm-up in steps, then a cosine over the fraction of
    # --train-seconds spent): a step count estimated from the first steps was 3-6x too low
    # on the GPU, whose first steps include kernel selection and warm-up
    t_train = time.perf_counter()
    step, ema, last_save = 0, None, time.perf_counter()
    head.train()
    while (spent := time.perf_counter() - t_train) < cfg.train_seconds:
        idx = [rng.randrange(len(train_rows)) for _ in range(cfg.batch_rows)]
        lr = clock_lr(step, spent / cfg.train_seconds, cfg.warmup, cfg.lr)
        cur = train_step(head, opt, E, W, make_batch(train_rows, idx, cfg.seq_len, rng, dev), cfg, gen, lr, True)
        step += 1
        ema = cur if ema is None else tuple(0.98 * a + 0.02 * b for a, b in zip(ema, cur))
        if step % 100 == 0:
            log(f"step {step} ({spent:.0f} s): reg {ema[0]:.3f} ce {ema[1]:.3f} "
                f"top1 {ema[2]:.3f} top1@{cfg.unroll} {ema[3]:.3f} lr {lr:.1e}")
        if time.perf_counter() - last_save > args.save_seconds:
            save(step, ema)
            last_save = time.perf_counter()
    after = evaluate(head, E, W, held, cfg, dev)
    log(f"held-out top-1 per drafting step after: {after} (before: {before})")
    save(step, ema, after)
    log(f"saved {out}; whole run {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
