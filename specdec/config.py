"""What a run is configured with, and the one builder that turns it into an engine.

`SpecConfig` holds every setting that shapes decoding: the target, the drafter (method, draft
path, k, the tree options), the weights and threads, the sampling defaults and the server's
batching knobs. The CLI parses its flags into one (`SpecConfig.from_args`); `specdec.load`,
`bench`, `validate`, `serve` and the benchmark scripts build and pass one too. From it:

- `load_target(cfg)` loads the target model;
- `build_engine(cfg, target)` builds the `Engine` for `generate` (and bench, validate, the API);
- `build_batcher(cfg)` loads the target and builds the `ContinuousBatcher` for `serve`.

This module imports nothing heavy at import time (no torch), so the CLI can parse and refuse
bad input before loading anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .methods import DEFAULT_K, check_method, sources_for
from .types import SamplingParams, SpecdecError

DTYPES = ("float32", "bfloat16")
# the prefix cache's memory by default, MiB (prefix_cache.py; the default model: ~46 KB a token, ~5.7k tokens)
DEFAULT_PREFIX_CACHE_MB = 256


@dataclass
class SpecConfig:
    """Every setting of a speculative run; the defaults are `specdec generate`'s.

    model: a .gguf file, a Hugging Face folder, a hub id, or None for the embedded default.
    draft: the drafter's files for draft/auto/eagle/medusa (None: the ones shipped for the
    default model). k: most tokens drafted a step (None: the method's DEFAULT_K; 0: none).
    sampling: the default SamplingParams of a generate call. max_batch, max_queue,
    max_context: the server's batcher (serve only); fixed_k: draft -k guesses every step (no
    priced choice), in the server and the engine. prefix_cache_mb: the memory of the cache of
    prompt prefixes computed before (prefix_cache.py), in the engine and the server; 0: none."""

    model: str | None = None
    draft: str | None = None
    method: str = "auto"
    k: int | None = None
    draft_confidence: float | None = None
    tree: bool = True
    tree_depth: int = 4
    tree_width: int = 2
    tree_nodes: int | None = None
    weights: str = "auto"
    dtype: str = "float32"
    threads: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_batch: int = 16
    max_queue: int = 256
    max_context: int = 2048
    fixed_k: bool = False
    suffix_cache: str | None = None  # the suffix cache's file: loaded at start, saved at the end
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB  # the prefix cache's memory, MiB (prefix_cache.py); 0: off

    def __post_init__(self) -> None:
        check_method(self.method)
        if self.dtype not in DTYPES:
            raise SpecdecError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.k is not None and (not isinstance(self.k, int) or self.k < 0):
            raise SpecdecError(f"k must be a whole number >= 0 (0: plain decoding), got {self.k!r}")
        if self.draft is not None:
            self.draft = str(self.draft)
        if self.model is not None:
            self.model = str(self.model)
        if not isinstance(self.prefix_cache_mb, (int, float)) or self.prefix_cache_mb < 0:
            raise SpecdecError(f"prefix_cache_mb must be a number of MiB >= 0 (0: no prefix cache), "
                               f"got {self.prefix_cache_mb!r}")

    def prefix_cache(self):
        """A new PrefixCache of prefix_cache_mb MiB, or None when it is 0."""
        from .prefix_cache import PrefixCache

        return PrefixCache(self.prefix_cache_mb) if self.prefix_cache_mb else None

    @classmethod
    def from_args(cls, args) -> "SpecConfig":
        """The configuration a parsed command line (an argparse Namespace of generate, bench,
        serve or validate) sets: the fields it has, the defaults for the rest. Bad sampling
        values raise SpecdecError here, before anything loads."""
        given = vars(args)
        known = {f.name for f in dataclasses.fields(cls)} - {"sampling"}
        values = {name: given[name] for name in known if name in given}
        if "temperature" in given:
            values["sampling"] = SamplingParams(
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                seed=args.seed, max_new_tokens=args.max_new_tokens)
        return cls(**values)

    def replace(self, **changes) -> "SpecConfig":
        return dataclasses.replace(self, **changes)

    def method_k(self, method: str | None = None) -> int:
        """k if set, else the method's default."""
        return self.k if self.k is not None else DEFAULT_K.get(method or self.method, 4)

    @property
    def torch_dtype(self):
        import torch

        return torch.float32 if self.dtype == "float32" else torch.bfloat16

    def learned_key(self, target) -> str:
        """This run's entry in learned.py: machine, threads, model, weights and every setting
        that changes what the adaptive methods measure (greedy or sampled among them: sampling
        accepts far fewer guesses, and a greedy run's acceptance would mislead it)."""
        import torch

        from . import learned

        mode = "greedy" if self.sampling.greedy else "sampled"
        mode += " fixed-k" if self.fixed_k else ""
        method = " ".join(str(v) for v in (self.method, self.draft, self.k, self.tree, self.tree_depth,
                                           self.tree_width, self.tree_nodes, self.draft_confidence, mode))
        return learned.key(str(target.path), target.weights, self.dtype, method, torch.get_num_threads())


def unused_setting_notes(cfg: SpecConfig, sources: list, any_chat: bool, system: str | None = None) -> list[str]:
    """One line per setting of cfg (or the system message) that was set away from its default
    but does nothing in this run (whose draft sources are `sources`), named as its flag."""
    names = {d.label for d in sources}
    method, notes, sp = cfg.method, [], cfg.sampling
    if sp.greedy:
        unused = [f for f, on in (("--top-k", sp.top_k != 0), ("--top-p", sp.top_p != 1.0),
                                   ("--min-p", sp.min_p != 0.0), ("--seed", sp.seed is not None)) if on]
        if unused:
            notes.append(f"{', '.join(unused)} only apply to sampling; greedy decoding (--temperature 0) ignores "
                         f"{'it' if len(unused) == 1 else 'them'}")
    if system is not None and not any_chat:
        notes.append("--system goes into the chat template, and no prompt here uses it (--raw, rows with "
                     "\"chat\": false, or a tokenizer without a template)")
    tree_eagle = method == "eagle" or (method == "auto" and "eagle" in names)
    flags = {"--tree-depth": cfg.tree_depth != 4, "--tree-width": cfg.tree_width != 2,
             "--tree-nodes": cfg.tree_nodes is not None, "--no-tree": not cfg.tree}
    uses = set()
    if tree_eagle:
        uses = {"--tree-depth", "--tree-width", "--tree-nodes"} | ({"--no-tree"} if method == "eagle" else set())
        if method == "eagle" and not cfg.tree:
            uses -= {"--tree-depth", "--tree-width", "--tree-nodes"}
    elif method == "medusa":
        uses = {"--no-tree"} | ({"--tree-nodes"} if cfg.tree else set())
    ignored = [f for f, on in flags.items() if on and f not in uses]
    if ignored:
        what = {"none": "plain decoding", "ngram": "prompt lookup", "draft": "the draft model's chain",
                "auto": "auto here (no EAGLE head: prompt lookup and the draft model's chain)",
                "medusa": "medusa", "eagle": "the eagle chain (--no-tree)"}[method]
        if tree_eagle and method == "auto":
            what = "auto (its EAGLE head always drafts a tree)"
        if not sources and method != "none":
            what = "-k 0 (nothing is drafted)"
        notes.append(f"{', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} nothing with {what}; "
                     "the tree options shape the eagle (and auto's EAGLE) tree, and medusa's with --tree-nodes")
    if cfg.k and method == "eagle" and cfg.tree:
        notes.append(f"-k {cfg.k} is not used by the eagle tree (its depth is --tree-depth, {cfg.tree_depth}); "
                     "--no-tree drafts a chain of -k tokens")
    if cfg.draft_confidence is not None:
        if "draft" not in names:
            notes.append("--draft-confidence only applies to a draft model (--method draft, or auto without an "
                         "EAGLE head); this run drafts without one")
    if cfg.k and method == "none":
        notes.append(f"-k {cfg.k} is not used by --method none (plain decoding drafts nothing)")
    return notes


def load_target(cfg: SpecConfig, quiet: bool = False, pack: bool = True):
    """The target model `cfg.model` names (a LoadedModel), with cfg's dtype and weights."""
    from .models.loader import load_model

    return load_model(cfg.model, dtype=cfg.torch_dtype, quiet=quiet, weights=cfg.weights, pack=pack)


def build_engine(cfg: SpecConfig, target, quiet: bool = True):
    """The Engine cfg describes on a loaded target (`generate`, bench, validate, the API)."""
    from .engine import Engine

    sources, k = sources_for(cfg, target, quiet)
    return Engine(target.model, sources, k=k, eos_ids=target.eos_ids, fixed_k=cfg.fixed_k, method=cfg.method,
                  prefix_cache=cfg.prefix_cache())


def build_batcher(cfg: SpecConfig, quiet: bool = False, thread: bool = False):
    """(target, batcher) for `specdec serve` (and its Ray replicas): the target loaded, its draft
    sources built (methods.sources_for), the ContinuousBatcher with cfg's knobs. thread=True
    decodes in the batcher's own thread."""
    from .core.scheduler import ContinuousBatcher
    from .methods import check_draft_setting

    check_draft_setting(cfg)  # before loading anything
    lm = load_target(cfg, quiet)
    if lm.tokenizer is None:
        raise SpecdecError("the model has no tokenizer; the server needs one to read text")
    if cfg.suffix_cache:
        from .drafters.suffix import load_cache

        load_cache(cfg.suffix_cache, lm.tokenizer, quiet)
    sources, k = sources_for(cfg, lm, quiet)
    batcher = ContinuousBatcher(lm.model, lm.eos_ids, sources, method=cfg.method, k_max=k or cfg.method_k(),
                                max_batch=cfg.max_batch, max_queue=cfg.max_queue, max_context=cfg.max_context,
                                adaptive=not cfg.fixed_k, thread=thread, prefix_cache=cfg.prefix_cache())
    return lm, batcher
