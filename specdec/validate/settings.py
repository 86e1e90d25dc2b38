"""Carry a speculative configuration over to other serving frameworks.

`framework_settings(method, k, ...)` returns, for specdec itself, vLLM, llama.cpp's
llama-server and Hugging Face TGI, the nearest equivalent settings: a ready-to-paste command
line (or "" where the framework has no equivalent), whether it is supported, and notes on
what differs (naming changes between versions, how to stop speculating above a batch size,
format conversions needed).

What this module does not know: it never runs those frameworks, loads no model and checks
no file. The flag names were checked against the documentation and source of the versions
named in `checked_against` (see the comment on _CHECKED), not executed; flag names in all
three projects change between versions, so verify against the version you deploy.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from .. import __version__
from ..types import SpecdecError

FRAMEWORKS: tuple[str, ...] = ("specdec", "vllm", "llama.cpp", "tgi")
METHODS: tuple[str, ...] = ("none", "ngram", "draft", "auto", "eagle", "medusa")

# What each entry was checked against (read, not run):
# - specdec: this repository's specdec/cli.py (serve: --method none|ngram, -k, --fixed-k; generate: --method, --draft).
# - vLLM 0.25.0: docs.vllm.ai/en/v0.25.0 pages features/speculative_decoding/draft_model and
#   .../dynamic_speculative_decoding; plus vllm-project/vllm main-branch vllm/config/speculative.py
#   (keys method, model, num_speculative_tokens, prompt_lookup_max/min, num_speculative_tokens_per_batch_size;
#   ngram defaults min = max = 5), vllm/v1/spec_decode/dynamic/utils.py (schedule validation: ranges sorted,
#   non-overlapping, first starts at 1, K >= 0) and docs/features/speculative_decoding/{n_gram,draft_model}.md;
#   PR #35060 (disable_by_batch_size unused since 0.10.0, when the V0 engine was removed; then removed);
#   docs.vllm.ai/en/v0.6.4 and v0.7.1 (the older --speculative-model / --num-speculative-tokens flags).
# - llama.cpp b10195: the "speculative parameters" and "removed params" sections of common/arg.cpp (--spec-type
#   list, --spec-draft-model/-md/--model-draft, --spec-draft-n-max/-n-min, --spec-ngram-simple-size-n/-m; --draft,
#   --draft-max, --draft-min and --spec-ngram-size-n/-m now abort with "the argument has been removed"), a
#   llama-server --help listing of build b10195 quoted in a third-party design note, and docs/speculative.md
#   (ngram-simple semantics; EAGLE-3 via draft-eagle3). The arg.cpp copy read was a recent snapshot, not a tag.
# - TGI 3.3.7 (git tag v3.3.7, 2025-12-18): docs/source/reference/launcher.md (--speculate, --model-id,
#   --max-concurrent-requests), docs/source/conceptual/speculation.md, server/text_generation_server/models/
#   __init__.py (Medusa repo layout), utils/tokens.py (create_n_gram_speculation); README (maintenance mode,
#   commit 34988476, 2025-12-11).
_CHECKED: dict[str, str] = {
    "specdec": f"specdec {__version__}",
    "vllm": "vLLM 0.25.0",
    "llama.cpp": "llama.cpp b10195",
    "tgi": "text-generation-inference 3.3.7",
}

# vLLM's batch-size schedule needs an upper end for its last range; vLLM caps it at --max-num-seqs anyway.
_VLLM_TOP_BATCH = 1024


@dataclass(frozen=True)
class _Req:
    method: str  # as asked (auto stays auto)
    base: str  # what the other frameworks get: auto -> draft (with a draft model) or ngram
    k: int
    draft: str | None
    max_concurrency: int | None
    ngram_min: int
    ngram_max: int
    model: str
    gguf: str | None = None  # the target as a GGUF file, for llama.cpp


def framework_settings(method: str, k: int, *, draft: str | None = None, max_concurrency: int | None = None,
                       ngram_min: int = 1, ngram_max: int = 4, model: str = "MODEL",
                       gguf: str | None = None) -> list[dict]:
    """One dict per framework, in FRAMEWORKS order: {"framework", "checked_against" (version string),
    "supported" (bool), "command" (a ready-to-paste command line, or "" when unsupported), "notes" (list[str])}.

    method: a specdec method (METHODS); k: speculative tokens per step (0 = speculation off);
    draft: the draft model (or head folder) path; max_concurrency: speculation pays only up to this many
    concurrent requests (None = at every concurrency measured); ngram_min/ngram_max: prompt-lookup match
    lengths; model: the target model as the command should name it; gguf: the target as a GGUF file,
    if there is one (llama-server's -m; without it the command names `model` and a note says to convert).
    """
    _check(method, k, draft, max_concurrency, ngram_min, ngram_max, model)
    if method == "none" or k == 0:
        return [_off(fw, gguf if fw == "llama.cpp" and gguf else model) for fw in FRAMEWORKS]
    base = method
    if method == "auto":  # auto = prompt lookup + (an EAGLE head | a draft model | nothing)
        from ..drafters.eagle import is_eagle_dir

        base = "eagle" if is_eagle_dir(draft) else "draft" if draft else "ngram"
    req = _Req(method, base, k, draft, max_concurrency, ngram_min, ngram_max, model, gguf)
    return [_entry(fw, *_BUILDERS[fw](req)) for fw in FRAMEWORKS]


def _check(method: object, k: object, draft: object, max_concurrency: object, ngram_min: object,
           ngram_max: object, model: object) -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise SpecdecError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if not _whole(k, 0):
        raise SpecdecError(f"k must be a whole number >= 0 (0 = speculation off), got {k!r}")
    if max_concurrency is not None and not _whole(max_concurrency, 1):
        raise SpecdecError(f"max_concurrency must be a whole number >= 1 or None, got {max_concurrency!r}")
    if not (_whole(ngram_min, 1) and _whole(ngram_max, 1) and ngram_min <= ngram_max):  # type: ignore[operator]
        raise SpecdecError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={ngram_min!r}, ngram_max={ngram_max!r}")
    if not isinstance(model, str) or not model:
        raise SpecdecError(f"model must be a non-empty string, got {model!r}")
    if draft is not None and (not isinstance(draft, str) or not draft):
        raise SpecdecError(f"draft must be a non-empty path or None, got {draft!r}")


def _whole(v: object, lowest: int) -> bool:
    """v is an int (not a bool) >= lowest."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= lowest


def _q(s: str) -> str:
    return shlex.quote(s)


def _entry(framework: str, supported: bool, command: str, notes: list[str]) -> dict:
    version = _CHECKED[framework]
    notes = [*notes, f"flag names change between versions: checked against {version} (documentation and source "
                     "read, not executed); check them against the version you deploy"]
    return {"framework": framework, "checked_against": version, "supported": supported,
            "command": command if supported else "", "notes": notes}


def _off(framework: str, model: str) -> dict:
    command = {
        "specdec": f"specdec serve --model {_q(model)} --method none",
        "vllm": f"vllm serve {_q(model)}",
        "llama.cpp": f"llama-server -m {_q(model)}",
        "tgi": f"text-generation-launcher --model-id {_q(model)}",
    }[framework]
    return _entry(framework, True, command, ["speculation off"])


def _concurrency_elsewhere(r: _Req, framework: str, how: str) -> list[str]:
    if r.max_concurrency is None:
        return []
    return [f"{framework} has no batch-size switch for speculation: run speculation only on instances that see at "
            f"most {r.max_concurrency} concurrent requests ({how})"]


def _specdec(r: _Req) -> tuple[bool, str, list[str]]:
    m = _q(r.model)
    if r.method == "ngram":
        notes = ["specdec serve caps k by load at every step (its load-aware cap: fewer or no guesses once the batch "
                 "is compute-bound); add --fixed-k to always draft up to k"]
        if r.max_concurrency is not None:
            notes.append(f"speculation paid up to {r.max_concurrency} concurrent requests; specdec serve's load-aware "
                         "cap backs off above that by itself, no flag needed")
        if (r.ngram_min, r.ngram_max) != (1, 4):
            notes.append("specdec serve's prompt lookup always matches n from 4 down to 1 (no flag); "
                         "ngram_min/ngram_max only shape the other frameworks' settings")
        return True, f"specdec serve --model {m} --method ngram -k {r.k}", notes
    draft = f" --draft {_q(r.draft)}" if r.draft else ""
    if r.method == "auto" and r.base == "eagle":  # the server's own auto: prompt lookup + the EAGLE head's trees
        notes = ["specdec serve chooses per step, from measured step times, the draft length and which rows draft "
                 "the head's tree (the tree shape of specdec generate's defaults: depth 4, width 2, 5 nodes); "
                 "add --fixed-k to always draft"]
        if r.max_concurrency is not None:
            notes.append(f"speculation paid up to {r.max_concurrency} concurrent requests; the load-aware choice "
                         "backs off above that by itself, no flag needed")
        return True, f"specdec serve --model {m} --method auto{draft} -k {r.k}", notes
    notes = [f"specdec serve drafts with prompt lookup, or prompt lookup + an EAGLE head (--method auto --draft "
             f"HEAD); --method {r.method} runs offline with specdec generate (the command above). Serving with "
             f"specdec: specdec serve --model {m} --method ngram -k {r.k}"]
    if not r.draft:
        notes.append("without --draft, specdec generate uses the draft or head shipped for the default target, if any")
    return True, f"specdec generate --model {m} --method {r.method}{draft} -k {r.k}", notes


def _vllm(r: _Req) -> tuple[bool, str, list[str]]:
    notes: list[str] = []
    if r.base == "ngram":
        cfg: dict = {"method": "ngram", "num_speculative_tokens": r.k, "prompt_lookup_max": r.ngram_max,
                     "prompt_lookup_min": r.ngram_min}
        notes.append("vLLM proposes a continuation of an n-gram match between prompt_lookup_min and prompt_lookup_max "
                     "tokens long (both default to 5 when unset); specdec also shortens drafts adaptively")
    elif r.base == "draft":
        cfg = {"method": "draft_model", "model": r.draft or "DRAFT_MODEL", "num_speculative_tokens": r.k}
        if not r.draft:
            notes.append("DRAFT_MODEL stands for the draft model (a Hugging Face id or folder)")
        notes.append("the draft must share the target's vocabulary (vLLM compares vocabulary sizes); vLLM 0.10.0 had "
                     "no draft-model support in its V1 engine (per its docs), so use a version that lists method "
                     "'draft_model'")
    else:
        head = "EAGLE_HEAD" if r.base == "eagle" else "MEDUSA_HEADS"
        cfg = {"method": r.base, "model": head, "num_speculative_tokens": r.k}
        layout = ("an EAGLE checkpoint in the layout vLLM loads (e.g. the yuhuili/EAGLE-* repos; method 'eagle3' "
                  "for EAGLE-3 heads)" if r.base == "eagle" else
                  "Medusa heads in the layout vLLM loads (e.g. FasterDecoding/medusa-* checkpoints; k at most the "
                  "number of heads)")
        notes.append(f"replace {head} with {layout}. specdec's {r.base} head folder is specdec's own format, not "
                     "that layout: it needs conversion, which specdec does not do, and a different head means "
                     "different acceptance")
        notes.append("by default vLLM drafts one chain of k tokens, not specdec's token tree, so re-measure")
    if r.method == "auto":
        notes.append(_auto_note(r, "vLLM runs one proposer per server"))
    if r.max_concurrency is not None:
        n = r.max_concurrency
        cfg["num_speculative_tokens_per_batch_size"] = [[1, n, r.k], [n + 1, max(n + 1, _VLLM_TOP_BATCH), 0]]
        notes.append(f"num_speculative_tokens_per_batch_size (vLLM's dynamic speculative decoding) drafts k tokens up "
                     f"to {n} concurrent sequences and none above; the last range ends at "
                     f"{max(n + 1, _VLLM_TOP_BATCH)}, raise it if --max-num-seqs is larger. vLLM's docs say it was "
                     "tested with EAGLE, EAGLE-3 and DFlash (other methods 'may or may not work') and that it is "
                     "turned off with --data-parallel-size > 1")
        notes.append("the older disable_by_batch_size key (--speculative-disable-by-batch-size) has done nothing "
                     "since vLLM 0.10.0 (V0 engine removed) and was later removed from the config")
    notes.append("before vLLM ~0.8 the same settings were separate flags: --speculative-model ('[ngram]' for prompt "
                 "lookup), --num-speculative-tokens, --ngram-prompt-lookup-max/--ngram-prompt-lookup-min")
    return True, f"vllm serve {_q(r.model)} --speculative-config {_q(json.dumps(cfg))}", notes


def _llamacpp(r: _Req) -> tuple[bool, str, list[str]]:
    cmd = f"llama-server -m {_q(r.gguf or r.model)}"
    draft = _q(r.draft or "DRAFT.gguf")
    ngram = f"--spec-ngram-simple-size-n {r.ngram_max} --spec-ngram-simple-size-m {r.k}"
    notes = [] if r.gguf else ["llama-server loads GGUF files only: convert Hugging Face folders with llama.cpp's "
                               "convert_hf_to_gguf.py"]
    if r.base == "draft" and not r.draft:
        notes.append("DRAFT.gguf stands for the draft model")
    elif r.base == "draft" and not r.draft.endswith(".gguf"):
        notes.append(f"-md takes a GGUF file: convert {r.draft} with llama.cpp's convert_hf_to_gguf.py first")
    ngram_note = (f"ngram-simple matches exactly the last {r.ngram_max} tokens (size-n; no fallback to shorter "
                  f"n-grams down to {r.ngram_min}) and drafts up to k tokens that followed (size-m); ngram-map-k and "
                  "ngram-mod are other draftless types")
    if r.base == "medusa":
        return False, "", ["llama-server has no Medusa heads among its --spec-type choices (draft models, EAGLE-3, "
                           "MTP and draftless n-gram types); prompt lookup (--spec-type ngram-simple) needs no heads"]
    if r.base == "ngram":
        cmd += f" --spec-type ngram-simple {ngram}"
        notes.append(ngram_note)
        if r.method == "auto":
            notes.append(_auto_note(r, "llama-server"))
    elif r.base == "draft" and r.method == "auto":
        cmd += f" --spec-type draft-simple,ngram-simple -md {draft} --spec-draft-n-max {r.k} {ngram}"
        notes.append("llama-server takes a draft model and a draftless type together (comma-separated --spec-type) "
                     "and picks between their drafts itself: the closest match to specdec auto, though not its rule")
        notes.append(ngram_note)
    elif r.base == "draft":
        cmd += f" --spec-type draft-simple -md {draft} --spec-draft-n-max {r.k}"
        notes.append("-md is --spec-draft-model (alias --model-draft); the draft must share the target's vocabulary")
    else:  # eagle
        cmd += f" --spec-type draft-eagle3 -md EAGLE3_HEAD.gguf --spec-draft-n-max {r.k}"
        notes.append("llama-server's nearest equivalent is EAGLE-3 only: EAGLE3_HEAD.gguf is an EAGLE-3 checkpoint "
                     "for this target converted with convert_hf_to_gguf.py (--target-model-dir). specdec's EAGLE head "
                     "folder is specdec's own format and cannot be converted by specdec; a different head means "
                     "different acceptance, so re-measure")
        notes.append("llama-server drafts one chain of up to k tokens per step, not specdec's dynamic token tree")
        if r.method == "auto":
            notes.append(_auto_note(r, "llama-server"))
    notes.append("--draft/--draft-max and --draft-min were removed (llama-server now refuses them): use "
                 "--spec-draft-n-max/--spec-draft-n-min; --spec-ngram-size-n/-size-m became per-type options "
                 "such as --spec-ngram-simple-size-n/-size-m")
    notes += _concurrency_elsewhere(r, "llama-server", f"e.g. -np {r.max_concurrency} caps an instance's parallel "
                                    "slots; send the overflow to an instance without --spec-type")
    return True, cmd, notes


def _tgi(r: _Req) -> tuple[bool, str, list[str]]:
    notes = ["TGI is in maintenance mode since December 2025 (its README: only minor bug fixes, documentation and "
             "maintenance are accepted; Hugging Face points to vLLM, SGLang and llama.cpp instead)"]
    ngram_cmd = f"text-generation-launcher --model-id {_q(r.model)} --speculate {r.k}"
    ngram_note = ("without Medusa or MLP-speculator heads in the model repo, --speculate uses n-gram speculation: it "
                  "finds the first earlier occurrence of the last token and copies the k tokens after it, with no "
                  "n-gram window (ngram_min/ngram_max have no TGI equivalent)")
    if r.base in ("draft", "eagle"):
        what = "independent draft models" if r.base == "draft" else "EAGLE heads"
        notes.insert(0, f"TGI has no {what}: it speculates with Medusa or MLP-speculator heads, or n-grams")
        if r.method == "auto":
            notes.insert(1, f"only specdec auto's prompt-lookup half carries over: {ngram_cmd}")
        return False, "", notes
    if r.base == "medusa":
        cmd = f"text-generation-launcher --model-id MEDUSA_REPO --speculate {r.k}"
        notes += ["MEDUSA_REPO: a Medusa repo in TGI's layout (config.json with medusa_num_heads and "
                  "base_model_name_or_path, plus medusa_lm_head.safetensors); TGI loads the base model named there "
                  "and refuses --speculate above medusa_num_heads (the default). specdec's Medusa head folder is "
                  "specdec's own format: it needs conversion, which specdec does not do",
                  "TGI drafts one chain from each head's top token, not specdec's static tree, so re-measure"]
    else:
        cmd = ngram_cmd
        notes.append(ngram_note)
        if r.method == "auto":
            notes.append(_auto_note(r, "TGI"))
    notes += _concurrency_elsewhere(r, "TGI", f"--max-concurrent-requests {r.max_concurrency} makes an instance "
                                    "refuse more; send the overflow to an instance without --speculate")
    return True, cmd, notes


def _auto_note(r: _Req, who: str) -> str:
    if r.base == "eagle":
        return (f"{who}: these are specdec auto's EAGLE settings; auto also uses prompt lookup where the text "
                "repeats, which is dropped here")
    if r.draft:
        return (f"{who}: these are specdec auto's draft-model settings; auto also uses prompt lookup where the text "
                "repeats, which is dropped here")
    return f"{who}: specdec auto without a draft model is prompt lookup, so these are the n-gram settings"


_BUILDERS = {"specdec": _specdec, "vllm": _vllm, "llama.cpp": _llamacpp, "tgi": _tgi}
