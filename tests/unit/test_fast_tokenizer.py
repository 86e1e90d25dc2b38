"""specdec's own tokenizer/config reading against transformers' AutoTokenizer / AutoConfig (the oracle).

The fast path only pays if it gives the same ids, text and rendered chats as transformers for
the folders it accepts; these tests compare both on the default model's folder, on texts
chosen to stress byte-level BPE (unicode, partial UTF-8, special tokens inside text), and on
several chat templates using the Jinja features real templates use.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from specdec.models.llama import LlamaConfig
from specdec.models.tokenizer import FastTokenizer, light_config, load_fast_tokenizer

pytestmark = pytest.mark.default_model

TEXTS = [
    "", " ", "  leading spaces", "Hello, world!", "def f(x):\n    return x ** 2\n\n\n",
    "tabs\tand\r\nwindows line ends", "naïve café — “quotes” … ½ ∑ 😀👍🏽 中文 日本語 한국어",
    "<|im_start|>user\nhi<|im_end|>", "text with <|endoftext|> inside", "<|im_start|>",
    "trailing space ", "1234567890 3.14159 -42 1e-9", "a" * 300, "🙂" * 20,
    "Mixed\u00a0no-break\u2009thin\u200bzero-width", "ＦＵＬＬ　ＷＩＤＴＨ", "\x00\x01control",
]


@pytest.fixture(scope="module")
def pair(default_hf_folder):
    from transformers import AutoTokenizer

    d = default_hf_folder
    fast = load_fast_tokenizer(d)
    assert isinstance(fast, FastTokenizer), "the default model's folder should take the fast path"
    return fast, AutoTokenizer.from_pretrained(str(d))


def test_loader_uses_the_fast_tokenizer(default_model):
    assert isinstance(default_model.tokenizer, FastTokenizer)


def test_encode_matches_transformers(pair):
    fast, hf = pair
    for t in TEXTS:
        for special in (True, False):
            assert fast.encode(t, add_special_tokens=special) == hf.encode(t, add_special_tokens=special), (t, special)


def test_decode_matches_transformers(pair):
    fast, hf = pair
    rng = random.Random(0)
    vocab = len(hf)
    seqs = [hf.encode(t) for t in TEXTS if t]
    seqs += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    seqs += [s[: len(s) // 2] for s in seqs if len(s) > 1]  # cut mid-character: partial UTF-8
    seqs += [[0, 1, 2, 5, 1, 2], [2], [1, 2, 3]]  # special tokens
    for s in seqs:
        for skip in (True, False):
            assert fast.decode(s, skip_special_tokens=skip) == hf.decode(s, skip_special_tokens=skip), (s, skip)


def test_special_tokens_and_vocab_match(pair):
    fast, hf = pair
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(fast, name) == getattr(hf, name), name
    assert fast.get_vocab() == hf.get_vocab()
    assert len(fast) == len(hf)


CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1 ünïcode 😀"},
     {"role": "user", "content": "  spaced\n\nlines  "}],
    [{"role": "user", "content": ""}],
]

TEMPLATES = [
    None,  # the model's own
    # namespace, loop controls, raise_exception, tojson of non-ASCII text, whitespace control
    "{% set ns = namespace(sys='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.sys = m['content'] %}{% continue %}{% endif %}"
    "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ bos_token }}[{{ m['role'] | upper }}] {{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if ns.sys %}SYS={{ ns.sys | tojson }}{% endif %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
    # trim_blocks / lstrip_blocks behaviour over a multi-line template
    "{% for message in messages %}\n    {% if loop.first %}\n<start>\n    {% endif %}\n"
    "{{ message.role }}: {{ message.content }}\n{% endfor %}\n"
    "{% if add_generation_prompt %}\nassistant:{% endif %}",
    # Llama-3 style: strftime_now exists, loop.last, string slicing
    "{% set date = strftime_now('%Y') %}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'][:50] + '<|im_end|>' }}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{% endif %}",
]


@pytest.mark.parametrize("template", range(len(TEMPLATES)))
def test_chat_template_matches_transformers(pair, template):
    fast, hf = pair
    t = TEMPLATES[template]
    saved = fast.chat_template
    try:
        if t is not None:
            fast.chat_template = t
        for chat in CHATS:
            for gen in (True, False):
                want = hf.apply_chat_template(chat, chat_template=t, add_generation_prompt=gen, tokenize=False)
                assert fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == want
                ids = hf.apply_chat_template(chat, chat_template=t, add_generation_prompt=gen, tokenize=True)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                assert fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True) == list(ids)
    finally:
        fast.chat_template = saved


def test_template_errors_and_sandbox(pair):
    import jinja2

    fast, _ = pair
    saved = fast.chat_template
    try:
        fast.chat_template = TEMPLATES[1]
        with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
            fast.render_chat([{"role": "tool", "content": "x"}])
        fast.chat_template = "{% set ns = namespace() %}{% set ns._x = 1 %}"
        with pytest.raises(jinja2.exceptions.SecurityError):
            fast.render_chat([])
        fast.chat_template = "{{ messages.__class__.__mro__ }}"
        with pytest.raises(jinja2.exceptions.SecurityError):
            fast.render_chat([])
    finally:
        fast.chat_template = saved


def test_save_pretrained_round_trip(pair, tmp_path):
    from transformers import AutoTokenizer

    fast, hf = pair
    fast.save_pretrained(tmp_path)
    again = load_fast_tokenizer(tmp_path)
    assert again is not None and again.chat_template == fast.chat_template
    hf2 = AutoTokenizer.from_pretrained(str(tmp_path))  # transformers reads what it wrote
    for t in TEXTS:
        assert again.encode(t) == fast.encode(t) == hf2.encode(t)
    assert hf2.apply_chat_template(CHATS[1], tokenize=False) == fast.apply_chat_template(CHATS[1], tokenize=False)


def _copy(default_hf_folder, tmp_path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    for f in default_hf_folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    return d


@pytest.mark.parametrize("change", [
    {"tokenizer_class": "LlamaTokenizerFast"}, {"clean_up_tokenization_spaces": True},
    {"add_bos_token": True}, {"additional_special_tokens": ["<x>"]},
])
def test_unusual_tokenizer_folders_go_to_transformers(default_hf_folder, tmp_path, change):
    d = _copy(default_hf_folder, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **change}))
    assert load_fast_tokenizer(d) is None


def test_merges_as_strings_name_the_same_merges(default_hf_folder, tmp_path):
    """The converted tokenizer's merges rewritten as "a b" strings (merges_as_strings) encode every
    text as the ["a", "b"] pairs tokenizers writes do; the same merges in another order give other
    ids, so the comparison can fail; a merge part holding a space leaves the file as it was."""
    from tokenizers import Tokenizer

    from specdec.models.tokenizer import merges_as_strings

    data = json.loads((default_hf_folder / "tokenizer.json").read_text(encoding="utf-8"))
    merges = data["model"]["merges"]
    data["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    pairs, strings, reordered = (tmp_path / f"{n}.json" for n in ("pairs", "strings", "reordered"))
    for f in (pairs, strings):
        f.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    assert merges_as_strings(strings)
    assert all(isinstance(m, str) for m in json.loads(strings.read_text(encoding="utf-8"))["model"]["merges"])
    rng = random.Random(0)
    alphabet = "".join(TEXTS) + "abcdefghijklmnopqrstuvwxyz     \n"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(200)]
    a, b = Tokenizer.from_file(str(pairs)), Tokenizer.from_file(str(strings))
    assert [a.encode(t).ids for t in texts] == [b.encode(t).ids for t in texts]

    data["model"]["merges"] = data["model"]["merges"][::-1]
    reordered.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    c = Tokenizer.from_file(str(reordered))
    assert [a.encode(t).ids for t in texts] != [c.encode(t).ids for t in texts]

    data["model"]["merges"][0] = ["a b", "c"]
    pairs.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    before = pairs.read_text(encoding="utf-8")
    assert not merges_as_strings(pairs) and pairs.read_text(encoding="utf-8") == before


def test_missing_tokenizer_files_go_to_transformers(default_hf_folder, tmp_path):
    d = _copy(default_hf_folder, tmp_path)
    (d / "tokenizer.json").unlink()
    assert load_fast_tokenizer(d) is None


def test_light_config_matches_autoconfig(default_hf_folder, tmp_path):
    from transformers import AutoConfig

    d = default_hf_folder
    light = light_config(d)
    assert light is not None
    assert LlamaConfig.from_hf(light) == LlamaConfig.from_hf(AutoConfig.from_pretrained(str(d)))
    # the legacy top-level rope_theta spelling gives the same native config
    d2 = _copy(default_hf_folder, tmp_path)
    raw = json.loads((d2 / "config.json").read_text())
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    (d2 / "config.json").write_text(json.dumps(raw))
    assert LlamaConfig.from_hf(light_config(d2)) == LlamaConfig.from_hf(AutoConfig.from_pretrained(str(d2)))


@pytest.mark.parametrize("change", [
    {"model_type": "qwen2"}, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, {"rms_norm_eps": None},
])
def test_unusual_configs_go_to_autoconfig(default_hf_folder, tmp_path, change):
    d = _copy(default_hf_folder, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw.update(change)
    if change.get("rms_norm_eps", 0) is None:
        del raw["rms_norm_eps"]  # a family default would apply: not guessed here
    (d / "config.json").write_text(json.dumps(raw))
    assert light_config(d) is None


def test_a_post_processor_that_adds_bos(default_hf_folder, tmp_path):
    """A tokenizer.json whose post-processor adds BOS: plain encode adds it, the chat template's ids do not
    (transformers tokenizes a rendered chat without special tokens; the template writes its own)."""
    from transformers import AutoTokenizer

    d = _copy(default_hf_folder, tmp_path)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                       {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    fast, hf = load_fast_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert fast.encode("hi there")[0] == 1
    for t in TEXTS:
        for special in (True, False):
            assert fast.encode(t, add_special_tokens=special) == hf.encode(t, add_special_tokens=special)
    ids = hf.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert fast.apply_chat_template(CHATS[0], add_generation_prompt=True) == list(ids)
