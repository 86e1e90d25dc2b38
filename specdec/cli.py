"""The `specdec` command line. Subcommands: generate, train (draft, eagle, medusa), bench, serve, validate.

The flags are parsed by specdec.flags; each command turns them into a `SpecConfig` and builds
its engine with specdec.config's builder. The CLI does the I/O (prompts, files, terminal,
JSON); the engine does the decoding.
Every user mistake ends in one `specdec: error: ...` line and exit status 2, never a
traceback (set SPECDEC_DEBUG=1 to see one for internal errors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from . import learned, threads
from .config import SpecConfig, build_engine, load_target
from .methods import DEFAULT_K, DEFAULT_TREE_NODES, METHODS, parse_variant, variant_config
from .distributed import wants_ray
from .flags import build_parser
from .prompts import encode_prompts, prompt_where, read_prompts
from .text import check_text
from .types import SpecdecError

__all__ = ["build_parser", "main"]


def cmd_serve(args) -> int:
    import logging

    from .config import build_batcher
    from .server.app import app_settings, create_app

    if wants_ray(args):
        from .distributed.ray_serve import serve_on_ray

        return serve_on_ray(args)
    cfg = SpecConfig.from_args(args)
    threads.start(cfg.threads)
    lm, batcher = build_batcher(cfg)
    threads.settle()  # the free cores, measured while loading (the batcher may call threads.tick per step)
    if args.log_level == "debug":  # one line per step: batch size, draft cap, guesses, accepted, time, sources
        log = logging.getLogger("specdec.batcher")
        log.setLevel(logging.DEBUG)
        if not log.handlers:  # nothing configures the root logger: without a handler the lines went nowhere
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("DEBUG:    [specdec] %(message)s"))
            log.addHandler(handler)
        log.propagate = False
        batcher.log = log
    app = create_app(lm, batcher, args.served_model_name or lm.name, **app_settings(args))
    print(f"[specdec] serving {lm.name} on http://{args.host}:{args.port}/v1 (method {batcher.method}, "
          f"max batch {args.max_batch})", file=sys.stderr)
    from .server.runner import serve

    serve(app, batcher, args.host, args.port, args.log_level, drain_timeout=args.drain_timeout)
    if cfg.suffix_cache:  # (the answers of this run, for the next server to draft from)
        from .drafters.suffix import save_cache

        save_cache(cfg.suffix_cache, lm.tokenizer)
    return 0


def cmd_bench(args) -> int:
    import torch

    from .bench.peers import PEERS, RemotePeer, build_peers, close_peers
    from .bench.report import format_table, write
    from .bench.runner import Runner, machine_info, run
    from .bench.tasks import load_humaneval, load_jsonl, select
    from .drafters.eagle import default_eagle_for
    from .models.loader import default_draft_for
    from .text import encode_prompt

    cfg = SpecConfig.from_args(args)  # (bad sampling values fail here, before anything loads)
    params = cfg.sampling
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise SpecdecError(f"--methods {args.methods!r} names no method; choose from {', '.join(METHODS)}")
    for m in methods:
        parse_variant(m)  # an unknown method or option fails here, before anything loads
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
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_target(cfg, args.quiet)
    runners, ks = [], {}
    drafts = {"draft": args.draft, "auto": args.draft, "eagle": args.eagle, "medusa": args.medusa,
              "auto-draft": args.draft or default_draft_for(target), "auto-eagle": args.eagle or default_eagle_for(target)}
    for m in methods:
        try:
            variant = variant_config(cfg, m, drafts)
            eng = build_engine(variant, target, args.quiet)
        except SpecdecError as e:
            runners.append(Runner(m, "specdec", None, str(e)))
            continue
        if eng.k:
            ks[m] = eng.k
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
    built = build_peers(peers, target, draft_dir, cfg.method_k("ngram"), torch.get_num_threads(), n_ctx,
                        args.peer_timeout)
    for p in built:
        runners.append(Runner(p.name, "peer", None if p.error else (lambda ids, prm, p=p: (p.generate(ids, prm), None)),
                              p.error, (lambda p=p: p.last_memory) if isinstance(p, RemotePeer) else None))
    try:
        result = run(runners, tasks, encoded, params, args.repeats, args.quiet)
    finally:
        close_peers(built)
    cmd = "specdec " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("specdec") else "specdec bench ..."
    result.update({
        "benchmark": "specdec bench", "command": cmd, "model": target.name,
        "k": ks,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "repeats": args.repeats,
        "machine": machine_info(torch.get_num_threads()), "tasks": args.tasks or ["humaneval"], "prompts": len(tasks),
    })
    print(format_table(result))
    if out is not None:
        files = write(result, out, cmd)
        print(f"wrote {', '.join(files)} to {args.out}", file=sys.stderr)
    print(json.dumps(result))
    return 0


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


VALIDATE_METHODS = ("ngram", "draft", "auto", "eagle", "eagle:tree=off", "medusa", "medusa:tree=off")
# --quick: the server's default (auto: prompt lookup + the EAGLE head where the target has one) and
# prompt lookup alone, what other frameworks run; the heads alone rarely beat auto and are left out
QUICK_METHODS = ("ngram", "auto")


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

    from .bench.runner import machine_info
    from .engine import Engine
    from .validate import measure, pipeline, report
    from .validate.samples import load_samples, read_samples

    q = args.quick
    pick = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    max_new = pick(args.max_new_tokens, 128, 64)
    if not 0 < args.dist_temperature < float("inf"):
        raise SpecdecError(f"--dist-temperature must be a finite number > 0 (the check samples), "
                           f"got {args.dist_temperature}")
    explicit = args.methods is not None
    methods = [m.strip() for m in (args.methods or (",".join(QUICK_METHODS) if q else ",".join(VALIDATE_METHODS)))
               .split(",") if m.strip()]
    if not methods:
        raise SpecdecError(f"--methods {args.methods!r} names no method; choose from {', '.join(VALIDATE_METHODS)}")
    for m in methods:
        if parse_variant(m)[0] == "none":
            raise SpecdecError("validate compares every method with plain decoding already; leave 'none' out of "
                               f"--methods (choose from {', '.join(VALIDATE_METHODS)})")
    k_list = _csv_ints(args.k_list, "--k") if args.k_list else None
    conc_text = args.concurrency or ("1,4" if q else "1,2,4,8,16")
    levels = [] if conc_text.strip() == "none" else _csv_ints(conc_text, "--concurrency")
    read_samples(args.data)  # a malformed file fails before the model loads
    out = writable_dir(args.out)
    # no prefix cache: validate sends its samples again and again, and times their prefills as a newcomer's
    # (the prompts' numbers are the same with it or without: prefix_cache.py)
    cfg = SpecConfig.from_args(args).replace(prefix_cache_mb=0)
    threads.start(cfg.threads)  # (as generate and serve: the cores other processes leave free, re-checked)
    target = load_target(cfg, args.quiet)
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
        variant = variant_config(cfg, m, drafts)
        base = variant.method
        tree = base in ("eagle", "medusa") and variant.tree
        if tree:
            ks = [args.tree_depth if base == "eagle" else None]
        elif k_list:
            ks = k_list
        elif base in ("ngram", "draft") and not q:
            ks = sorted({max(1, DEFAULT_K[base] // 2), DEFAULT_K[base]})
        else:
            ks = [variant.k or DEFAULT_K[base]]
        for k in ks:
            try:
                eng = build_engine(variant.replace(k=k), target)
            except SpecdecError as e:
                if explicit or (args.draft and base in ("draft", "auto")):
                    raise SpecdecError(f"method {m}: {e}") from None
                skipped[m] = str(e)
                break
            name = f"{base} tree" if tree else f"{m} k={k}"
            configs.append(measure.Config(name, base, k, tree, eng))
    if not configs:
        raise SpecdecError("no method could be set up: " + "; ".join(f"{m}: {r}" for m, r in skipped.items()))
    ngram_ks = [c.k for c in configs if c.method == "ngram"]
    opts = pipeline.Options(
        max_new_tokens=max_new, repeats=pick(args.repeats, 2, 1), concurrency=tuple(levels),
        load_k=max(ngram_ks) if ngram_ks else DEFAULT_K["ngram"], min_requests=args.min_requests or 8,
        dist_samples=pick(args.dist_samples, 2, 1), dist_draws=pick(args.dist_draws, 800, 200),
        dist_tokens=args.dist_tokens, dist_temperature=args.dist_temperature, seed=args.seed, quiet=args.quiet,
        load_settings=("off", "adaptive") if q else measure.LOAD_SETTINGS)
    threads.settle()  # the free cores, measured while loading
    cmd = "specdec " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("specdec") else "specdec validate ..."
    machine = machine_info(torch.get_num_threads()) | {
        "platform": platform.platform(),
        "thread_choice": f"--threads {cfg.threads}" if cfg.threads else
        "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "the free cores, re-checked while decoding"}
    result = pipeline.run(target, samples, configs, Engine(target.model, eos_ids=target.eos_ids), opts, skipped,
                          cmd, machine, drafts)
    files = report.write(result, out)
    print(report.terminal_summary(result))
    print(f"report: {', '.join(str(out / f) for f in files)}")
    return 0 if not result["verdict"]["exactness_failures"] else 3


def _one(engine, ids, params):
    """One bench run of one prompt, timed as a newcomer's: no prefix cached from its earlier repeats
    (as bench forgets the suffix cache's earlier answers)."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    [res] = engine.generate([ids], params)
    return res.tokens, res


def _train_target_and_data(args):
    """Shared by train eagle / medusa: load the target, find or collect the data shards."""
    from pathlib import Path

    import torch

    from .distributed.ray_collect import collect_training_data
    from .models.loader import load_model
    from .train.distill import CollectConfig

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
        collect_training_data(target, out, CollectConfig(chat_prompts=args.chat_prompts, text_windows=args.text_windows,
                                                         seed=args.seed), args, quiet=args.quiet)
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

    from .distributed.ray_collect import collect_training_data
    from .models.loader import load_model
    from .train.distill import CollectConfig, StudentConfig, TrainConfig, read_init, train

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
        collect_training_data(target, out, cc, args, quiet=args.quiet)
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
def cmd_generate(args) -> int:
    from .text import TextStream, stop_strings

    if wants_ray(args):
        from .distributed.ray_batch import generate_on_ray

        if args.prediction is not None or args.json_schema is not None:
            raise SpecdecError("--prediction and --json-schema run on one machine; leave out --ray (or them)")
        return generate_on_ray(args)
    cfg = SpecConfig.from_args(args)  # (bad sampling values fail here, before anything loads)
    params = cfg.sampling
    rows_in = read_prompts(args)
    prompts = [p for p, _ in rows_in]
    for i, (p, _) in enumerate(rows_in):
        blank = not p.strip() if isinstance(p, str) else all(not m["content"].strip() for m in p)
        if blank:  # chat or raw alike: a chat template around nothing would be answered as if asked something
            raise SpecdecError(f"{prompt_where(args, i, len(rows_in))} is empty: give the text for the model to "
                               "answer (chat) or continue (raw)")
    if args.system is not None:
        check_text(args.system, "--system")
    stops = stop_strings(args.stop, "--stop")
    prediction_text, schema = read_shaping(args)  # (a missing or bad file fails before anything loads)
    threads.start(cfg.threads)
    quiet = args.quiet
    target = load_target(cfg, quiet)
    if target.tokenizer is None:
        raise SpecdecError(f"{target.path} has no tokenizer; specdec generate needs one to read text prompts")
    if cfg.suffix_cache:
        from .drafters.suffix import load_cache

        load_cache(cfg.suffix_cache, target.tokenizer, quiet)
    engine = build_engine(cfg, target, quiet)
    threads.settle()  # the free cores, measured while loading
    memory = None if args.fresh else cfg.learned_key(target)
    restored = memory is not None and learned.restore(engine, memory)
    tok = target.tokenizer
    encoded, notes = encode_prompts(args, cfg, tok, rows_in, target.model.max_context, engine.sources)
    for note in [] if quiet else notes:
        print(f"[specdec] note: {note}", file=sys.stderr)
    if args.n > 1 and params.greedy and not quiet:
        print(f"[specdec] note: --n {args.n} with greedy decoding gives {args.n} identical completions; "
              "pass --temperature > 0 to sample", file=sys.stderr)

    rows = [(i, s) for i in range(len(encoded)) for s in range(args.n)]
    predicted = tok.encode(prediction_text, add_special_tokens=False) if prediction_text is not None else None
    grammar = None
    if schema is not None:
        from .grammar import grammar_for, json_schema

        grammar = grammar_for(tok, target.model.vocab_size, target.eos_ids, json_schema(schema, "--json-schema"))
    stream = not args.json and len(rows) == 1
    outputs: dict[tuple[int, int], object] = {}
    texts: dict[tuple[int, int], str] = {}
    t_all = time.perf_counter()
    for start in range(0, len(rows), args.batch_size):
        chunk = rows[start:start + args.batch_size]
        streams = [TextStream(tok, stops) for _ in chunk]  # each row's text, stop strings held back

        def on_tokens(r, ids, streams=streams):
            sys.stdout.write(streams[r].push(ids))
            sys.stdout.flush()

        def stop_fn(r, ids, streams=streams):
            return streams[r].reached_stop(ids)

        # each batch draws from its own seeded stream, else batches of equal rows would repeat
        chunk_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + start)
        results = engine.generate([encoded[i] for i, _ in chunk], chunk_params, on_tokens if stream else None,
                                  stop_fn if stops else None,
                                  predictions=[predicted] * len(chunk) if predicted is not None else None,
                                  constraints=[grammar.constraint() for _ in chunk] if grammar is not None else None)
        for key, res, text in zip(chunk, results, streams):
            rest = text.finish(res.tokens)
            if stream:
                sys.stdout.write(rest + "\n")
            outputs[key], texts[key] = res, text.text
    wall = time.perf_counter() - t_all
    if memory is not None:
        learned.save(engine, memory)
    if cfg.suffix_cache:
        from .drafters.suffix import save_cache

        save_cache(cfg.suffix_cache, tok)
    if not stream:
        print_outputs(args, prompts, outputs, texts, {"method": args.method, "model": target.name,
                                                      "weights": target.weights, "learned_state": restored})
    sys.stdout.flush()
    if not quiet:
        print_summary(list(outputs.values()), cfg, wall, target.weights)
    return 0


def read_shaping(args) -> tuple[str | None, dict | None]:
    """(--prediction's text, --json-schema's schema), each None when not given; a file that cannot
    be read, or a schema that is not a JSON object, is a SpecdecError naming the flag."""
    prediction = schema = None
    if args.prediction is not None:
        try:
            prediction = check_text(Path(args.prediction).read_text(encoding="utf-8"), "--prediction")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecdecError(f"--prediction: cannot read {args.prediction} ({e})") from None
    if args.json_schema is not None:
        try:
            schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SpecdecError(f"--json-schema: cannot read a JSON schema from {args.json_schema} ({e})") from None
        if not isinstance(schema, dict):
            raise SpecdecError(f"--json-schema: {args.json_schema} must hold a JSON object (a JSON Schema), got "
                               f"{type(schema).__name__}")
    return prediction, schema


def print_outputs(args, prompts: list, outputs: dict, texts: dict, run: dict) -> None:
    """The completions of a run that does not stream (texts: each one's text, cut at a stop
    string): with --json one object per prompt (its first completion's fields, every completion
    under "completions" with --n > 1, and `run`'s fields), else each completion under a
    `=== prompt I[, sample S] ===` line."""
    if args.json:
        for i, p in enumerate(prompts):
            comps = []
            for s in range(args.n):
                res = outputs[(i, s)]
                comps.append({"text": texts[(i, s)], "token_ids": res.tokens,
                              "finish_reason": res.stats.finish_reason, "stats": res.stats.as_dict()})
            obj = {"index": i, "prompt": p, **comps[0], **run}
            if args.n > 1:
                obj["completions"] = comps
            print(json.dumps(obj, ensure_ascii=False))
        return
    for (i, s), res in outputs.items():
        label = f"prompt {i + 1}" + (f", sample {s + 1}" if args.n > 1 else "")
        print(f"=== {label} ===")
        print(texts[(i, s)])


def print_summary(results, cfg: SpecConfig, wall: float, weights: str = "fp32") -> None:
    from .metrics import summarize

    s = summarize(results)
    if s["target_forwards"]:
        rate = f"{s['new_tokens']} tokens in {s['decode_s']:.2f} s decode ({s['tokens_per_s']:.1f} tok/s)"
    else:  # the prefill's token only (max 1 new token, or an immediate stop): no decoding to rate
        rate = f"{s['new_tokens']} token{'s' if s['new_tokens'] != 1 else ''} from the prefill, no decode step"
    line = (f"[specdec] {rate}, "
            f"prefill {s['prefill_s']:.2f} s for {s['prompt_tokens']} prompt tokens, wall {wall:.2f} s; "
            f"method {cfg.method}" + (" with -k 0 (no drafting)" if cfg.method != "none" and cfg.k == 0 else ""))
    if cfg.method != "none" and cfg.k != 0 and s["target_forwards"]:
        if cfg.method in DEFAULT_TREE_NODES and cfg.tree:
            nodes = cfg.tree_nodes or DEFAULT_TREE_NODES[cfg.method]
            shape = f"tree of {nodes} nodes" + (f", depth {cfg.tree_depth}" if cfg.method == "eagle" else "")
            accept = "acceptance by depth"
        else:
            shape, accept = f"k={cfg.method_k()}", "acceptance"
        line += (f", {shape}: {accept} {s['alpha']:.2f}, {s['tau']:.2f} tokens/forward, "
                 f"draft {s['draft_s']:.2f} s vs verify {s['verify_s']:.2f} s")
        plain = s["plain_steps"]
        if plain:  # the row-steps that verified no guess, and why (the cost model declining, the guard ...)
            why = ", ".join(f"{reason} {n}" for reason, n in sorted(plain.items(), key=lambda kv: -kv[1]))
            line += f", {sum(plain.values())} row-steps without guesses ({why})"
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
    finally:
        if argv is None:  # this process's own command, about to exit: see _quick_exit
            _quick_exit()


def _quick_exit() -> None:
    """Let the interpreter's shutdown skip the garbage collector's pass over every object alive now
    (torch's modules hold millions): gc.freeze() moves them out of its reach. On a busy 2-core Xeon
    the shutdown after `import torch` took 2.1 s with that pass and 0.6 s without, and a one-token
    `specdec generate` 11.2 s against 8.7. Only for the process's own command line: a Python caller
    of main() goes on running, and its garbage must stay collectable."""
    import gc

    gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
