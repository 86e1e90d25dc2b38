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
import os
import sys
from dataclasses import dataclass, field

from .types import SamplingParams, SpecdecError

METHODS = ("none", "ngram", "draft", "auto", "eagle", "medusa")
SERVE_METHODS = METHODS  # the batcher runs every drafter (eagle and medusa through the protocol)
DEFAULT_K = {"ngram": 8, "draft": 4, "auto": 8, "eagle": 5, "medusa": 4}  # measured on the Spec-Bench dev set (README)
DEFAULT_TREE_NODES = {"eagle": 5, "medusa": 4}
DTYPES = ("float32", "bfloat16")


@dataclass
class SpecConfig:
    """Every setting of a speculative run; the defaults are `specdec generate`'s.

    model: a .gguf file, a Hugging Face folder, a hub id, or None for the embedded default.
    draft: the drafter's files for draft/auto/eagle/medusa (None: the ones shipped for the
    default model). k: most tokens drafted a step (None: the method's DEFAULT_K; 0: none).
    sampling: the default SamplingParams of a generate call. max_batch, max_queue,
    max_context: the server's batcher (serve only); fixed_k: draft -k guesses every step (no
    priced choice), in the server and the engine."""

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

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecdecError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.dtype not in DTYPES:
            raise SpecdecError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.k is not None and (not isinstance(self.k, int) or self.k < 0):
            raise SpecdecError(f"k must be a whole number >= 0 (0: plain decoding), got {self.k!r}")
        if self.draft is not None:
            self.draft = str(self.draft)
        if self.model is not None:
            self.model = str(self.model)

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


def unused_setting_notes(cfg: SpecConfig, drafter, any_chat: bool, system: str | None = None) -> list[str]:
    """One line per setting of cfg (or the system message) that was set away from its default
    but does nothing in this run, named as its command-line flag."""
    from .drafters.hybrid import LookupEagleDrafter

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
    tree_eagle = method == "eagle" or isinstance(drafter, LookupEagleDrafter)
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
        if drafter is None and method != "none":
            what = "-k 0 (nothing is drafted)"
        notes.append(f"{', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} nothing with {what}; "
                     "the tree options shape the eagle (and auto's EAGLE) tree, and medusa's with --tree-nodes")
    if cfg.k and method == "eagle" and cfg.tree:
        notes.append(f"-k {cfg.k} is not used by the eagle tree (its depth is --tree-depth, {cfg.tree_depth}); "
                     "--no-tree drafts a chain of -k tokens")
    if cfg.draft_confidence is not None:
        from .drafters.draft_model import DraftModelDrafter
        from .drafters.hybrid import HybridDrafter

        if not isinstance(drafter, (DraftModelDrafter, HybridDrafter)):
            notes.append("--draft-confidence only applies to a draft model (--method draft, or auto without an "
                         "EAGLE head); this run drafts without one")
    if cfg.k and method == "none":
        notes.append(f"-k {cfg.k} is not used by --method none (plain decoding drafts nothing)")
    return notes


def load_target(cfg: SpecConfig, quiet: bool = False, pack: bool = True):
    """The target model `cfg.model` names (a LoadedModel), with cfg's dtype and weights."""
    from .models.loader import load_model

    return load_model(cfg.model, dtype=cfg.torch_dtype, quiet=quiet, weights=cfg.weights, pack=pack)


def check_draft_path(path, method: str) -> None:
    """A clear error when a drafter path names nothing, or a folder of another kind than the
    method needs (the loaders' own messages talk about --model, or say 'pass --draft' to
    someone who did)."""
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


def check_draft_setting(cfg: SpecConfig) -> None:
    """cfg.draft fits cfg.method (a method that drafts from a model or heads) and names what that
    method needs; checked before anything loads."""
    if not cfg.draft:
        return
    if cfg.method in ("none", "ngram"):
        raise SpecdecError(f"--draft is only used with --method draft, auto, eagle or medusa (got --method {cfg.method})")
    check_draft_path(cfg.draft, cfg.method)


def _load_draft_model(cfg: SpecConfig, target, quiet: bool, required: bool):
    """The draft model (LoadedModel) for draft / auto: cfg.draft, else the one shipped for
    the target; None where there is none and none is required."""
    from .models.loader import default_draft_for, load_model

    path = cfg.draft or default_draft_for(target)
    if path is None:
        if required:
            raise SpecdecError("--method draft needs --draft PATH (a draft model with the target's tokenizer); "
                               "only the default model ships with a draft")
        return None
    return load_model(str(path), dtype=target.model.dtype, quiet=quiet, pack=False)


def _eagle_nodes(cfg: SpecConfig, target) -> int:
    nodes = cfg.tree_nodes or DEFAULT_TREE_NODES["eagle"]
    if cfg.tree and nodes + 2 > target.model.max_context:
        raise SpecdecError(f"--tree-nodes {nodes} does not fit in the model's context ({target.model.max_context})")
    return nodes


def make_drafter(cfg: SpecConfig, target, quiet: bool = True):
    """(drafter or None, the engine's k) for cfg's method on a loaded target: the one place a
    method name becomes a drafter for generate, bench, validate and the Python API."""
    from .drafters import REGISTRY

    method = cfg.method
    check_draft_setting(cfg)
    if method == "none" or cfg.k == 0:  # -k 0 drafts nothing, for every method
        return None, 0
    if method == "eagle":
        from .drafters.eagle import default_eagle_for, is_eagle_dir

        path = cfg.draft or default_eagle_for(target)
        if path is None:
            raise SpecdecError("--method eagle needs an EAGLE head trained for this target: pass --draft DIR "
                               "(make one with `specdec train eagle --out DIR`); only the default target ships one")
        if not is_eagle_dir(path):
            raise SpecdecError(f"{path} is not an EAGLE head folder (no specdec_eagle.json); --method eagle needs "
                               "one from `specdec train eagle`")
        drafter = REGISTRY["eagle"](target=target, draft=path, tree=cfg.tree, depth=cfg.tree_depth,
                                    width=cfg.tree_width, nodes=_eagle_nodes(cfg, target))
        # a tree's depth is its own setting; a chain drafts k tokens
        return drafter, cfg.tree_depth if cfg.tree else cfg.method_k()
    if method == "medusa":
        from .drafters.medusa import default_medusa_for, is_medusa_dir

        path = cfg.draft or default_medusa_for(target)
        if path is None or not is_medusa_dir(path):
            raise SpecdecError("--method medusa needs Medusa heads trained for this target: pass --draft DIR "
                               "(make them with `specdec train medusa --out DIR`); only the default target ships them")
        drafter = REGISTRY["medusa"](target=target, draft=path, tree=cfg.tree,
                                     nodes=cfg.tree_nodes or DEFAULT_TREE_NODES["medusa"])
        return drafter, cfg.method_k()
    if method == "auto":
        from .drafters.eagle import default_eagle_for, is_eagle_dir

        path = cfg.draft
        if path is None and getattr(target.model, "native", False):
            path = default_eagle_for(target)
        if is_eagle_dir(path):  # prompt lookup where the context repeats itself, the EAGLE head's tree elsewhere
            drafter = REGISTRY["lookup-eagle"](target=target, draft=path, depth=cfg.tree_depth,
                                               width=cfg.tree_width, nodes=_eagle_nodes(cfg, target))
            return drafter, max(cfg.method_k(), 1)
        # prompt lookup where the context repeats itself, the draft model elsewhere, each row and
        # step as the scheduler's cost model prices them (core.policy.LoadPolicy.choose_draft)
        draft_lm = _load_draft_model(cfg, target, quiet, required=False)
        drafter = REGISTRY["hybrid" if draft_lm is not None else "ngram"](target=target, draft=draft_lm,
                                                                          confidence=cfg.draft_confidence)
        return drafter, max(cfg.method_k(), 1)
    draft_lm = _load_draft_model(cfg, target, quiet, required=True) if method == "draft" else None
    return REGISTRY[method](target=target, draft=draft_lm, confidence=cfg.draft_confidence), cfg.method_k()


def build_engine(cfg: SpecConfig, target, quiet: bool = True):
    """The Engine cfg describes on a loaded target (`generate`, bench, validate, the API)."""
    from .engine import Engine

    drafter, k = make_drafter(cfg, target, quiet)
    if drafter is None:
        return Engine(target.model, eos_ids=target.eos_ids)
    return Engine(target.model, drafter, k=k, eos_ids=target.eos_ids, fixed_k=cfg.fixed_k)


def serve_drafter(cfg: SpecConfig, lm, quiet: bool = False):
    """(method, drafter, most guesses a row takes per step) the server runs for cfg on a loaded
    target: a draft model, the EAGLE head beside prompt lookup, prompt lookup alone (`auto`
    without a head: method "ngram"), or an EAGLE / Medusa drafter built as `generate` builds it."""
    method, drafter = cfg.method, None
    from .drafters.eagle import is_eagle_dir

    if method in ("eagle", "medusa"):
        drafter, k = make_drafter(cfg, lm, quiet)
        return method, drafter, k
    if method == "draft" or (method == "auto" and cfg.draft and not is_eagle_dir(os.path.expanduser(cfg.draft))):
        # draft: the draft model's guesses; auto with a draft model: prompt lookup beside it (the
        # pair `generate` builds)
        from .drafters import REGISTRY

        draft_lm = _load_draft_model(cfg, lm, quiet=True, required=True)
        drafter = REGISTRY["draft" if method == "draft" else "hybrid"](target=lm, draft=draft_lm,
                                                                       confidence=cfg.draft_confidence)
    elif method == "auto":
        from .drafters.hybrid import lookup_eagle_for

        drafter = lookup_eagle_for(lm, cfg.draft)
        if drafter is None:
            method = "ngram"
            if not quiet:
                print("[specdec] no EAGLE head for this model: the server drafts with prompt lookup (ngram); "
                      "pass --draft with a head from `specdec train eagle` or a draft model for auto", file=sys.stderr)
    return method, drafter, cfg.method_k("auto")


def build_batcher(cfg: SpecConfig, quiet: bool = False, thread: bool = False):
    """(target, batcher, method) for `specdec serve` (and its Ray replicas): the target loaded,
    the server's drafter built (serve_drafter), the ContinuousBatcher with cfg's knobs.
    thread=True decodes in the batcher's own thread."""
    from .core.scheduler import ContinuousBatcher

    if cfg.method not in SERVE_METHODS:
        raise SpecdecError(f"the server runs --method {', '.join(SERVE_METHODS)}, not {cfg.method}")
    check_draft_setting(cfg)  # before loading anything
    lm = load_target(cfg, quiet)
    if lm.tokenizer is None:
        raise SpecdecError("the model has no tokenizer; the server needs one to read text")
    method, drafter, k_max = serve_drafter(cfg, lm, quiet)
    batcher = ContinuousBatcher(lm.model, lm.eos_ids, method=method, k_max=k_max,
                                max_batch=cfg.max_batch, max_queue=cfg.max_queue, max_context=cfg.max_context,
                                adaptive=not cfg.fixed_k, drafter=drafter, thread=thread)
    return lm, batcher, method
