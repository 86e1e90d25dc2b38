"""What the adaptive methods learned, carried from one run to the next (specdec/learned.py):
the saved state is capped and round-trips, a malformed file or entry is ignored without
stopping a run, other entries survive a save, a restored `auto` decides from its first step,
and none of it changes output: greedy equals transformers' plain greedy decoding, and a seeded
sample gives the same text whatever was restored."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import auto, prompts, target, target_dir
from specdec import learned
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.policy import Acceptance, BatchGuard, DecayedLine, StepModel
from specdec.types import SamplingParams

from oracle import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def drafter():
    return auto(depth=3, width=2, nodes=5)


def test_decayed_line_scaled_keeps_the_fitted_line_and_caps_the_weight():
    line = DecayedLine(0.99)
    for i in range(60):
        line.observe(i % 5, 0.01 + 0.002 * (i % 5) + 1e-4 * (i % 3))
    small = DecayedLine(0.99)
    small.s = line.scaled(16.0)
    assert small.weight == pytest.approx(16.0) and line.weight > 40
    assert small.slope() == pytest.approx(line.slope())
    assert small.intercept(small.slope()) == pytest.approx(line.intercept(line.slope()))
    few = DecayedLine(0.99)
    few.observe(1, 2.0)
    assert few.scaled(16.0) == few.s  # under the cap: unchanged


def free_guesses() -> dict:
    """A learnt step-time fit in which a verified guess costs nothing (16 steps of 10 ms)."""
    fit = StepModel()
    for i in range(16):
        fit.observe(1, 2 * (i % 2), 0.01)
    return fit.learned(16.0)


def test_acceptance_round_trips_capped_and_refuses_what_does_not_fit():
    pol = Acceptance(5, 8, prior=0.5)
    for i in range(200):
        pol.observe(2, 4, 3 if i % 4 else 0)
    state = json.loads(json.dumps(pol.learned()))  # as it goes through the file
    assert max(max(r) for r in state["seen"]) == pytest.approx(8.0)
    new = Acceptance(5, 8, prior=0.5)
    new.relearn(state)
    assert new.expected(2, 4) == pytest.approx(pol.expected(2, 4))  # same acceptance, fewer counts
    assert new.seen[2][0] < pol.seen[2][0]
    before = (new.acc, new.seen)
    for bad in (dict(state, acc=state["acc"][:-1]),  # another number of keys
                dict(state, seen=[r[:-1] for r in state["seen"]]),  # another number of positions
                dict(state, acc=[[9.0] * 8] + state["acc"][1:])):  # more accepted than seen
        with pytest.raises((ValueError, TypeError)):
            new.relearn(bad)
        assert (new.acc, new.seen) == before


def test_the_step_time_fit_round_trips_capped_and_refuses_a_nan():
    fit = StepModel()
    for i in range(200):
        fit.observe(1, i % 4, 0.01 + 0.003 * (i % 4))
    state = json.loads(json.dumps(fit.learned(16.0)))
    new = StepModel()
    new.relearn(state)
    assert new.predict(1, 3) == pytest.approx(fit.predict(1, 3)) and new.weight(1) == pytest.approx(16.0)
    state["all"]["v"][1] = float("nan")
    with pytest.raises(ValueError):
        StepModel().relearn(state)


def test_guard_round_trip():
    g = BatchGuard(min_rows=1)
    assert g.learned() is None  # nothing measured, nothing to save
    g.rate = {(0, True): 120.0, (0, False): 80.0}
    g2 = BatchGuard(min_rows=1)
    g2.relearn(json.loads(json.dumps(g.learned())))
    assert g2.rate == g.rate


class _Part:
    def __init__(self, value=None):
        self.value = value

    def learned(self):
        return {"value": self.value}

    def relearn(self, state):
        if not isinstance(state["value"], int):
            raise ValueError("not an int")
        self.value = state["value"]


def test_the_file_keeps_other_entries_and_ignores_what_it_cannot_read(tmp_path, monkeypatch):
    f = tmp_path / "sub" / "learned.json"
    monkeypatch.setenv("SPECDEC_LEARNED", str(f))
    assert learned.path() == f
    assert not learned.restore(_Part(), "a")  # no file yet
    assert learned.save(_Part(1), "a") and learned.save(_Part(2), "b")
    p = _Part()
    assert learned.restore(p, "a") and p.value == 1
    assert learned.restore(p, "b") and p.value == 2
    data = json.loads(f.read_text())
    data["entries"]["a"]["state"] = {"value": "x"}  # an entry the part refuses
    f.write_text(json.dumps(data))
    p = _Part(7)
    assert not learned.restore(p, "a") and p.value == 7
    f.write_text("{not json")  # a broken file: ignored, then replaced by a good one
    assert not learned.restore(p, "b")
    assert learned.save(_Part(3), "b")
    assert learned.restore(p, "b") and p.value == 3
    data = json.loads(f.read_text())
    data["entries"]["x"] = ["not", "an", "entry"]  # valid JSON, not an entry: dropped on the next save
    data["entries"]["b"]["state"] = {"value": {"a": "mapping where a number belongs"}}
    f.write_text(json.dumps(data))
    assert not learned.restore(p, "b") and not learned.restore(p, "x")
    assert learned.save(_Part(5), "c") and "x" not in json.loads(f.read_text())["entries"]
    data = json.loads(f.read_text())
    data["version"] = learned.VERSION + 1  # a layout this version does not know
    f.write_text(json.dumps(data))
    assert not learned.restore(p, "b")
    eng = Engine(target().model, NgramDrafter(), k=3)  # a real engine, a mangled entry
    f.write_text(json.dumps({"version": learned.VERSION, "entries": {"e": {"state": {
        "policy": {"steps": {}, "draft_odds": [0.01, 0.02], "t_catch": None}}}}}))
    assert not learned.restore(eng, "e")
    monkeypatch.setenv("SPECDEC_LEARNED", "0")
    assert learned.path() is None and not learned.save(_Part(4), "d")
    assert [x.name for x in f.parent.iterdir()] == ["learned.json"]  # no temporary files left


def test_the_file_keeps_the_newest_entries(tmp_path, monkeypatch):
    f = tmp_path / "learned.json"
    monkeypatch.setattr(learned, "MAX_ENTRIES", 2)
    clock = iter([100.0, 200.0, 300.0])
    monkeypatch.setattr(learned.time, "time", lambda: next(clock))
    for k in ("old", "mid", "new"):
        assert learned.save(_Part(1), k, f)
    assert sorted(json.loads(f.read_text())["entries"]) == ["mid", "new"]


def test_the_key_tells_machines_threads_models_and_methods_apart():
    keys = {learned.key("m", "fp32", "float32", "ngram", 2), learned.key("m", "fp32", "float32", "auto", 2),
            learned.key("m", "fp32", "float32", "ngram", 1), learned.key("m2", "fp32", "float32", "ngram", 2),
            learned.key("m", "int16", "float32", "ngram", 2)}
    assert len(keys) == 5
    assert learned.cpu_name() in learned.key("m", "fp32", "float32", "ngram", 2)


def _run(engine, params, ps):
    return [r.tokens for r in engine.generate(ps, params)]


def test_restored_auto_decides_from_its_first_step_and_stays_exact(monkeypatch):
    """An auto engine restored from a run that found trees paying drafts them from its first step,
    and one restored from a run that found them not paying does not. Greedy output equals
    transformers' either way."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    # (room for 40 tokens: a row must have room for PROBE_ROOM more before the head reads its
    # whole prompt, and a batch's step drafts only where all its rows may: Engine's closed batch)
    want = [hf_greedy(hf, p, 40) for p in ps]
    first = Engine(target().model, drafter(), k=3)
    assert _run(first, SamplingParams(max_new_tokens=40), ps) == want
    state = json.loads(json.dumps(first.learned()))
    head = state["policy"]["sources"]["eagle"]
    head.update(gain=3.0, time=[8.0, 8.0, 8e-4, 8.0, 8e-4])  # a head that paid well, drafting a tree in 0.1 ms
    # a step-time fit of 10 ms a step, guesses free (what the first run timed depends on the
    # machine's load), so the cost model's verdict is fixed
    state["policy"]["steps"] = free_guesses()

    def trees(state) -> int:
        engine = Engine(target().model, drafter(), k=3)
        engine.relearn(state)
        res = engine.generate(ps, SamplingParams(max_new_tokens=40))
        assert [r.tokens for r in res] == want
        return sum(r.stats.sources.get("eagle", [0])[0] for r in res)

    assert trees(state) > 0
    head.update(gain=0.0)  # a head that did not pay
    assert trees(state) == 0


def test_the_cost_model_round_trips_and_refuses_what_does_not_fit():
    """LoadPolicy.learned / relearn: the step-time fit, a source's drafting-time line and its
    acceptance come back as they were (capped); a malformed step fit changes nothing, a malformed
    source is dropped when that source registers."""
    from specdec.policy import LoadPolicy

    policy = LoadPolicy(4)
    head, draft = policy.source("eagle", False, True, 0.6, 5), policy.source("draft", False, False, 0.6)
    for i in range(40):
        policy.observe_step(1 + i % 3, i % 5, 0.01 + 0.002 * (i % 5))
        policy.observe_drafting(head, 1 + i % 2, 0.003 * (1 + i % 2), 1, True)
        policy.observe_outcome(draft, [2], [1 + i % 2])
    state = json.loads(json.dumps(policy.learned()))
    new = LoadPolicy(4)
    new.relearn(state)
    new_head, new_draft = new.source("eagle", False, True, 0.6, 5), new.source("draft", False, False, 0.6)
    assert new.steps.predict(2, 3) == pytest.approx(policy.steps.predict(2, 3))
    assert new_head.draft_seconds(5) == pytest.approx(head.draft_seconds(5))
    assert new_head.time.weight == pytest.approx(16.0)  # at most 16 steps' weight carried
    assert new_draft.acceptance.expected(0, 4) == pytest.approx(draft.acceptance.expected(0, 4), rel=0.05)
    with pytest.raises((ValueError, KeyError)):
        LoadPolicy(4).relearn(dict(state, steps={}))
    bad = json.loads(json.dumps(state))
    bad["sources"]["eagle"]["time"] = [1.0, 2.0]
    fresh = LoadPolicy(4)
    fresh.relearn(bad)
    assert not fresh.source("eagle", False, True, 0.6, 5).timed


@pytest.mark.parametrize("method", ["ngram", "lookup"])
def test_a_seeded_sample_does_not_depend_on_what_was_restored(method):
    """Same seed, same text, whether the drafter starts from priors or from a state that would
    change every timing-based choice (guesses nearly free, trees paying, lookups always held)."""
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=123)
    rep = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6, 3, 1]  # text that repeats: lookups fire
    ps = [rep, prompts()[1]]

    def make():
        return Engine(target().model, NgramDrafter() if method == "ngram" else drafter(), k=3)

    first = make()
    plain = _run(first, params, ps)
    state = json.loads(json.dumps(first.learned()))
    eng = make()
    look = state["policy"]["sources"]["ngram"]["acceptance"]
    look["acc"] = [[s for s in row] for row in look["seen"]]  # every guess held
    state["policy"]["steps"] = free_guesses()
    if method == "lookup":  # and no tree node worth verifying (an unseeded request would cut every tree)
        state["policy"]["sources"]["eagle"].update(gain=4.0, time=[8.0, 8.0, 8e-5, 8.0, 8e-5])
        state["source:eagle"] = {"odds": {"acc": [0.0] * 10, "seen": [8.0] * 10}}
    eng.relearn(state)
    assert _run(eng, params, ps) == plain


@pytest.mark.default_model
def test_generate_saves_and_restores_through_the_cli(tmp_path, monkeypatch, capsys):
    """`specdec generate` writes an entry for a method that learns under SPECDEC_LEARNED (none
    for --method none), reads it on the next call of the same method (same text), and
    `--fresh` neither reads nor writes. (A tiny random model with the default tokenizer.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.cli import main
    from specdec.models.loader import load_model

    d = tmp_path / "m"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(d)
    load_model().tokenizer.save_pretrained(d)
    f = tmp_path / "learned.json"
    monkeypatch.setenv("SPECDEC_LEARNED", str(f))
    restored = []
    real = learned.restore
    monkeypatch.setattr(learned, "restore", lambda engine, k, file=None: restored.append(real(engine, k, file))
                        or restored[-1])
    args = ["generate", "--model", str(d), "--raw", "--json", "--max-new-tokens", "12", "--quiet", "--threads", "1",
            "a b c a b c a b c a b c"]
    texts, states = [], []
    for method in ("ngram", "none", "ngram"):
        assert main(args + ["--method", method]) == 0
        obj = json.loads(capsys.readouterr().out)
        texts.append(obj["token_ids"])
        states.append(obj["learned_state"])
    assert texts[0] == texts[1] == texts[2]
    assert states == [False, False, True]  # --json tells whether the run started from a saved state
    data = json.loads(f.read_text())
    [k] = data["entries"]  # ngram learned something; none has nothing to keep
    assert "| ngram " in k and "1 threads" in k
    assert restored == [False, False, True]  # ngram: nothing yet; none: no entry; ngram: its entry
    f.unlink()
    assert main(args + ["--method", "ngram", "--fresh"]) == 0
    assert not f.exists() and len(restored) == 3
