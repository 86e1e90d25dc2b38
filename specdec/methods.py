"""The method table: what each `--method` name builds (docs/design.md, "Draft sources").

One entry per method a user can name: a one-line summary, its default -k, what files it needs,
and `build(cfg, target)`, which returns its draft sources (specdec.drafters.Drafter) and the k the
scheduler caps guesses at. Every entry point (generate, bench, validate, serve, the Python API, Ray)
builds its sources here, through `sources_for`. A new draft source is its module plus one line in
`TABLE`.

Benchmark and validate variants are (method, options) pairs written `method:option=value`, e.g.
`eagle:tree=off` (the head's chain), `auto:with=draft` (auto with the draft model instead of the
EAGLE head), `ngram:k=4` (`parse_variant`); an option is a SpecConfig field or `with`.

Nothing heavy is imported here until a builder runs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import Callable

from .types import SpecdecError


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    k: int  # default most guesses a step (measured on the Spec-Bench dev set, README)
    build: Callable  # (cfg, target, quiet) -> list of sources (an empty list: plain decoding)
    needs: str = ""  # the files it needs (--draft), for messages
    nodes: int = 0  # default tree nodes (--tree-nodes) where it drafts trees


def _ngram(cfg, target, quiet):
    from .drafters.ngram import NgramDrafter

    return [NgramDrafter()]


def _draft_model(cfg, target, quiet, required: bool = True):
    """The draft model (cfg.draft, else the one shipped for the target) as a source that reads a
    joining prompt when it first drafts for the row (`draft_source`); None where there is none
    and none is required."""
    from .models.loader import default_draft_for, load_model

    path = cfg.draft or default_draft_for(target)
    if path is None:
        if required:
            raise SpecdecError("--method draft needs --draft PATH (a draft model with the target's tokenizer); "
                               "only the default model ships with a draft")
        return None
    draft = load_model(str(path), dtype=target.model.dtype, quiet=quiet, pack=False)
    return draft_source(target, draft, cfg.draft_confidence)


def draft_source(target, draft, confidence: float | None = None, lazy: bool = True):
    """A loaded draft model (`load_model(path, pack=False)`) as a source for the loaded target,
    refused when its vocabulary differs. lazy: it reads a joining prompt when it first drafts for
    the row (a catch-up the cost model prices), so a request it never drafts for pays nothing: a
    server answering short prompts with `--method draft` had paid 0.4 of every prompt's prefill
    again in the draft (0.89-0.93 of plain at 4-32 clients, policy_sim.py --serve); False: at once."""
    from .drafters.draft_model import DEFAULT_CONFIDENCE, DraftModelDrafter, check_same_vocabulary

    check_same_vocabulary(getattr(target, "tokenizer", None), draft.tokenizer)
    t_vocab, d_vocab = target.model.vocab_size, getattr(draft.model, "vocab_size", None)
    if (draft.tokenizer is None or getattr(target, "tokenizer", None) is None) and d_vocab != t_vocab:
        raise SpecdecError(f"the draft's vocabulary has {d_vocab} tokens, the target's {t_vocab}: a draft model must "
                           "share the target's vocabulary (and should come with its tokenizer, so the ids can be "
                           "checked)")
    meta = getattr(draft, "draft_meta", None) or {}
    confidence = DEFAULT_CONFIDENCE if confidence is None else confidence
    return DraftModelDrafter(draft.model, vocab_size=t_vocab, vocab_subset=meta.get("vocab_subset"),
                             confidence=confidence, target_model=target.model, lazy=lazy)


def _suffix(cfg, target, quiet):
    """Suffix decoding: what earlier answers of this process (and this one) wrote after the same
    tokens, from the process-wide cache (`--suffix-cache` keeps it across runs)."""
    from .drafters.suffix import SuffixDrafter

    return [SuffixDrafter()]


def _draft(cfg, target, quiet):
    return [_draft_model(cfg, target, quiet)]


def _eagle_head(cfg, target, path, tree: bool):
    from .drafters.eagle import EagleDrafter, load_eagle

    nodes = cfg.tree_nodes or TABLE["eagle"].nodes
    if tree and nodes + 2 > target.model.max_context:
        raise SpecdecError(f"--tree-nodes {nodes} does not fit in the model's context ({target.model.max_context})")
    from .models.loader import drafter_copies_dir

    head, meta = load_eagle(path, target)
    return EagleDrafter(head, target.model, meta.get("vocab_subset"), tree=tree, depth=cfg.tree_depth,
                        width=cfg.tree_width, nodes=nodes, saved=drafter_copies_dir(target, path))


def _eagle(cfg, target, quiet):
    from .drafters.eagle import default_eagle_for, is_eagle_dir

    path = cfg.draft or default_eagle_for(target)
    if path is None:
        raise SpecdecError("--method eagle needs an EAGLE head trained for this target: pass --draft DIR "
                           "(make one with `specdec train eagle --out DIR`); only the default target ships one")
    if not is_eagle_dir(path):
        raise SpecdecError(f"{path} is not an EAGLE head folder (no specdec_eagle.json); --method eagle needs "
                           "one from `specdec train eagle`")
    return [_eagle_head(cfg, target, path, cfg.tree)]


def _medusa(cfg, target, quiet):
    from .drafters.medusa import MedusaDrafter, choose_tree, default_medusa_for, is_medusa_dir, load_medusa

    path = cfg.draft or default_medusa_for(target)
    if path is None or not is_medusa_dir(path):
        raise SpecdecError("--method medusa needs Medusa heads trained for this target: pass --draft DIR "
                           "(make them with `specdec train medusa --out DIR`); only the default target ships them")
    heads, meta = load_medusa(path, target)
    tree = None
    if cfg.tree:
        tree = choose_tree(meta["accuracy"], cfg.tree_nodes) if cfg.tree_nodes else [tuple(x) for x in meta["tree"]]
    from .models.loader import drafter_copies_dir

    return [MedusaDrafter(heads, target.model, meta.get("vocab_subset"), tree, saved=drafter_copies_dir(target, path))]


def _auto(cfg, target, quiet):
    """Prompt lookup where the context repeats itself, the suffix cache where earlier answers do,
    and elsewhere the EAGLE head's tree (cfg.draft a head, or the one shipped for the target) or a
    draft model (cfg.draft a model, or the one shipped); each row and step priced by the cost model."""
    from .drafters.eagle import default_eagle_for, is_eagle_dir

    path = cfg.draft
    if path is None and getattr(target.model, "native", False):
        path = default_eagle_for(target)
    known = _ngram(cfg, target, quiet) + _suffix(cfg, target, quiet)
    if is_eagle_dir(path):
        return known + [_eagle_head(cfg, target, path, tree=True)]
    draft = _draft_model(cfg, target, quiet, required=False)
    if draft is None and not quiet:
        print("[specdec] no EAGLE head or draft model for this model: auto drafts with prompt lookup and the suffix "
              "cache alone; pass --draft with a head from `specdec train eagle` or a draft model", file=sys.stderr)
    return known + ([draft] if draft is not None else [])


TABLE: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding, no speculation", 0, lambda cfg, target, quiet: []),
    Method("ngram", "prompt lookup: continuations of earlier occurrences of the last tokens", 8, _ngram),
    Method("draft", "a small draft model with the target's tokenizer", 4, _draft,
           "a draft model (a Hugging Face folder or .gguf file with the target's tokenizer)"),
    Method("auto", "prompt lookup and the suffix cache, with an EAGLE tree or a draft model where they have "
           "nothing", 8, _auto,
           "an EAGLE head folder or a draft model (a Hugging Face folder or .gguf file)"),
    Method("eagle", "an EAGLE head's dynamic tree (--no-tree: its chain)", 5, _eagle,
           "an EAGLE head folder (from `specdec train eagle`)", nodes=5),
    Method("medusa", "Medusa heads' static tree (--no-tree: their chain)", 4, _medusa,
           "a Medusa heads folder (from `specdec train medusa`)", nodes=4),
    Method("suffix", "suffix decoding: what earlier answers wrote after the same tokens, as a tree", 16, _suffix),
)}
METHODS = tuple(TABLE)
#: the sources every method (but none) adds, which draft from what a request carries: its predicted
#: output and its grammar's forced tokens (a request that names one method keeps these too)
REQUEST_SOURCES = frozenset({"prediction", "grammar"})
DEFAULT_K = {name: m.k for name, m in TABLE.items() if m.k}
DEFAULT_TREE_NODES = {name: m.nodes for name, m in TABLE.items() if m.nodes}


def check_method(name: str) -> Method:
    if name not in TABLE:
        raise SpecdecError(f"method must be one of {', '.join(METHODS)}, got {name!r}")
    return TABLE[name]


def sources_for(cfg, target, quiet: bool = True) -> tuple[list, int]:
    """(draft sources, k) for cfg's method on a loaded target: the one place a method name becomes
    sources, for generate, bench, validate, serve and the Python API. -k 0 drafts nothing."""
    method = check_method(cfg.method)
    check_draft_setting(cfg)
    if cfg.method == "none" or cfg.k == 0:
        return [], 0
    sources = method.build(cfg, target, quiet)
    if sources:  # every method also drafts from a request's predicted output and its grammar's forced tokens (REQUEST_SOURCES)
        from .drafters.grammar import GrammarDrafter
        from .drafters.prediction import PredictionDrafter

        sources += [PredictionDrafter(), GrammarDrafter()]
    k = cfg.method_k()
    if cfg.method == "eagle" and cfg.tree:
        k = cfg.tree_depth  # a tree's depth is its own setting; a chain drafts k tokens
    return sources, max(k, 1) if sources else 0


def check_draft_path(path, method: str) -> None:
    """A clear error when a drafter path names nothing, or a folder of another kind than the
    method needs (the loaders' own messages talk about --model, or say 'pass --draft' to
    someone who did)."""
    from pathlib import Path

    from .drafters.eagle import is_eagle_dir
    from .drafters.medusa import is_medusa_dir
    from .models.loader import _looks_like_hub_id

    p = Path(os.path.expanduser(str(path)))
    needs = TABLE[method].needs
    if not p.exists():
        if method in ("draft", "auto") and _looks_like_hub_id(str(path)):
            return  # a hub id: the loader says what it can do offline
        raise SpecdecError(f"{path}: no such file or folder; --method {method} needs {needs}")
    fits = {"eagle": is_eagle_dir(p), "medusa": is_medusa_dir(p),
            "draft": p.is_file() or (p / "config.json").is_file()}
    fits["auto"] = fits["eagle"] or fits["draft"]
    if fits.get(method, False):
        return
    holds = ("an EAGLE head (use --method eagle or auto)" if fits["eagle"] else
             "Medusa heads (use --method medusa)" if fits["medusa"] else
             "a model (use --method draft or auto)" if fits["draft"] else None)
    raise SpecdecError(f"{path} is not {needs}" + (f"; it holds {holds}" if holds else ""))


def check_draft_setting(cfg) -> None:
    """cfg.draft fits cfg.method (a method that drafts from a model or heads) and names what that
    method needs; checked before anything loads."""
    if not cfg.draft:
        return
    if not TABLE[cfg.method].needs:
        users = ", ".join(name for name, m in TABLE.items() if m.needs)
        raise SpecdecError(f"--draft is only used with --method {users} (got --method {cfg.method})")
    check_draft_path(cfg.draft, cfg.method)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'method:option=value:...' -> (method, {option: value}); SpecdecError naming what is wrong."""
    name, *parts = [p.strip() for p in text.split(":")]
    check_method(name)
    options = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise SpecdecError(f"{text!r}: options are written method:option=value (e.g. eagle:tree=off), got {part!r}")
        options[key.strip().replace("-", "_")] = value.strip()
    return name, options


def variant_config(cfg, text: str, drafts: dict[str, str | None]):
    """cfg for the variant `text` (`parse_variant`): its method, and each option set on the
    matching SpecConfig field (`with=draft|eagle`: auto with that second source; `drafts` names the
    files each kind of drafter comes from)."""
    name, options = parse_variant(text)
    kinds = {f.name: f.type for f in fields(cfg)}
    changes: dict = {"method": name, "draft": drafts.get(name)}
    for key, value in options.items():
        if key == "with":
            if name != "auto" or value not in ("draft", "eagle"):
                raise SpecdecError(f"{text!r}: 'with' takes draft or eagle, and only for auto")
            changes["draft"] = drafts.get(f"auto-{value}")
            continue
        if key not in kinds or key in ("method", "sampling"):
            raise SpecdecError(f"{text!r}: unknown option {key!r}; options are SpecConfig fields "
                               f"({', '.join(k for k in kinds if k not in ('method', 'sampling'))}) and 'with'")
        changes[key] = _value(text, key, value, kinds[key])
    return cfg.replace(**changes)


def _value(text: str, key: str, value: str, kind) -> object:
    kind = str(kind)
    if "bool" in kind:
        if value.lower() not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
            raise SpecdecError(f"{text!r}: {key} takes on or off, got {value!r}")
        return value.lower() in ("on", "true", "1", "yes")
    if "int" in kind:
        try:
            return int(value)
        except ValueError:
            raise SpecdecError(f"{text!r}: {key} takes a whole number, got {value!r}") from None
    if "float" in kind:
        try:
            return float(value)
        except ValueError:
            raise SpecdecError(f"{text!r}: {key} takes a number, got {value!r}") from None
    return value
