"""The public Python API (specdec.load, Speculator, SpecConfig): its documented example runs, it
decodes exactly what plain decoding and `specdec generate` decode for the same settings, its
text, stop strings and streaming agree with the tokens, and bad settings fail in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec.types import SamplingParams, SpecdecError

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Name three rivers.", "def add(a, b):\n    \"\"\"Return a plus b.\"\"\"\n"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def spec():
    return specdec.load(method="auto")


@pytest.mark.default_model
def test_python_api_page_example_runs(tmp_path):
    """docs/python-api.md's first example, as a user copies it (it asserts greedy equality itself)."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    start = text.index("\n## Load and generate\n")
    code = re.compile(r"```python\n(.*?)\n```", re.S).search(text, start).group(1)
    assert "specdec.load(" in code
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "length" in p.stdout or "eos" in p.stdout


@pytest.mark.default_model
def test_generate_equals_plain_greedy_decoding(spec):
    """The oracle: a plain Engine built by hand on the same model (no drafter), batch and alone."""
    from specdec.engine import Engine
    from specdec.text import encode_prompt

    lm = spec.target
    ids = [encode_prompt(lm.tokenizer, p, None) for p in PROMPTS]
    plain = [r.tokens for r in Engine(lm.model, eos_ids=lm.eos_ids).generate(ids, SamplingParams(max_new_tokens=40))]
    batch = spec.generate(PROMPTS, max_new_tokens=40)
    assert [c.token_ids for c in batch] == plain
    alone = [spec.generate(p, max_new_tokens=40) for p in PROMPTS]
    assert [c.token_ids for c in alone] == plain
    # it did speculate (a fresh Speculator's lookup proposes once the text shows what holds)
    assert sum(c.stats.accepted for c in batch + alone) > 0
    for c in batch:
        assert c.text == lm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.stats.new_tokens == len(c.token_ids)


@pytest.mark.default_model
def test_streamed_text_adds_up_and_stop_strings_cut(spec):
    pieces: dict[int, list[str]] = {0: [], 1: []}
    outs = spec.generate(PROMPTS, max_new_tokens=30, on_text=lambda row, t: pieces[row].append(t))
    assert ["".join(pieces[i]) for i in range(2)] == [o.text for o in outs]
    full = outs[0].text
    stop = full.split()[2]  # a word the answer is known to contain
    cut = spec.generate(PROMPTS[0], max_new_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text and full.startswith(cut.text)


@pytest.mark.default_model
def test_streamed_text_never_reaches_a_stop_string(spec):
    """on_text with stop strings: every piece streamed adds up to the returned text, which ends
    before the stop; nothing at or after it is ever streamed (the API used to stream on and only
    cut the returned text). The empty stop string is ignored."""
    prompt = "Count from 1 to 10, separated by commas."
    full = spec.generate(prompt, max_new_tokens=40)
    assert "7" in full.text, full.text  # the model counts; the test relies on it
    for stop in (["7"], ["7", ""], [", 7", "8"]):
        pieces = []
        cut = spec.generate(prompt, max_new_tokens=40, stop=stop, on_text=lambda row, t: pieces.append(t))
        assert cut.finish_reason == "stop" and "".join(pieces) == cut.text, (stop, pieces)
        assert cut.text == full.text[:full.text.index(stop[0])] and "7" not in "".join(pieces)
    pieces = []
    ignored = spec.generate(prompt, max_new_tokens=40, stop=[""], on_text=lambda row, t: pieces.append(t))
    assert ignored.text == "".join(pieces) == full.text


@pytest.mark.default_model
def test_api_and_cli_decode_the_same_tokens(spec, tmp_path):
    """One configuration, one builder: `specdec generate --json` and the API agree token for token."""
    p = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", PROMPTS[0], "--max-new-tokens", "24",
                        "--json", "--quiet", "--fresh"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["token_ids"] == spec.generate(PROMPTS[0], max_new_tokens=24).token_ids


@pytest.mark.parametrize("kwargs, needle", [
    ({"bogus": 1}, "unknown setting(s) bogus"),
    ({"method": "fast"}, "method must be one of"),
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"k": -2}, "k must be a whole number >= 0"),
])
def test_bad_settings_fail_in_one_line_before_loading(kwargs, needle):
    with pytest.raises(SpecdecError) as e:
        specdec.load(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.default_model
def test_bad_generate_options_fail_in_one_line(spec):
    for kwargs, needle in (({"temprature": 0.5}, "unknown option(s) temprature"), ({"top_p": 0}, "top-p must be")):
        with pytest.raises(SpecdecError, match=re.escape(needle)):
            spec.generate("hi", **kwargs)
    with pytest.raises(SpecdecError, match="empty"):
        spec.generate("   ")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


def _call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}}]}


@pytest.mark.default_model
def test_prediction_keeps_the_answer_and_tools_are_parsed(spec):
    """A prediction is a draft: the greedy answer is the same with it. With tools the template
    (the default model's: specdec's generic format) gets them and the answer's call is parsed."""
    plain = spec.generate("List the days of the week.", max_new_tokens=40)
    predicted = spec.generate("List the days of the week.", max_new_tokens=40, prediction=plain.text)
    assert predicted.token_ids == plain.token_ids
    few_shot = [{"role": "system", "content": "You answer only with a tool call."},
                {"role": "user", "content": "Weather in Paris?"}, _call("Paris", 1),
                {"role": "user", "content": "Weather in Rome?"}, _call("Rome", 2),
                {"role": "user", "content": "Weather in London?"}]
    out = spec.generate(few_shot, tools=[WEATHER], max_new_tokens=40)
    assert out.finish_reason == "tool_calls" and out.text == ""
    [call] = out.tool_calls
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "London"}


def test_bad_shaping_options_fail_in_one_line(spec):
    with pytest.raises(SpecdecError, match="'uniqueItems'"):
        spec.generate("hi", json_schema={"type": "array", "uniqueItems": True})
    with pytest.raises(SpecdecError, match="tool_choice"):
        spec.generate("hi", tools=[WEATHER], tool_choice="get_time")


@pytest.mark.default_model
def test_json_schema_answers_validate(spec):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"river": {"type": "string"}, "km": {"type": "integer"}},
              "required": ["river", "km"], "additionalProperties": False}
    out = spec.generate("Name a long river.", json_schema=schema, max_new_tokens=40)
    jsonschema.validate(json.loads(out.text), schema)
