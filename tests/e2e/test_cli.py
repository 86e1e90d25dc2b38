"""The `specdec` command: errors are one line + exit 2; generate works end to end on the
default model (integration, marked default_model), and its greedy output equals plain
greedy decoding by transformers on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdec.cli import main


def run_cli(args, stdin: str | None = None):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def one_error_line(stderr: str) -> str:
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert "Traceback" not in stderr
    assert lines and lines[-1].startswith("specdec: error: "), stderr
    return lines[-1]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--temperature", "inf"], "temperature"),
        (["generate", "hi", "--temperature", "0.8", "--seed", str(2**70)], "seed"),
        (["generate", "hi", "--top-p", "0"], "top-p"),
        (["generate", "hi", "--top-p", "1.5"], "top-p"),
        (["generate", "hi", "--top-k", "-3"], "top-k"),
        (["generate", "hi", "--min-p", "2"], "min-p"),
        (["generate", "hi", "--model", "/no/such/model"], "/no/such/model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in one_error_line(err)


def test_argparse_errors_exit_2_without_traceback():
    rc, _, err = run_cli(["generate", "hi", "--max-new-tokens", "zero"])
    assert rc == 2 and "Traceback" not in err and "max-new-tokens" in err


def test_serve_port_out_of_range_is_refused_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "99999"])
    assert e.value.code == 2
    assert "--port: must be <= 65535, got 99999" in capsys.readouterr().err
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--body-timeout", bad])
        assert e.value.code == 2 and "--body-timeout" in capsys.readouterr().err


def test_corrupt_gguf(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert main(["generate", "hi", "--model", str(bad)]) == 2
    assert "GGUF" in one_error_line(capsys.readouterr().err)


def test_malformed_prompts_file_names_the_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{not json}\n')
    assert main(["generate", "--prompts-file", str(f)]) == 2
    assert f"{f}:2" in one_error_line(capsys.readouterr().err)
    f.write_text('{"text": "no prompt field"}\n')
    assert main(["generate", "--prompts-file", str(f)]) == 2
    assert "prompt" in one_error_line(capsys.readouterr().err)


def test_prompt_that_is_not_utf8(capsys):
    """A non-UTF-8 argument reaches Python as lone surrogates; the tokenizer used to fail with a TypeError."""
    assert main(["generate", "abc \udced\udca0\udc80"]) == 2
    assert "the prompt argument is not valid UTF-8" in one_error_line(capsys.readouterr().err)
    assert main(["generate", "hi", "--system", "\udcff"]) == 2
    assert "--system is not valid UTF-8" in one_error_line(capsys.readouterr().err)
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate"], input=b"\xff\xfe caf\xe9\n",
                          capture_output=True, timeout=300)
    assert proc.returncode == 2
    assert "stdin is not UTF-8" in one_error_line(proc.stderr.decode())


def test_no_prompt_at_all():
    rc, _, err = run_cli(["generate"], stdin="")
    assert rc == 2 and "empty" in one_error_line(err)


def test_draft_flag_needs_a_draft_method(capsys):
    assert main(["generate", "hi", "--draft", "x", "--method", "ngram"]) == 2
    assert "--draft" in one_error_line(capsys.readouterr().err)


@pytest.mark.default_model
@pytest.mark.parametrize("method, needle", [("eagle", "not an EAGLE head"), ("medusa", "Medusa heads")])
def test_head_method_with_a_non_head_folder(default_model, tmp_path, method, needle, capsys):
    assert main(["generate", "hi", "--method", method, "--draft", str(tmp_path)]) == 2
    assert needle in one_error_line(capsys.readouterr().err)


@pytest.mark.default_model
@pytest.mark.parametrize("method", ["draft", "auto", "eagle", "medusa"])
def test_draft_path_that_is_missing_or_of_another_kind(default_model, tmp_path, method, capsys):
    """--draft names nothing, or a folder of another kind: the error names the path and what the method
    needs (it used to talk about --model, or tell someone who passed --draft to pass --draft)."""
    assert main(["generate", "hi", "--method", method, "--draft", str(tmp_path / "nope")]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "no such file or folder" in err and f"--method {method} needs" in err and "--model" not in err
    other = tmp_path / "other"
    other.mkdir()
    (other / ("specdec_eagle.json" if method == "medusa" else "specdec_medusa.json")).write_text("{}")
    assert main(["generate", "hi", "--method", method, "--draft", str(other)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"{other} is not" in err and "it holds" in err and "--model" not in err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "hi", "--method", "eagle", "--tree-nodes", "100000"], "--tree-nodes: must be <= 48, got 100000"),
    (["generate", "hi", "--method", "ngram", "-k", "49"], "--num-draft-tokens: must be <= 48, got 49"),
    (["serve", "-k", "64"], "--num-draft-tokens: must be <= 48, got 64"),
])
def test_steps_longer_than_the_kernels_verify_exactly_are_refused_before_loading(argv, needle, capsys):
    """Guesses and tree nodes are capped (types.MAX_GUESSES) so that a step stays within the tokens
    the kernels verify bit for bit as plain decoding computes them (models/llama.py ATTEND_MAX_T);
    the Engine and the server's batcher refuse more guesses too."""
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.models.llama import ATTEND_MAX_T
    from specdec.types import MAX_GUESSES, SpecdecError

    assert 1 + MAX_GUESSES <= ATTEND_MAX_T  # (a lookup grafted onto a tree stays within the step's slots)
    with pytest.raises(SpecdecError, match="between 0 and 48"):
        Engine(None, NgramDrafter(), k=MAX_GUESSES + 1)
    with pytest.raises(SpecdecError, match="at most 48 guesses"):
        ContinuousBatcher(None, (), [NgramDrafter()], k_max=MAX_GUESSES + 1, thread=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_train_medusa_features_need_data(tmp_path, capsys):
    assert main(["train", "medusa", "--out", str(tmp_path / "o"), "--features", str(tmp_path)]) == 2
    assert "--data" in one_error_line(capsys.readouterr().err)


NEAR_TIE = 0.25  # logits: a gap of two logits that 8-bit activations may reverse against float32


# -- integration on the default model ---------------------------------------------------
@pytest.mark.default_model
def test_generate_json_matches_transformers_greedy(default_model, default_hf_model, capsys):
    from specdec.text import encode_prompt

    prompt = "Name three colours."
    assert main(["generate", prompt, "--json", "--max-new-tokens", "12", "--quiet"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    ids = encode_prompt(default_model.tokenizer, prompt, None)
    out = default_hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(ids):].tolist()
    # the default model computes on 8-bit activations, transformers in float32 over the same weights:
    # a gap of two logits moves (this prompt's 5th token: transformers' 0.10 became -0.007), so the texts
    # agree up to transformers' first near-tie (top two within NEAR_TIE), where either token is right
    tops = [s[0].topk(2) for s in out.scores]
    tie = next((i for i, t in enumerate(tops) if float(t.values[0] - t.values[1]) < NEAR_TIE), len(ref))
    got = obj["token_ids"]
    assert tie >= 3 and got[:tie] == ref[:tie], (got, ref, tie)
    if tie < len(ref):
        assert got[tie] in tops[tie].indices.tolist(), (got, ref, tie)
    else:
        assert obj["text"] == default_model.tokenizer.decode(ref, skip_special_tokens=True)
    st = obj["stats"]
    assert st["new_tokens"] == len(got) and st["prompt_tokens"] == len(ids)
    assert st["decode_s"] > 0 and st["prefill_s"] > 0 and st["tokens_per_s"] > 0


@pytest.mark.default_model
def test_generate_streams_text_and_summary(default_model):
    rc, out, err = run_cli(["generate", "What is 2+2?", "--max-new-tokens", "8", "--method", "ngram"])
    assert rc == 0, err
    assert out.strip()
    assert "[specdec]" in err and "tok/s" in err and "acceptance" in err


@pytest.mark.default_model
def test_one_token_has_no_decode_rate(default_model, capsys):
    """The only token comes from the prefill: no decode step, so no rate (it was a huge number)."""
    assert main(["generate", "Hello", "--max-new-tokens", "1", "--json", "--method", "ngram"]) == 0
    cap = capsys.readouterr()
    st = json.loads(cap.out)["stats"]
    assert st["new_tokens"] == 1 and st["target_forwards"] == 0 and st["tokens_per_s"] == 0
    assert "1 token from the prefill, no decode step" in cap.err and "tok/s" not in cap.err


@pytest.mark.default_model
def test_chat_flag_and_raw(default_model, capsys):
    assert main(["generate", "Hello", "--raw", "--json", "--max-new-tokens", "3", "--quiet"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert main(["generate", "Hello", "--chat", "--json", "--max-new-tokens", "3", "--quiet"]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert raw["stats"]["prompt_tokens"] < chat["stats"]["prompt_tokens"]  # the template adds tokens


@pytest.mark.default_model
def test_stop_string_cuts_text(default_model, capsys):
    assert main(["generate", "Count from 1 to 10, separated by commas.", "--json", "--max-new-tokens", "40",
                 "--quiet"]) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    assert "5" in full, full  # the model does count; the stop test below relies on it
    assert main(["generate", "Count from 1 to 10, separated by commas.", "--json", "--max-new-tokens", "40",
                 "--stop", "5", "--quiet"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["finish_reason"] == "stop"
    assert obj["text"] == full[: full.index("5")]


@pytest.mark.default_model
def test_streamed_text_stops_before_the_stop_string(default_model, capsys):
    """Streaming to the terminal with --stop: what was printed is the text up to the stop (text
    that could still become it is held back, never printed and taken back)."""
    args = ["generate", "Count from 1 to 10, separated by commas.", "--max-new-tokens", "40", "--quiet"]
    assert main(args + ["--json"]) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    assert ", 5" in full, full
    for stop in ("5", ", 5", ""):
        assert main(args + ["--stop", stop]) == 0
        printed = capsys.readouterr().out
        assert printed == (full[: full.index(stop)] if stop else full) + "\n", (stop, printed)


@pytest.mark.default_model
def test_n_samples_batch_and_seed(default_model, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Say a word."}) + "\n" + json.dumps({"prompt": "Say a number."}) + "\n")
    args = ["generate", "--prompts-file", str(f), "--json", "--n", "2", "--temperature", "0.9", "--seed", "7",
            "--max-new-tokens", "6", "--batch-size", "3", "--quiet"]
    assert main(args) == 0
    first = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    assert [o["index"] for o in first] == [0, 1] and all(len(o["completions"]) == 2 for o in first)
    assert main(args) == 0
    again = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    assert [c["token_ids"] for o in first for c in o["completions"]] == \
        [c["token_ids"] for o in again for c in o["completions"]]


@pytest.mark.default_model
def test_prompts_file_rows_choose_chat_or_raw(default_model, tmp_path, capsys):
    """A row's own "chat": false / true wins over --chat / --raw; rows without it follow the flags."""
    from specdec.text import encode_prompt

    tok = default_model.tokenizer
    text = "def add(a, b):"
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in ({"prompt": text, "chat": False}, {"prompt": text},
                                                      {"prompt": text, "chat": True})) + "\n")
    raw, chat = len(encode_prompt(tok, text, False)), len(encode_prompt(tok, text, True))
    assert raw != chat
    for flag, middle in (([], chat), (["--raw"], raw), (["--chat"], chat)):
        assert main(["generate", "--prompts-file", str(f), "--json", "--max-new-tokens", "1", "--method", "none",
                     "--quiet", *flag]) == 0
        objs = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
        assert [o["stats"]["prompt_tokens"] for o in objs] == [raw, middle, chat], flag


@pytest.mark.default_model
def test_prompt_longer_than_context(default_model, capsys):
    long_prompt = "word " * 9000
    assert main(["generate", long_prompt, "--raw"]) == 2
    assert "context" in one_error_line(capsys.readouterr().err)


@pytest.mark.default_model
def test_empty_raw_prompt(default_model, tmp_path, capsys):
    assert main(["generate", "", "--raw"]) == 2
    assert "the prompt is empty" in one_error_line(capsys.readouterr().err)
    f = tmp_path / "p.jsonl"  # a prompts-file row: the message names the file and the prompt
    f.write_text('{"prompt": "hi"}\n{"prompt": "", "chat": false}\n')
    assert main(["generate", "--prompts-file", str(f), "--max-new-tokens", "1"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{f}: prompt 2 is empty" in line


@pytest.mark.default_model
def test_k0_drafts_nothing_for_every_method(default_model, capsys):
    """-k 0 used to be ignored by auto (raised to 1) and the eagle tree (which drafts --tree-depth)."""
    args = ["generate", "the cat sat on the mat. the cat sat on the", "--raw", "--json", "--max-new-tokens", "6"]
    assert main([*args, "--method", "none", "--quiet"]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    for method in ("auto", "eagle"):
        assert main([*args, "--method", method, "-k", "0"]) == 0
        captured = capsys.readouterr()
        obj = json.loads(captured.out)
        assert obj["stats"]["proposed"] == 0 and obj["token_ids"] == plain, method
        assert "no drafting" in captured.err
    assert main([*args, "--method", "eagle", "-k", "3"]) == 0
    assert "-k 3 is not used by the eagle tree" in capsys.readouterr().err


@pytest.mark.default_model
def test_chat_without_template(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "m"
    cfg = LlamaConfig(vocab_size=default_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(d)
    from specdec.models.loader import load_model

    tok = load_model().tokenizer
    tok.chat_template = None
    tok.save_pretrained(d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    assert main(["generate", "hi", "--model", str(d), "--chat"]) == 2
    assert "chat template" in one_error_line(capsys.readouterr().err)


@pytest.mark.default_model
def test_notes_for_a_short_context_and_greedy_n(tmp_path, capsys):
    """A prompt near the end of the context used to stop early with finish_reason 'length' and no word why;
    --n with greedy decoding silently repeated one completion."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.loader import load_model

    d = tmp_path / "m"
    cfg = LlamaConfig(vocab_size=default_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(d)
    load_model().tokenizer.save_pretrained(d)
    prompt = " ".join(["word"] * 50)
    assert main(["generate", prompt, "--model", str(d), "--raw", "--method", "none", "--max-new-tokens", "32",
                 "--json", "--n", "2"]) == 0
    captured = capsys.readouterr()
    obj = json.loads(captured.out)
    n_prompt = obj["stats"]["prompt_tokens"]
    assert f"has {n_prompt} tokens, so at most {64 - n_prompt} of --max-new-tokens 32 fit" in captured.err
    assert "--n 2 with greedy decoding gives 2 identical completions" in captured.err
    assert obj["stats"]["new_tokens"] <= 64 - n_prompt


def default_vocab_size() -> int:
    return 49152


@pytest.mark.default_model
def test_batches_of_samples_differ(default_model, capsys):
    """--n 4 --batch-size 2 with a seed: the second batch must not repeat the first."""
    assert main(["generate", "Name an animal.", "--json", "--n", "4", "--batch-size", "2", "--temperature", "1.0",
                 "--seed", "3", "--max-new-tokens", "8", "--quiet"]) == 0
    comps = json.loads(capsys.readouterr().out)["completions"]
    ids = [c["token_ids"] for c in comps]
    assert ids[:2] != ids[2:]


@pytest.mark.parametrize("argv, drafter, chat, expect", [
    (["--method", "ngram", "--tree-depth", "6"], "other", True, ["--tree-depth does nothing with prompt lookup"]),
    (["--method", "eagle", "--tree-depth", "6", "--tree-nodes", "9"], "other", True, []),
    (["--method", "eagle", "--no-tree", "--tree-width", "3"], "other", True, ["--tree-width does nothing"]),
    (["--method", "eagle", "-k", "3"], "other", True, ["-k 3 is not used by the eagle tree"]),
    (["--method", "auto", "--tree-depth", "6", "--tree-nodes", "7"], "lookup-eagle", True, []),
    (["--method", "auto", "--no-tree"], "lookup-eagle", True, ["--no-tree does nothing with auto (its EAGLE"]),
    (["--method", "auto", "--tree-depth", "6"], "other", True, ["--tree-depth does nothing with auto here"]),
    (["--method", "auto", "-k", "0", "--tree-nodes", "9"], None, True, ["--tree-nodes does nothing with -k 0"]),
    (["--method", "medusa", "--tree-nodes", "6", "--no-tree"], "other", True, ["--tree-nodes does nothing"]),
    (["--method", "medusa", "--tree-nodes", "6"], "other", True, []),
    (["--method", "none", "-k", "3"], None, True, ["-k 3 is not used by --method none"]),
    (["--top-p", "0.9", "--seed", "1"], "lookup-eagle", True, ["--top-p, --seed only apply to sampling"]),
    (["--temperature", "0.7", "--top-p", "0.9", "--seed", "1", "--min-p", "0.1"], "lookup-eagle", True, []),
    (["--system", "be brief"], "lookup-eagle", False, ["--system goes into the chat template"]),
    (["--system", "be brief"], "lookup-eagle", True, []),
    ([], "lookup-eagle", True, []),
    (["--draft-confidence", "0.2"], "lookup-eagle", True, ["--draft-confidence only applies to a draft model"]),
    (["--method", "draft", "--draft-confidence", "0.2"], "draft", True, []),
])
def test_notes_for_options_that_do_nothing(argv, drafter, chat, expect):
    """Options that do not apply to the run (tree shapes for chain methods, filters with greedy, a system
    message with raw prompts) used to be dropped without a word."""
    from types import SimpleNamespace

    from specdec.config import SpecConfig, unused_setting_notes
    from specdec.flags import build_parser

    args = build_parser().parse_args(["generate", "x", *argv])
    named = lambda *names: [SimpleNamespace(label=n) for n in names]  # noqa: E731  (the sources' names)
    d = {"lookup-eagle": named("ngram", "eagle"), "other": named("other"), None: [], "draft": named("draft")}[drafter]
    notes = unused_setting_notes(SpecConfig.from_args(args), d, chat, args.system)
    assert len(notes) == len(expect), notes
    for note, want in zip(notes, expect):
        assert note.startswith(want), (note, want)


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--max-new-tokens", "x"], "--max-new-tokens: expected a whole number, got 'x'"),
    (["genrate"], "invalid choice: 'genrate'"),
    (["train", "draft"], "the following arguments are required: --out"),
])
def test_argparse_error_is_one_line_without_usage(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage:" not in err
    assert needle in one_error_line(err) and "--help" in err


def test_help_still_prints_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0 and "usage: specdec generate" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["generate", ""], ["generate", "  \n", "--chat"], ["generate", "", "--raw"]])
def test_empty_prompt_refused_in_chat_and_raw_before_loading(args, capsys, monkeypatch):
    import specdec.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model for an empty prompt"))
    assert main(args) == 2
    assert "the prompt is empty" in one_error_line(capsys.readouterr().err)


def test_empty_chat_row_of_a_prompts_file_is_named(tmp_path, capsys, monkeypatch):
    import specdec.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model for an empty prompt"))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": ""}]}\n')
    assert main(["generate", "--prompts-file", str(f)]) == 2
    assert f"{f}: prompt 2 is empty" in one_error_line(capsys.readouterr().err)


@pytest.mark.default_model
def test_prediction_and_json_schema_files(default_model, tmp_path, capsys):
    """--prediction is a draft (the same greedy text with it); a schema the engine does not support,
    or a file that is not a schema, is one error line naming the flag."""
    assert main(["generate", "Name three colours.", "--json", "--max-new-tokens", "12", "--quiet"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    (tmp_path / "p.txt").write_text(plain["text"])
    assert main(["generate", "Name three colours.", "--json", "--max-new-tokens", "12", "--quiet",
                 "--prediction", str(tmp_path / "p.txt")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[0])["token_ids"] == plain["token_ids"]
    (tmp_path / "bad.json").write_text('{"type": "object", "properties": {"a": {"not": {}}}}')
    (tmp_path / "list.json").write_text("[1, 2]")
    for path, needle in (("bad.json", "'not'"), ("list.json", "must hold a JSON object"), ("none.json", "cannot read")):
        assert main(["generate", "hi", "--json-schema", str(tmp_path / path)]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "--json-schema" in line and needle in line
