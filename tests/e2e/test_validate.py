"""`specdec validate`: sample files, the distribution check (it passes exact samples and
catches broken ones, including a broken engine), greedy exactness against an independent
oracle, the load test through the server's batcher, the predicted-vs-measured arithmetic,
the verdict, and the command end to end on the default model."""

from __future__ import annotations

import json

import pytest
import torch
from oracle import broken_verify_stochastic, hf_greedy, native_of, one_thread, tiny_hf_llama  # noqa: F401

import specdec.core.step
import specdec.engine
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.types import SamplingParams, SpecdecError
from specdec.validate import analysis, measure
from specdec.validate.samples import load_samples, read_samples, spread


# ------------------------------------------------------------------------------ samples
class CharTok:
    """A tokenizer without a chat template: one id per character."""

    chat_template = None

    def encode(self, text):
        return [ord(c) % 64 for c in text]


def test_text_lines_and_jsonl(tmp_path):
    p = tmp_path / "s.txt"
    p.write_text("first prompt\n\n{not json} but text\nthird\n")
    tasks, fmt = read_samples(str(p))
    assert fmt == "text lines" and [t.prompt for t in tasks] == ["first prompt", "{not json} but text", "third"]
    j = tmp_path / "s.jsonl"
    j.write_text(json.dumps({"prompt": "a", "category": "x"}) + "\n" +
                 json.dumps({"messages": [{"role": "user", "content": "b"}]}) + "\n")
    tasks, fmt = read_samples(str(j))
    assert fmt == "jsonl" and tasks[0].prompt == "a" and tasks[0].category == "x" and isinstance(tasks[1].prompt, list)


@pytest.mark.parametrize("content, match", [
    ("", "empty"),
    ("\n  \n", "empty"),
    ('{"prompt": "a"}\n{"prompt": \n', r"s\.jsonl:2: not valid JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', r"s\.jsonl:2: needs"),
])
def test_bad_sample_files_name_the_line(tmp_path, content, match):
    p = tmp_path / "s.jsonl"
    p.write_text(content)
    with pytest.raises(SpecdecError, match=match):
        read_samples(str(p))


def test_jsonl_with_a_byte_order_mark_is_still_jsonl(tmp_path):
    """A BOM (Windows editors) used to hide the first '{', so every JSON line became a text prompt."""
    p = tmp_path / "s.jsonl"
    p.write_bytes("\ufeff".encode() + json.dumps({"prompt": "a"}).encode() + b"\n")
    tasks, fmt = read_samples(str(p))
    assert fmt == "jsonl" and [t.prompt for t in tasks] == ["a"]


@pytest.mark.parametrize("flags, needle", [(["--methods", ","], "names no method"),
                                            (["--dist-temperature", "inf"], "--dist-temperature")])
def test_validate_flags_that_name_nothing_or_infinity(tmp_path, flags, needle, capsys):
    """An empty --methods used to load the model and fail with 'no method could be set up:' and nothing after."""
    from specdec.cli import main

    ok = tmp_path / "ok.txt"
    ok.write_text("hello\n")
    assert main(["validate", "--data", str(ok), "--out", str(tmp_path / "r"), *flags]) == 2
    assert needle in capsys.readouterr().err


def test_missing_file():
    with pytest.raises(SpecdecError, match="no such file"):
        read_samples("/nonexistent/samples.jsonl")


def test_too_long_samples_are_skipped_and_counted(tmp_path):
    p = tmp_path / "s.txt"
    p.write_text("short\n" + "x" * 200 + "\nalso short\n")
    s = load_samples(str(p), CharTok(), max_context=100, reserve=20)
    assert [t.prompt for t in s.tasks] == ["short", "also short"]
    assert len(s.skipped) == 1 and s.skipped[0]["id"] == "2" and "exceed the context" in s.skipped[0]["reason"]
    with pytest.raises(SpecdecError, match="no sample .* fits"):
        load_samples(str(p), CharTok(), max_context=10, reserve=20)


def test_spread_keeps_every_category():
    from specdec.bench.tasks import Task

    tasks = [Task(str(i), "a", "p", True) for i in range(10)] + [Task("b1", "b", "p", True)]
    kept = spread(tasks, 4)
    assert len(kept) == 4 and {t.category for t in kept} == {"a", "b"}


# ------------------------------------------------------------------------------ tiny models
@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_llama(5, vocab=32, logit_scale=2.5)
    return hf, native_of(hf)


def oracle_sample(hf, prompt, n, tokens, temperature, seed, distort=1.0):
    """Draws from the exact conditionals of the transformers model (independent of specdec);
    distort != 1 raises the probabilities of the tokens after the first to that power."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(n):
            seq = []
            for t in range(tokens):
                p = torch.softmax(hf(torch.tensor([prompt + seq])).logits[0, -1].double() / temperature, -1)
                if t >= 1 and distort != 1.0:
                    p = p ** distort / (p ** distort).sum()
                seq.append(int(torch.multinomial(p, 1, generator=g)))
            out.append(seq)
    return out


PROMPT = [3, 7, 1, 9, 3, 7, 1, 9, 3, 7, 1]  # repeats itself: prompt lookup always has a match


def test_check_passes_exact_samples_and_catches_distorted_ones(tiny):
    hf, model = tiny
    good = measure.check_sequences(model, PROMPT, oracle_sample(hf, PROMPT, 300, 3, 1.0, 1), 1.0)
    assert good["tests"] == 2 and good["p_value"] > 1e-3, good
    # only the tokens after the first are off (what a broken speculative step would do)
    bad = measure.check_sequences(model, PROMPT, oracle_sample(hf, PROMPT, 300, 3, 1.0, 1, distort=1.6), 1.0)
    assert bad["pit_p_value"] < 1e-4, bad


def _ngram_config(model, k=3):
    eng = Engine(model, NgramDrafter(), k=k, fixed_k=True)
    return measure.Config("ngram k=3", "ngram", k, False, eng)


def test_distribution_check_passes_the_engine_and_catches_a_broken_one(tiny, monkeypatch):
    _, model = tiny
    ok = measure.distribution(_ngram_config(model), model, PROMPT, draws=400, tokens=4, temperature=1.0, seed=3)
    assert ok["passed"] and ok["exercised"] and ok["proposed"] > 0 and ok["accepted"] > 0, ok
    monkeypatch.setattr(specdec.core.step, "verify_stochastic", broken_verify_stochastic)
    bad = measure.distribution(_ngram_config(model), model, PROMPT, draws=400, tokens=4, temperature=1.0, seed=3)
    assert not bad["passed"], bad


def test_acceptance_greedy_equals_the_oracle_and_a_broken_engine_fails_the_verdict(tiny, monkeypatch):
    hf, model = tiny
    prompts = [PROMPT, [5, 2, 8, 5, 2, 8, 5], [1, 2, 3, 4]]
    params = SamplingParams(max_new_tokens=12)
    raw = measure.acceptance([_ngram_config(model)], Engine(model), prompts, params, repeats=2)
    for r, p in zip(raw["none"]["samples"], prompts):
        assert r["tokens"] == hf_greedy(hf, p, 12)
    s = analysis.summarize_config(raw["ngram k=3"], raw["none"])
    assert s["equal"] == 3 and not s["not_equal"] and s["proposed"] > 0 and 0 <= s["alpha"] <= 1
    assert s["prediction"]["factored"] == pytest.approx(s["prediction"]["measured"], rel=1e-9)

    def accept_all(logits, draft_tokens, counts):  # a broken greedy rule: every guess holds
        return counts.clone(), logits[torch.arange(len(counts)), counts].argmax(-1)

    monkeypatch.setattr(specdec.core.step, "verify_greedy", accept_all)
    raw = measure.acceptance([_ngram_config(model)], Engine(model), prompts, params, repeats=1)
    bad = analysis.summarize_config(raw["ngram k=3"], raw["none"])
    assert bad["not_equal"]
    v = analysis.verdict({"ngram k=3": bad}, None, [], {})
    assert not v["enable"] and v["headline"].startswith("DO NOT ENABLE") and v["exactness_failures"]


def test_load_through_the_batcher_is_exact(tiny):
    hf, model = tiny
    prompts = [PROMPT, [5, 2, 8, 5, 2, 8, 5], [1, 2, 3, 4]]
    params = SamplingParams(max_new_tokens=10)
    ref = [hf_greedy(hf, p, 10) for p in prompts]
    load = measure.load(model, [], prompts, params, levels=[1, 3], k=4, min_requests=3, repeats=1, reference=ref)
    for name in measure.LOAD_SETTINGS:
        for c in (1, 3):
            row = load["table"][name][c]
            assert row["failures"] == 0 and row["checked"] == row["requests"] == 3 and row["equal"] == 3, row
            assert row["throughput"] > 0 and row["token_p50"] > 0
    assert load["table"]["off"][1]["mean_guesses"] == 0 and load["table"]["fixed"][1]["mean_guesses"] > 0



def test_the_load_test_measures_warm_batchers_taking_turns(tiny, monkeypatch):
    """Each setting answers one unmeasured burst of a level's size (short answers) before its first
    measured one, as a running server has met batches of that size; the settings' order alternates
    from one (round, level) to the next, so that running second is not always one setting's lot."""
    _, model = tiny
    calls = []
    real = measure.drive

    def recording(batcher, prompts, conc, per_client, params, reference=None, **kw):
        calls.append(("off" if batcher.method == "none" else "adaptive", conc, per_client, params.max_new_tokens))
        return real(batcher, prompts, conc, per_client, params, reference, **kw)

    monkeypatch.setattr(measure, "drive", recording)
    load = measure.load(model, [], [PROMPT, [1, 2, 3, 4]], SamplingParams(max_new_tokens=30), levels=[1, 2], k=4,
                        min_requests=2, repeats=2, settings=("off", "adaptive"))
    warm = min(30, measure.WARM_TOKENS)
    assert warm < 30
    assert calls == [("off", 1, 1, warm), ("off", 1, 2, 30), ("adaptive", 1, 1, warm), ("adaptive", 1, 2, 30),
                     ("adaptive", 2, 1, warm), ("adaptive", 2, 1, 30), ("off", 2, 1, warm), ("off", 2, 1, 30),
                     ("adaptive", 1, 2, 30), ("off", 1, 2, 30), ("off", 2, 1, 30), ("adaptive", 2, 1, 30)]
    assert all(load["table"][name][c]["requests"] == 4 for name in ("off", "adaptive") for c in (1, 2))


# ------------------------------------------------------------------------------ arithmetic
def _entry(F, k, alpha_pos, draft_s, verify_s, decode_s, new):
    """One sample that drafted k tokens at each of F steps."""
    P = [F] * k
    A = [round(F * a) for a in alpha_pos]
    row = dict(new_tokens=new, forwards=F, proposed=sum(P), accepted=sum(A), proposed_by_pos=P, accepted_by_pos=A,
               prefill_s=0.1, decode_s=decode_s, draft_s=draft_s, verify_s=verify_s, alpha=sum(A) / max(1, sum(P)),
               tau=(new - 1) / F, equal=True)
    reps = [dict(new_tokens=new, prefill_s=0.1, decode_s=decode_s, draft_s=draft_s, verify_s=verify_s)]
    return {"samples": [row], "reps": reps}


def test_prediction_is_the_design_formula_and_the_factors_multiply_to_the_measurement():
    none = _entry(100, 0, [], 0.0, 1.0, 1.0, 101)
    none["samples"][0].update(proposed=0, accepted=0, proposed_by_pos=[], accepted_by_pos=[])
    e = _entry(50, 4, [0.6, 0.5, 0.4, 0.3], draft_s=0.1, verify_s=0.55, decode_s=0.7, new=101)
    s = analysis.summarize_config(e, none)
    a, k = s["alpha"], 4
    c = (0.1 / 200) / (0.55 / 50)
    want = (1 - a ** (k + 1)) / ((1 - a) * (1 + c * k))
    p = s["prediction"]
    assert p["draft_cost_c"] == pytest.approx(c) and p["predicted"] == pytest.approx(want)
    assert p["measured"] == pytest.approx((100 / 0.7) / (100 / 1.0))
    assert p["factored"] == pytest.approx(p["measured"])
    assert p["verify_per_step"] == pytest.approx(0.55 / (50 * 0.01))
    assert "verification forward costs" in p["explanation"]


def _load(levels, off, fixed, adaptive, p50_off, p50_fixed, p50_ad):
    t = {}
    for name, thr, lat in (("off", off, p50_off), ("fixed", fixed, p50_fixed), ("adaptive", adaptive, p50_ad)):
        t[name] = {c: dict(throughput=thr[i], token_p50=lat[i], failures=0, checked=1, equal=1)
                   for i, c in enumerate(levels)}
    return {"levels": levels, "table": t}


def test_load_findings_and_verdict():
    levels = [1, 2, 4, 8]
    ld = _load(levels, off=[10, 18, 30, 40], fixed=[14, 22, 29, 30], adaptive=[14, 21, 30, 40],
               p50_off=[0.1, 0.11, 0.13, 0.2], p50_fixed=[0.07, 0.09, 0.13, 0.26], p50_ad=[0.07, 0.09, 0.13, 0.2])
    f = analysis.load_findings(ld)
    assert f["fixed"]["max_pays"] == 2 and f["fixed"]["stops_paying_at"] == 4 and f["fixed"]["hurts_at"] == [8]
    assert f["adaptive"]["hurts_at"] == []
    good = {"speedup": 1.4, "e2e_speedup": 1.3, "not_equal": [], "samples": 3}
    v = analysis.verdict({"ngram k=8": good}, f, [], {})
    assert v["enable"] and v["recommended"] == "ngram k=8" and v["max_concurrency"] == 2
    slow = {"speedup": 1.02, "e2e_speedup": 1.0, "not_equal": [], "samples": 3}
    assert not analysis.verdict({"ngram k=8": slow}, f, [], {})["enable"]
    failed = [{"config": "ngram k=8", "sample": "1", "status": "FAIL", "p_value": 1e-6}]
    v = analysis.verdict({"ngram k=8": good}, f, failed, {})
    assert not v["enable"] and "distribution" in v["headline"]


# ------------------------------------------------------------------------------ the command
@pytest.mark.default_model
def test_validate_command_end_to_end(tmp_path, capsys):
    from specdec.cli import main

    data = tmp_path / "samples.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "category": c}) for p, c in [
        ("Repeat this list: apple, banana, cherry, apple, banana, cherry.", "copy"),
        ("What is 2 + 2?", "qa"),
        ("x" * 40000, "huge"),
    ]) + "\n")
    out = tmp_path / "rep"
    rc = main(["validate", "--data", str(data), "--quick", "--methods", "ngram", "--max-new-tokens", "24",
               "--concurrency", "1,2", "--min-requests", "2", "--dist-draws", "64", "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads((out / "report.json").read_text())
    assert r["samples"]["kept"] == 2 and len(r["samples"]["skipped"]) == 1
    cfg = r["configs"]["ngram k=8"]
    assert cfg["equal"] == 2 and cfg["samples"] == 2 and "prediction" in cfg
    assert r["load"]["levels"] == [1, 2] and r["load_findings"]["failures"] == 0
    assert r["load_findings"]["equal"] == r["load_findings"]["checked"] > 0
    assert r["distribution"] and r["distribution"][0]["status"] != "FAIL"
    assert {s["framework"] for s in r["settings"]} == {"specdec", "vllm", "llama.cpp", "tgi"}
    assert isinstance(r["verdict"]["enable"], bool) and r["verdict"]["headline"] in text
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "Predicted vs measured" in html and "<script" not in html


@pytest.mark.default_model
def test_validate_bad_input(tmp_path, capsys):
    from specdec.cli import main

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["validate", "--data", str(empty), "--quick"]) == 2
    assert "is empty" in capsys.readouterr().err
    assert main(["validate", "--data", str(empty), "--methods", "warp"]) == 2
    assert "method must be one of" in capsys.readouterr().err
    ok = tmp_path / "ok.txt"
    ok.write_text("hello\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["validate", "--data", str(ok), "--out", str(blocker / "rep")]) == 2
    assert "cannot write the report" in capsys.readouterr().err
    other = tmp_path / "other-vocab"
    tiny_hf_llama(0, vocab=64).save_pretrained(other)
    data = tmp_path / "s.txt"
    data.write_text("hello\n")
    assert main(["validate", "--data", str(data), "--methods", "draft", "--draft", str(other), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "method draft" in err and "vocabular" in err.lower()


def test_an_interrupted_run_still_reports_what_was_measured(tiny, monkeypatch):
    from types import SimpleNamespace

    from specdec.bench.tasks import Task
    from specdec.validate import pipeline
    from specdec.validate.samples import Samples

    _, model = tiny
    target = SimpleNamespace(model=model, eos_ids=[], name="tiny", source="tiny-dir", gguf=None)
    prompts = [PROMPT, [5, 2, 8, 5, 2, 8, 5]]
    samples = Samples([Task(str(i), "c", "p", False) for i in range(2)], prompts, source="mem", fmt="jsonl", total=2)

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(measure, "load", stop)
    opts = pipeline.Options(max_new_tokens=8, repeats=1, concurrency=(1,), dist_samples=1, dist_draws=40, quiet=True)
    r = pipeline.run(target, samples, [_ngram_config(model)], Engine(model), opts, {}, "test", {})
    assert r["interrupted"] == "the load test" and r["verdict"]["headline"].startswith("PARTIAL")
    assert r["configs"]["ngram k=3"]["equal"] == 2 and r["load"] is None and r["distribution"] == []
    assert {e["framework"] for e in r["settings"]} == {"specdec", "vllm", "llama.cpp", "tgi"}


# ------------------------------------------------------------------------------ cost and certainty
def test_exact_probs_after_a_cached_prompt_equal_the_oracles(tiny):
    """The distribution check's probabilities: the prompt prefilled once, each prefix forwarded from a
    copy of its cache, against transformers' softmax over the whole sequence (and the full forwards)."""
    hf, model = tiny
    seqs = [PROMPT + [a, b] for a in range(4) for b in range(9)]
    cached = measure.exact_probs(model, seqs, 0.8, batch=16, prompt=PROMPT)
    full = measure.exact_probs(model, seqs, 0.8, batch=16)
    with torch.no_grad():
        want = torch.stack([torch.softmax(hf(torch.tensor([s])).logits[0, -1].double() / 0.8, -1) for s in seqs])
    assert torch.allclose(cached, want, atol=1e-6) and torch.allclose(full, want, atol=1e-6)
    shifted = measure.exact_probs(model, seqs, 0.8, batch=16, prompt=[1] + PROMPT[1:])  # a wrong cache is caught
    assert not torch.allclose(shifted, want, atol=1e-3)


def _rows(decode_s, none_decode_s, tokens=65):
    return ([{"new_tokens": tokens, "decode_s": d} for d in decode_s],
            [{"new_tokens": tokens, "decode_s": d} for d in none_decode_s])


def test_speedup_interval_over_samples():
    steady = analysis.speedup_interval(*_rows([1.0] * 8, [1.3] * 8))
    assert steady == pytest.approx([1.3, 1.3])
    spread_rows = _rows([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [0.9, 1.0, 1.1, 1.2, 1.4, 1.6, 1.8, 2.0])
    lo, hi = analysis.speedup_interval(*spread_rows)
    point = 11.0 / 8.0
    assert lo < point < hi and hi - lo > 0.2
    assert analysis.speedup_interval(*_rows([1.0, 1.0], [1.2, 1.2])) is None  # too few samples to say


def test_verdict_states_the_interval_and_when_it_is_uncertain():
    sure = {"speedup": 1.4, "e2e_speedup": 1.3, "not_equal": [], "samples": 8, "speedup_interval": [1.2, 1.6]}
    v = analysis.verdict({"auto k=8": sure}, None, [], {})
    assert v["enable"] and "95% interval over the samples 1.20-1.60x" in v["headline"] and "uncertain" not in v
    maybe = dict(sure, speedup=1.08, speedup_interval=[0.97, 1.2])
    v = analysis.verdict({"auto k=8": maybe}, None, [], {})
    assert v["enable"] and "not certain" in v["uncertain"]
    no = dict(sure, speedup=1.02, speedup_interval=[0.9, 1.15])
    v = analysis.verdict({"auto k=8": no}, None, [], {})
    assert not v["enable"] and "reaches 1.15x" in v["headline"]


def test_the_progress_plan_has_a_step_for_every_measured_step(tiny, monkeypatch):
    """The one bar's ETA counts on each phase's planned steps matching what the phase measures."""
    from types import SimpleNamespace

    from specdec.bench.tasks import Task
    from specdec.validate import pipeline
    from specdec.validate.samples import Samples

    _, model = tiny
    target = SimpleNamespace(model=model, eos_ids=[], name="tiny", source="tiny-dir", gguf=None)
    prompts = [PROMPT, [5, 2, 8, 5, 2, 8, 5], [1, 2, 3, 4]]
    samples = Samples([Task(str(i), "c", "p", False) for i in range(3)], prompts, source="mem", fmt="jsonl", total=3)
    leftover = {}
    real_phase = pipeline.Progress.phase

    def phase(self, name):
        if getattr(self, "_name", None) is not None:
            leftover[self._name] = len(self._left)
        self._name = name
        return real_phase(self, name)

    real_close = pipeline.Progress.close

    def close(self):
        leftover[self._name] = len(self._left)
        real_close(self)

    monkeypatch.setattr(pipeline.Progress, "phase", phase)
    monkeypatch.setattr(pipeline.Progress, "close", close)
    # the plan's costs come from a first plain run; fixed here, so that no phase's estimate rounds to
    # 0.0 s on a fast machine
    monkeypatch.setattr(pipeline, "_calibrate", lambda engine, ids: (0.01, 0.05))
    opts = pipeline.Options(max_new_tokens=6, repeats=2, concurrency=(1, 2), min_requests=3, dist_samples=1,
                            dist_draws=40, quiet=True)
    r = pipeline.run(target, samples, [_ngram_config(model)], Engine(model), opts, {}, "test", {})
    assert leftover == {"acceptance": 0, "under load": 0, "distribution": 0}
    assert r["timing"]["estimated_s"].keys() == {"acceptance", "under load", "distribution"}
    assert set(r["timing"]["measured_s"]) == {"acceptance", "under load", "distribution"}
    assert all(v > 0 for v in r["timing"]["estimated_s"].values())


def test_the_draws_prefill_their_prompt_once_with_the_same_numbers(tiny, monkeypatch):
    """PromptOnce: the distribution check's draws take copies of one prefill and sample exactly the
    sequences they sample when every row prefills its own prompt."""
    _, model = tiny
    calls = []
    real = type(model).forward

    def counting(self, tokens, *a, **k):
        calls.append(tokens.shape[1])
        return real(self, tokens, *a, **k)

    monkeypatch.setattr(type(model), "forward", counting)
    once = measure.distribution(_ngram_config(model), model, PROMPT, draws=64, tokens=4, temperature=1.0, seed=5)
    prefills = calls.count(len(PROMPT))
    calls.clear()
    monkeypatch.setattr(measure, "PromptOnce", lambda m, prompt: m)  # every row prefills its own prompt
    each = measure.distribution(_ngram_config(model), model, PROMPT, draws=64, tokens=4, temperature=1.0, seed=5)
    assert calls.count(len(PROMPT)) >= 64 > prefills  # (the exact probabilities prefill the prompt too)
    for key in ("chi2", "pit_chi2", "proposed", "accepted", "p_value"):
        assert once[key] == each[key], key
    assert once["proposed"] > 0


def test_a_load_test_without_a_fixed_draft_length_says_so(tiny):
    """--quick's load test runs the server's own settings only: no fixed row, no concurrency limit
    claimed for other frameworks, and the verdict says the fixed length was not measured."""
    _, model = tiny
    load = measure.load(model, [], [PROMPT, [1, 2, 3, 4]], SamplingParams(max_new_tokens=6), levels=[1, 2], k=4,
                        min_requests=2, repeats=1, settings=("off", "adaptive"))
    assert set(load["table"]) == {"off", "adaptive"} and load["settings"] == ["off", "adaptive"]
    f = analysis.load_findings(load)
    assert "fixed" not in f and set(f["by_concurrency"][2]) == {"adaptive"}
    good = {"speedup": 1.4, "e2e_speedup": 1.3, "not_equal": [], "samples": 3}
    v = analysis.verdict({"ngram k=8": good}, f, [], {})
    assert v["enable"] and v["max_concurrency"] is None and "fixed draft length" not in v["headline"]
    assert "was not measured under load" in v["load_note"]
