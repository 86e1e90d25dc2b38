"""A tokenizer read straight from `tokenizer.json` with the `tokenizers` library, no transformers.

Loading transformers' AutoTokenizer and AutoConfig costs about 1.5 s of every start-up on
a CPU (transformers' own import, then the Llama configuration module, which pulls in
torch.distributed); specdec needs only a small part of what they do: encode, decode, the
special tokens, and the chat template. `FastTokenizer` does that part for the plain
tokenizer folders that transformers itself would hand to the `tokenizers` library
unchanged (`tokenizer_class` TokenizersBackend / PreTrainedTokenizerFast / GPT2, no
whitespace clean-up after decoding, no BOS/EOS flags that rewrite the post-processor);
`load_fast_tokenizer` returns None for anything else, and the caller falls back to
AutoTokenizer. Tests check that encode, decode and the chat template give the same ids and
text as AutoTokenizer on the default model and on several templates.

The chat template renders as transformers renders it: a sandboxed, immutable Jinja
environment with `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that keeps
non-ASCII text, `raise_exception`, `strftime_now`, the special tokens as variables, and no
special tokens added when the rendered text is tokenized, and `tools` (OpenAI-style function
definitions, for templates that render them). It does not know documents, `{% generation %}`
masks or continue-final-message (specdec uses none of them).

`light_config` is the same idea for `config.json`: a plain object with the file's keys as
attributes, for Llama checkpoints that spell out every key the native model reads;
anything else (other families, RoPE scaling, missing keys whose defaults differ by family)
goes to AutoConfig.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

# tokenizer classes whose transformers wrapper only passes text through tokenizer.json
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast"}
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # AddedToken written out as a dict
        v = v.get("content")
    return v if isinstance(v, str) else None


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names (no reaching CPython internals from a template)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    return env.from_string(template)


class FastTokenizer:
    """The part of a transformers tokenizer that specdec uses, over `tokenizers.Tokenizer`."""

    def __init__(self, tk, config: dict, chat_template: str | None, source: Path) -> None:
        self._tk = tk
        self._plain_tk = None  # a copy that reads special-token text as plain text (made when first asked)
        self._config = config
        self.chat_template = chat_template
        self.source = source
        self.special_tokens_map = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        for k in _SPECIAL_KEYS:  # bos_token, bos_token_id, ... as transformers names them (None: not set)
            t = self.special_tokens_map.get(k)
            setattr(self, k, t)
            setattr(self, f"{k}_id", None if t is None else tk.token_to_id(t))

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """split_special_tokens: text that spells a special token (`<|im_start|>`) is read as
        plain text, as transformers' keyword of that name does."""
        tk = self._tk
        if split_special_tokens:
            if self._plain_tk is None:  # a copy of its own: the flag is the tokenizer's state, shared by threads
                self._plain_tk = type(tk).from_str(tk.to_str())
                self._plain_tk.encode_special_tokens = True
            tk = self._plain_tk
        return tk.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def added_tokens_decoder(self) -> dict:
        """{id: AddedToken (.content, .special)}, as transformers' tokenizers have it."""
        return self._tk.get_added_tokens_decoder()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False,
                    tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        msgs = [dict(m) for m in messages]  # a fresh copy: the template sees plain dicts only
        return _compile(self.chat_template).render(messages=msgs, tools=tools or None, documents=None,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **self.special_tokens_map)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict] | None = None):
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, out) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self._tk.save(str(out / "tokenizer.json"))
        cfg = {k: v for k, v in self._config.items() if k != "chat_template"}
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        if self.chat_template:
            (out / "chat_template.jinja").write_text(self.chat_template)


def load_fast_tokenizer(d: Path) -> FastTokenizer | None:
    """A FastTokenizer for the folder `d`, or None when transformers would do more than pass through."""
    tj, tc = d / "tokenizer.json", d / "tokenizer_config.json"
    if not (tj.is_file() and tc.is_file()):
        return None
    try:
        config = json.loads(tc.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in _PLAIN_CLASSES:
        return None
    if config.get("clean_up_tokenization_spaces") or config.get("add_bos_token") or config.get("add_eos_token"):
        return None
    if config.get("added_tokens_decoder") or config.get("additional_special_tokens") \
            or config.get("extra_special_tokens"):
        return None  # extra special tokens are registered by transformers on top of tokenizer.json
    template = config.get("chat_template")
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        return None  # a list of named templates: transformers picks one; leave it to it
    try:
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(tj))
    except Exception:
        return None
    return FastTokenizer(tk, config, template, d)


# keys the native model reads without a fallback of its own; a config.json without one of
# them gets AutoConfig, which knows the family's default
_LIGHT_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "rms_norm_eps", "tie_word_embeddings")


def light_config(d: Path) -> SimpleNamespace | None:
    """config.json as a plain object for fully spelled-out Llama checkpoints, else None."""
    try:
        raw = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama" or raw.get("rope_scaling"):
        return None
    if any(k not in raw for k in _LIGHT_REQUIRED):
        return None
    rope = raw.get("rope_parameters")
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10000.0))}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    cfg = SimpleNamespace(**raw)
    cfg.rope_parameters = dict(rope)
    return cfg


_PROBES = ["def quicksort(arr):\n    if len(arr) <= 1:\n\t\treturn arr  # done", "  leading and trailing  ",
           "Ünïcödé — 東京 🙂 ﬁ", "<|im_start|>user\nhi<|im_end|>", "a\r\n\r\nb 12345 3.14"]


def _mark_plain_if_equal(d: Path, tok) -> None:
    """Where transformers saved a tokenizer under a class of its own (Qwen2Tokenizer, ...) that,
    read from `d` as a FastTokenizer, encodes, decodes and renders the chat template exactly as
    `tok` does on probe texts, record the class as plain in d's tokenizer_config.json, so later
    loads skip transformers (~1.5 s of every start-up); otherwise leave it to AutoTokenizer."""
    cfg_file = d / "tokenizer_config.json"
    config = json.loads(cfg_file.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") in _PLAIN_CLASSES:
        return
    saved = dict(config)
    config["tokenizer_class"] = "TokenizersBackend"
    cfg_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    fast = load_fast_tokenizer(d)
    same = fast is not None
    try:
        for text in _PROBES if same else ():
            ids = tok.encode(text)
            same = same and fast.encode(text) == ids and fast.decode(ids) == tok.decode(ids)
        if same and getattr(tok, "chat_template", None):
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _PROBES[0]}]
            want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            same = fast.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == want
    except Exception:  # a template or tokenizer that one side cannot run: keep transformers'
        same = False
    if not same:
        cfg_file.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# the tokenizer class transformers' AutoTokenizer picks for a GGUF file of these architectures; named
# directly, it skips AutoTokenizer's reading of the model configuration from the file, which for
# these goes through gguf-py's reader: ~25 s and 0.4 GB more at a first load of a 150k-word vocabulary
# (tests/engine/test_gguf_arch.py checks that both give the same tokenizer files)
_GGUF_TOKENIZER_CLASSES = {"qwen2": "Qwen2Tokenizer", "llama": "TokenizersBackend"}


def _gguf_tokenizer_class(gf, auto):
    """The class to convert `gf`'s tokenizer with: _GGUF_TOKENIZER_CLASSES's, else `auto`
    (AutoTokenizer). A llama file named like Mistral goes to `auto`: transformers may read it as
    a Mistral model with another tokenizer."""
    import transformers

    arch, name = gf.architecture, str(gf.meta.get("general.name", ""))
    cls = _GGUF_TOKENIZER_CLASSES.get(arch)
    if cls is None or (arch == "llama" and "mistral" in name.lower()):
        return auto
    return getattr(transformers, cls, None) or auto


def convert_gguf_tokenizer(path: str, out: str) -> None:
    """Convert the tokenizer in the metadata of the GGUF file at `path` with transformers' GGUF
    tokenizer reader (vocabulary, merges, special tokens, chat template) and save it as a tokenizer
    folder `out`, marked plain where a FastTokenizer reads it the same (_mark_plain_if_equal).
    gguf_tokenizer runs this in a child process."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .gguf_file import GGUFFile

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    gf = GGUFFile(Path(path))
    tok = _gguf_tokenizer_class(gf, AutoTokenizer).from_pretrained(str(gf.path.parent), gguf_file=gf.path.name)
    tok.save_pretrained(out)
    merges_as_strings(Path(out) / "tokenizer.json")
    _mark_plain_if_equal(Path(out), tok)


def merges_as_strings(tokenizer_json: Path) -> bool:
    """Rewrite a BPE tokenizer.json's merges from pairs (["a", "b"], what tokenizers writes now) to
    the older strings ("a b") where no merge's part holds a space, so that both forms name the same
    merges. The tokenizers library reads the strings faster at every load (Tokenizer.from_file,
    medians of 5 on a busy Xeon: SmolLM2's 49k merges 0.135 -> 0.109 s, Qwen2.5's 151k 0.51 ->
    0.46 s). Returns whether it rewrote the file."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    model = data.get("model") if isinstance(data, dict) else None
    merges = model.get("merges") if isinstance(model, dict) and model.get("type") == "BPE" else None
    if not merges or not all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) and " " not in p for p in m)
                             for m in merges):
        return False
    model["merges"] = [f"{a} {b}" for a, b in merges]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    return True


def _convert_in_child(gf, tmp: Path) -> None:
    """convert_gguf_tokenizer(gf's file, tmp) in a child Python process: transformers' modules and
    the converter's Python objects (~0.3 GB for a 150k-word vocabulary, which the allocator does not
    give back) never enter the process that then holds the model. One line names what failed."""
    import os
    import subprocess
    import sys

    import specdec

    env = dict(os.environ)
    root = str(Path(specdec.__file__).resolve().parents[1])  # (the child imports this same specdec)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    code = ("import sys\n"
            "from specdec.models.tokenizer import convert_gguf_tokenizer\n"
            "try:\n    convert_gguf_tokenizer(sys.argv[1], sys.argv[2])\n"
            "except Exception as e:  # transformers raises many types for tokenizers it does not know\n"
            "    sys.exit(f'{type(e).__name__}: {str(e)[:200]}')\n")
    done = subprocess.run([sys.executable, "-c", code, str(gf.path), str(tmp)], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        from ..types import SpecdecError

        lines = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
        raise SpecdecError(f"cannot read the tokenizer from {gf.path.name}'s metadata "
                           f"({lines[-1] if lines else f'exit status {done.returncode}'})")


#: the form convert_gguf_tokenizer saves a tokenizer in; a change to it converts every file again
#: (2: merges as strings, merges_as_strings)
TOKENIZER_FORMAT = 2


def tokenizer_folder(gf, cache_dir: Path) -> Path:
    """Where gguf_tokenizer keeps the tokenizer of `gf` (a GGUFFile) under `cache_dir`: keyed by the
    hash of the file's tokenizer metadata (files of one family share it) and TOKENIZER_FORMAT."""
    return Path(cache_dir) / f"{gf.tokenizer_digest()[:24]}-{TOKENIZER_FORMAT}"


def gguf_tokenizer(gf, cache_dir: Path, quiet: bool = False):
    """The tokenizer a GGUF file's metadata describes (`gf`: models.gguf_file.GGUFFile), no hub
    access: converted once (convert_gguf_tokenizer, in a child process) and saved as a tokenizer
    folder under `cache_dir` (tokenizer_folder); later loads read that folder (a FastTokenizer
    where it is plain or checked equal to transformers' on probe texts)."""
    import os
    import shutil
    import sys

    out = tokenizer_folder(gf, cache_dir)
    if not (out / "tokenizer_config.json").is_file():
        if not quiet:
            print(f"[specdec] reading the tokenizer from {gf.path.name}'s metadata once (cached in {out}) ...",
                  file=sys.stderr, flush=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert_in_child(gf, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    tok = load_fast_tokenizer(out)
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(out))
    return tok
