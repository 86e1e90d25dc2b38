"""specdec.validate.settings: one entry per framework, in order; k, the n-gram window, the draft path and the
concurrency limit land where each framework takes them; speculation off means no speculative flags; unknown
methods and bad arguments are one SpecdecError. Pure string work: no model is loaded."""

from __future__ import annotations

import json
import shlex

import pytest

from specdec.types import SpecdecError
from specdec.validate.settings import FRAMEWORKS, METHODS, framework_settings

SPEC_FLAGS = ("--speculative-config", "--spec-type", "--spec-draft", "-md", "--speculate", "--method ngram",
              "--draft ", "-k ")


def by_fw(entries: list[dict]) -> dict[str, dict]:
    return {e["framework"]: e for e in entries}


def vllm_config(command: str) -> dict:
    argv = shlex.split(command)
    assert argv[:2] == ["vllm", "serve"]
    return json.loads(argv[argv.index("--speculative-config") + 1])


def flag_value(command: str, flag: str) -> str:
    argv = shlex.split(command)
    return argv[argv.index(flag) + 1]


def test_frameworks_are_the_four_in_order():
    assert FRAMEWORKS == ("specdec", "vllm", "llama.cpp", "tgi")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("draft", [None, "drafts/small"])
def test_one_well_formed_entry_per_framework_in_order(method, draft):
    entries = framework_settings(method, 4, draft=draft, max_concurrency=8)
    assert [e["framework"] for e in entries] == list(FRAMEWORKS)
    for e in entries:
        assert set(e) == {"framework", "checked_against", "supported", "command", "notes"}
        assert isinstance(e["checked_against"], str) and e["checked_against"].strip()
        assert isinstance(e["supported"], bool)
        assert isinstance(e["notes"], list) and all(isinstance(n, str) and n for n in e["notes"])
        assert (e["command"] != "") == e["supported"]
        assert any("change between versions" in n and e["checked_against"] in n for n in e["notes"])


def test_ngram_puts_k_and_window_in_each_command():
    e = by_fw(framework_settings("ngram", 6, ngram_min=2, ngram_max=5, model="org/target"))
    assert all(x["supported"] for x in e.values())
    assert e["specdec"]["command"] == "specdec serve --model org/target --method ngram -k 6"
    cfg = vllm_config(e["vllm"]["command"])
    assert cfg == {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    assert "num_speculative_tokens_per_batch_size" not in cfg  # no concurrency limit given
    cmd = e["llama.cpp"]["command"]
    assert flag_value(cmd, "--spec-type") == "ngram-simple"
    assert flag_value(cmd, "--spec-ngram-simple-size-n") == "5"
    assert flag_value(cmd, "--spec-ngram-simple-size-m") == "6"
    assert "--draft-max" not in cmd  # removed from llama-server
    assert flag_value(e["tgi"]["command"], "--speculate") == "6"


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "medusa"])
def test_k_is_vllm_num_speculative_tokens(method):
    for k in (1, 3, 9):
        cfg = vllm_config(by_fw(framework_settings(method, k, draft="d"))["vllm"]["command"])
        assert cfg["num_speculative_tokens"] == k
        assert cfg["method"] == {"ngram": "ngram", "draft": "draft_model"}.get(method, method)


def test_max_concurrency_is_a_vllm_schedule_and_a_note_elsewhere():
    e = by_fw(framework_settings("ngram", 5, max_concurrency=12))
    sched = vllm_config(e["vllm"]["command"])["num_speculative_tokens_per_batch_size"]
    assert sched[0] == [1, 12, 5]  # k up to the limit, starting at batch size 1 as vLLM requires
    assert sched[1][0] == 13 and sched[1][1] >= 13 and sched[1][2] == 0  # off above it
    assert "disable_by_batch_size" not in e["vllm"]["command"]
    for fw in ("llama.cpp", "tgi"):
        assert "12" not in e[fw]["command"]
        assert any("no batch-size switch" in n and "at most 12 concurrent" in n for n in e[fw]["notes"])
    assert any("12 concurrent" in n for n in e["specdec"]["notes"])
    # without a limit, no such note anywhere
    plain = framework_settings("ngram", 5)
    assert not any("batch-size switch" in n for x in plain for n in x["notes"])


@pytest.mark.parametrize("method,k", [("none", 4), ("ngram", 0), ("draft", 0), ("eagle", 0), ("auto", 0)])
def test_speculation_off_has_no_speculative_flags(method, k):
    e = by_fw(framework_settings(method, k, draft="d.gguf", max_concurrency=4, model="m"))
    for fw, x in e.items():
        assert x["supported"] is True
        assert "speculation off" in x["notes"]
        assert not any(f in x["command"] + " " for f in SPEC_FLAGS), (fw, x["command"])
    assert e["specdec"]["command"] == "specdec serve --model m --method none"
    assert e["vllm"]["command"] == "vllm serve m"
    assert e["llama.cpp"]["command"] == "llama-server -m m"
    assert e["tgi"]["command"] == "text-generation-launcher --model-id m"


def test_draft_path_in_llamacpp_and_vllm_and_tgi_unsupported():
    e = by_fw(framework_settings("draft", 3, draft="/models/draft q4.gguf"))
    assert vllm_config(e["vllm"]["command"])["model"] == "/models/draft q4.gguf"
    cmd = e["llama.cpp"]["command"]
    assert flag_value(cmd, "-md") == "/models/draft q4.gguf"  # quoted, survives the space
    assert flag_value(cmd, "--spec-type") == "draft-simple"
    assert flag_value(cmd, "--spec-draft-n-max") == "3"
    tgi = e["tgi"]
    assert tgi["supported"] is False and tgi["command"] == ""
    assert any("no independent draft models" in n for n in tgi["notes"])
    spec = e["specdec"]
    assert flag_value(spec["command"], "--method") == "draft" and flag_value(spec["command"], "--draft") == (
        "/models/draft q4.gguf")
    assert any("specdec serve drafts with prompt lookup" in n for n in spec["notes"])


def test_auto_maps_to_draft_settings_or_ngram():
    with_draft = by_fw(framework_settings("auto", 4, draft="small"))
    assert vllm_config(with_draft["vllm"]["command"])["method"] == "draft_model"
    assert any("auto" in n for n in with_draft["vllm"]["notes"])
    assert "draft-simple" in flag_value(with_draft["llama.cpp"]["command"], "--spec-type")
    assert with_draft["tgi"]["supported"] is False
    assert flag_value(with_draft["specdec"]["command"], "--method") == "auto"
    without = by_fw(framework_settings("auto", 4))
    assert vllm_config(without["vllm"]["command"])["method"] == "ngram"
    assert flag_value(without["llama.cpp"]["command"], "--spec-type") == "ngram-simple"
    assert without["tgi"]["supported"] is True


def with_draft_cmd() -> str:
    return by_fw(framework_settings("auto", 4, draft="small"))["specdec"]["command"]


def test_auto_with_an_eagle_head_maps_to_eagle_settings():
    from specdec.drafters.eagle import DEFAULT_EAGLE_DIR

    e = by_fw(framework_settings("auto", 4, draft=str(DEFAULT_EAGLE_DIR)))
    assert vllm_config(e["vllm"]["command"])["method"] == "eagle"
    assert any("auto's EAGLE settings" in n for n in e["vllm"]["notes"])
    assert "draft-eagle3" in flag_value(e["llama.cpp"]["command"], "--spec-type")
    assert any("auto's EAGLE settings" in n for n in e["llama.cpp"]["notes"])
    assert e["tgi"]["supported"] is False and any("prompt-lookup half" in n for n in e["tgi"]["notes"])
    # specdec serves auto + EAGLE itself: the command is `specdec serve`, with the head
    assert e["specdec"]["command"].startswith("specdec serve ")
    assert flag_value(e["specdec"]["command"], "--method") == "auto"
    assert flag_value(e["specdec"]["command"], "--draft") == str(DEFAULT_EAGLE_DIR)
    # a draft model is not served: the command runs offline and the notes say how to serve
    assert with_draft_cmd().startswith("specdec generate ")


def test_heads_need_conversion_and_unsupported_where_absent():
    eagle = by_fw(framework_settings("eagle", 5, draft="heads/eagle"))
    assert any("specdec's own format" in n for n in eagle["vllm"]["notes"])
    assert eagle["llama.cpp"]["supported"] is True
    assert flag_value(eagle["llama.cpp"]["command"], "--spec-type") == "draft-eagle3"
    assert eagle["tgi"]["supported"] is False
    medusa = by_fw(framework_settings("medusa", 3))
    assert medusa["llama.cpp"]["supported"] is False and medusa["llama.cpp"]["command"] == ""
    assert medusa["tgi"]["supported"] is True
    assert flag_value(medusa["tgi"]["command"], "--speculate") == "3"
    assert any("specdec's own format" in n for n in medusa["tgi"]["notes"])


@pytest.mark.parametrize("kwargs", [
    dict(method="lookahead", k=4),
    dict(method="NGRAM", k=4),
    dict(method="ngram", k=-1),
    dict(method="ngram", k=True),
    dict(method="ngram", k=4, max_concurrency=0),
    dict(method="ngram", k=4, ngram_min=3, ngram_max=2),
    dict(method="ngram", k=4, ngram_min=0),
    dict(method="ngram", k=4, model=""),
])
def test_bad_arguments_raise_specdec_error(kwargs):
    with pytest.raises(SpecdecError):
        framework_settings(**kwargs)


def test_unknown_method_message_names_the_choices():
    with pytest.raises(SpecdecError, match=r"unknown method 'lookahead'.*ngram.*medusa"):
        framework_settings("lookahead", 4)


def test_llamacpp_uses_the_gguf_file_when_there_is_one():
    by = {e["framework"]: e for e in framework_settings("ngram", 6, model="org/m", gguf="/models/m.gguf")}
    assert "-m /models/m.gguf" in by["llama.cpp"]["command"] and "org/m" not in by["llama.cpp"]["command"]
    assert "vllm serve org/m" in by["vllm"]["command"]
    without = {e["framework"]: e for e in framework_settings("ngram", 6, model="org/m")}
    assert any("convert_hf_to_gguf" in n for n in without["llama.cpp"]["notes"])


def test_llamacpp_asks_for_a_gguf_draft():
    by = {e["framework"]: e for e in framework_settings("draft", 4, draft="/models/small-folder", model="org/m")}
    assert any("convert /models/small-folder" in n for n in by["llama.cpp"]["notes"])
    by = {e["framework"]: e for e in framework_settings("draft", 4, draft="/models/small.gguf", model="org/m")}
    assert not any("convert /models/small.gguf" in n for n in by["llama.cpp"]["notes"])
