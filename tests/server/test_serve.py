"""`specdec serve` through the real `openai` client against a server started here on loopback
(the default model): completions and chat, streaming and not, n > 1, stop strings, the
error statuses, metrics, greedy output equal to the engine's plain greedy output, and a
bounded load test (many concurrent streaming clients with mixed lengths: none fails, every
response is complete and is exactly what that prompt gives alone, memory back to idle)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from server_helpers import http, plain_greedy, serving

pytestmark = pytest.mark.default_model

MAX_CONTEXT = 640


@pytest.fixture(scope="module")
def server(default_model):
    from specdec.config import SpecConfig
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.methods import sources_for
    from specdec.server.app import create_app

    # the server's default: prompt lookup + the shipped EAGLE head's trees, load-aware
    batcher = ContinuousBatcher(default_model.model, default_model.eos_ids, sources_for(SpecConfig(), default_model)[0],
                                method="auto", k_max=8, max_batch=8, max_queue=200, max_context=MAX_CONTEXT)
    batcher.policy.eager = True  # every source drafts every other step, so that the short answers here verify trees
    app = create_app(default_model, batcher, "smol", api_key="sekrit", request_timeout=120)
    with serving(app) as url:
        yield url, batcher
    batcher.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="sekrit", max_retries=0, timeout=120)


def test_models_health_and_metrics(client, server):
    import json

    assert [m.id for m in client.models.list().data] == ["smol"]
    assert json.loads(http(server[0] + "/health")[1])["status"] == "ok"
    text = http(server[0] + "/metrics")[1]
    for name in ("specdec_requests_total", "specdec_acceptance_rate", "specdec_mean_accepted_length",
                 "specdec_batch_size", "specdec_draft_length", "specdec_time_to_first_token_seconds_bucket"):
        assert name in text


def test_completion_and_chat_equal_plain_greedy(client, default_model):
    r = client.completions.create(model="smol", prompt="def add(a, b):\n", max_tokens=24, temperature=0)
    assert r.choices[0].text == plain_greedy(default_model, "def add(a, b):\n", False, 24)
    assert r.usage.completion_tokens > 0
    q = "Name three colours."
    c = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": q}], max_tokens=20, temperature=0)
    assert c.choices[0].message.content == plain_greedy(default_model, q, True, 20)
    assert c.choices[0].finish_reason in ("stop", "length")


def test_streaming_equals_non_streaming(client):
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    whole = client.chat.completions.create(model="smol", messages=msgs, max_tokens=30, temperature=0)
    parts, reasons = [], []
    for ev in client.chat.completions.create(model="smol", messages=msgs, max_tokens=30, temperature=0, stream=True):
        for ch in ev.choices:
            parts.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert "".join(parts) == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason
    text = "".join(e.choices[0].text for e in client.completions.create(
        model="smol", prompt="The sky is", max_tokens=12, temperature=0, stream=True))
    assert text == client.completions.create(model="smol", prompt="The sky is", max_tokens=12, temperature=0).choices[0].text


def test_n_and_seed_and_stop(client):
    r = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=16, temperature=0.9, n=3, seed=5)
    assert len(r.choices) == 3 and sorted(c.index for c in r.choices) == [0, 1, 2]
    again = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=16, temperature=0.9, n=3, seed=5)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seeds reproduce
    full = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0).choices[0].text
    stop = full.strip()[:3] if len(full.strip()) > 3 else None
    assert stop, full
    cut = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop])
    assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
    assert full.startswith(cut.choices[0].text)


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "integer"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "hi", "stop": 7}, 400, "stop"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": "yes"}, 400, "logprobs"),
    ({"prompt": "word " * 700, "max_tokens": 8}, 400, "context"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "not found"),
    ({"prompt": "hi", "speculative": {"method": "medusa"}}, 400, "'ngram'"),
])
def test_bad_requests_get_openai_style_errors(server, body, status, needle):
    import json

    code, text = http(server[0] + "/v1/completions", {"model": "smol", **body} if "model" not in body else body)
    assert code == status, text
    err = json.loads(text)["error"]
    assert needle in err["message"] and err["type"]


def _oracle_logprobs(lm, ids: list[int], new: list[int]):
    """log_softmax of the target's logits at each new token, decoding one token per forward (plain
    decoding's numbers, which prompts prefilled in exact chunks share: specdec/prefix_cache.py)."""
    import torch

    seq = ids + new
    cache = lm.model.new_cache(1, len(seq) + 1)
    rows = []
    with torch.inference_mode():
        for t, tok in enumerate(seq[:-1]):
            logits, _ = lm.model(torch.tensor([[tok]]), torch.tensor([[t]]), cache)
            rows.append(logits[0, -1])
    return torch.log_softmax(torch.stack(rows[len(ids) - 1:]).double(), -1)


def test_logprobs_match_the_target_with_and_without_speculation(client, default_model):
    from specdec.engine import Engine
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    prompt = "List: red, green, blue, red, green, blue, red,"
    ids = encode_prompt(default_model.tokenizer, prompt, False)
    [plain] = Engine(default_model.model, None, eos_ids=default_model.eos_ids).generate(
        [ids], SamplingParams(max_new_tokens=16))
    new = plain.tokens
    ref = _oracle_logprobs(default_model, ids, new)
    outs, steps = [], []
    for spec in ({"k": 0}, {"k": 8}, {"method": "ngram"}):  # off, lookup + trees, lookup only
        r = client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0, logprobs=3,
                                      extra_body={"speculative": spec})
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
        assert "".join(lp.tokens) == r.choices[0].text and all(len(t) == 3 for t in lp.top_logprobs)
        got = torch.tensor(lp.token_logprobs, dtype=torch.float64)
        want = ref[torch.arange(len(new)), torch.tensor(new)][: len(got)]
        # the prompt's chunks and the steps compute every token as decoding it alone does: the same
        # logits (the log-probabilities are taken in float32 there, in float64 here)
        assert torch.allclose(got, want, atol=1e-4), (got, want)
        steps.append(got)
        # greedy: the chosen token is the most likely one
        assert all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
        outs.append(r.choices[0].text)
    assert outs[0] == outs[1] == outs[2]
    assert all(torch.allclose(other, steps[0], atol=1e-5) for other in steps[1:]), steps
    c = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    streamed = []
    for ev in client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}],
                                             max_tokens=8, temperature=0, logprobs=True, stream=True):
        if ev.choices and ev.choices[0].logprobs and ev.choices[0].logprobs.content:
            streamed += [e.logprob for e in ev.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_malformed_json_and_wrong_key(server):
    import json

    code, text = http(server[0] + "/v1/chat/completions", raw=b"{not json")
    assert code == 400 and "JSON" in json.loads(text)["error"]["message"]
    assert http(server[0] + "/v1/completions", {"prompt": "hi"}, key="nope")[0] == 401
    assert http(server[0] + "/v1/completions", {"prompt": "hi"}, key=None)[0] == 401
    code, text = http(server[0] + "/v1/chat/completions", {"messages": "hi"})
    assert code == 400 and "messages" in json.loads(text)["error"]["message"]


def test_load_many_concurrent_streams(client, server, default_model):
    """64 concurrent streaming clients, mixed lengths, over a batch of 8: no failures, every
    response complete and exactly its prompt's greedy output (no text leaks between rows)."""
    from specdec.bench.runner import rss_bytes

    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    lengths = [4, 9, 16, 24]
    expected = {}
    for p in prompts:
        expected[p] = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": p}],
                                                     max_tokens=max(lengths), temperature=0)
    idle = rss_bytes()
    results, errors = {}, []

    def one(j):
        p, n = prompts[j % len(prompts)], lengths[j % len(lengths)]
        try:
            parts, reason = [], None
            for ev in client.chat.completions.create(model="smol", messages=[{"role": "user", "content": p}],
                                                     max_tokens=n, temperature=0, stream=True):
                for ch in ev.choices:
                    parts.append(ch.delta.content or "")
                    reason = ch.finish_reason or reason
            results[j] = ("".join(parts), reason, p, n)
        except Exception as e:  # noqa: BLE001 - the test reports every failure
            errors.append(f"{j}: {type(e).__name__}: {e}")

    t0 = time.time()
    threads = [threading.Thread(target=one, args=(j,)) for j in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:5]
    assert len(results) == 64 and time.time() - t0 < 300
    for j, (text, reason, p, n) in results.items():
        assert reason in ("stop", "length"), (j, reason)
        full = expected[p].choices[0].message.content
        # a shorter answer is a prefix of the longer greedy answer (both token-exact greedy runs)
        assert full.startswith(text) or text == full, (j, p, n, text, full)
    s = server[1].stats()
    assert s.batch == 0 and s.queued == 0
    assert s.proposed > 0 and s.source_rows.get("eagle", 0) > 0  # speculation ran, EAGLE trees among it
    time.sleep(0.5)
    assert rss_bytes() < idle + 200 * 2**20  # back near the idle level (the cache is preallocated)


def test_hostile_bodies_get_400s_fast(server):
    """A lone surrogate (JSON "\\ud800"), JSON nested 100000 deep and a 5-million-character prompt:
    OpenAI-style 400s (they were 500s, and the long prompt stalled the server for seconds while
    it was tokenized on the event loop)."""
    import json

    url = server[0] + "/v1/completions"
    for raw, needle in ((b'{"model": "smol", "prompt": "a\\ud800b", "max_tokens": 3}', "UTF-8"),
                        (b'{"model": "smol", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "UTF-8"),
                        (b"[" * 100000 + b"]" * 100000, "deeply")):
        code, text = http(url if b"messages" not in raw else server[0] + "/v1/chat/completions", raw=raw)
        assert code == 400 and needle in json.loads(text)["error"]["message"], text
    t0 = time.perf_counter()
    code, text = http(url, {"model": "smol", "prompt": "x" * 5_000_000, "max_tokens": 1})
    assert code == 400 and "at least" in json.loads(text)["error"]["message"]
    assert time.perf_counter() - t0 < 5.0  # refused before tokenizing (tokenizing it takes ~5 s)


def test_unknown_paths_and_methods_get_openai_style_errors(server):
    import json
    import urllib.error
    import urllib.request

    assert http(server[0] + "/v1/nothing-here", {"prompt": "hi"})[0] == 404
    code, text = http(server[0] + "/v1/nothing-here", {"prompt": "hi"})
    assert json.loads(text)["error"]["type"] == "not_found_error"
    req = urllib.request.Request(server[0] + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 405 and "GET is not allowed" in json.loads(e.value.read())["error"]["message"]


def test_usage_with_a_stop_string_does_not_depend_on_speculation(client):
    """A speculative step may commit tokens past a stop string before it is seen: usage counts
    only up to the token that completed it, as plain decoding does."""
    full = client.completions.create(model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=24, temperature=0,
                                     extra_body={"speculative": {"k": 0}}).choices[0].text
    stop = " 9,"  # a counting pattern: lookups guess it well, so a step commits past the stop
    assert stop in full, full
    usage = [client.completions.create(model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=24, temperature=0, stop=[stop],
                                       extra_body={"speculative": spec}).usage.completion_tokens
             for spec in ({"k": 0}, {"k": 8}, {"method": "ngram"})]
    assert usage[0] == usage[1] == usage[2] and 0 < usage[0] < 24, usage


def test_requests_cancelled_in_the_queue_free_their_place(default_model):
    import queue as queue_mod

    from specdec.core.scheduler import ContinuousBatcher, Request
    from specdec.types import SamplingParams

    b = ContinuousBatcher(default_model.model, default_model.eos_ids, method="none", max_batch=1, max_queue=1,
                          max_context=256, thread=False)  # no worker: requests stay queued
    try:
        first = Request([1, 2, 3], SamplingParams(max_new_tokens=4), lambda *_: None, lambda *_: None)
        b.submit(first)
        with pytest.raises(queue_mod.Full):
            b.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=4), lambda *_: None, lambda *_: None))
        first.cancel()  # e.g. it timed out waiting (408)
        b.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=4), lambda *_: None, lambda *_: None))
        assert b.waiting.qsize() == 1 and b.stats().cancelled == 1
    finally:
        b.close()


def test_stream_include_usage(client):
    """stream_options.include_usage: a last chunk with empty choices and the request's usage,
    the same as the non-streamed response's (a bad stream_options is a 400)."""
    import openai

    kw = dict(model="smol", prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[" 9,"])
    whole = client.completions.create(**kw).usage
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (whole.prompt_tokens, whole.completion_tokens)
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in plain)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**kw, stream=True, stream_options={"include_usage": "yes"})


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"50": 10}), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("best_of", 3), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("suffix", "tail"), ("repetition_penalty", 1.3),
])
def test_unimplemented_openai_fields_are_refused_not_ignored(server, field, value):
    """Fields specdec does not implement used to be ignored: a caller asking for a penalty got ordinary text
    back with no sign. A non-default value is a 400 naming the field (`tools`: chat only)."""
    import json

    code, text = http(server[0] + "/v1/completions", {"model": "smol", "prompt": "hi", "max_tokens": 2, field: value})
    assert code == 400, text
    err = json.loads(text)["error"]
    assert err["param"] == field and "not supported" in err["message"]


def test_default_values_of_unimplemented_fields_are_served(server):
    """What many clients send on every request (zero penalties, echo false, an empty logit_bias...) still works."""
    import json

    body = {"model": "smol", "prompt": "hi", "max_tokens": 2, "echo": False, "logit_bias": {}, "presence_penalty": 0,
            "frequency_penalty": 0.0, "best_of": 1, "tools": [], "tool_choice": "none", "suffix": "",
            "response_format": {"type": "text"}, "user": "u1", "top_k": -1, "min_p": 0}
    code, text = http(server[0] + "/v1/completions", body)
    assert code == 200, text
    code, text = http(server[0] + "/v1/completions", {**body, "n": 2, "best_of": 2, "temperature": 0.5})
    assert code == 200 and len(json.loads(text)["choices"]) == 2, text


def test_top_k_one_is_greedy_and_content_parts_are_text(client, default_model):
    """top_k (an extension, as in vLLM) reaches the sampler: top_k 1 at temperature 1 is the greedy text.
    Chat content given as OpenAI's list of text parts reads as that text."""
    q = "Name a fruit."
    want = plain_greedy(default_model, q, True, 16)
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": q}], max_tokens=16,
                                       temperature=1.0, extra_body={"top_k": 1})
    assert r.choices[0].message.content == want
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "fruit."}]
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": parts}], max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.content == plain_greedy(default_model, "Name a\nfruit.", True, 16)


@pytest.mark.parametrize("content,needle", [
    ([{"type": "image_url", "image_url": {"url": "http://x"}}], "only text content"),
    ([], "'content'"), (None, "'content'"), (5, "'content'"),
])
def test_non_text_content_is_a_400(server, content, needle):
    import json

    code, text = http(server[0] + "/v1/chat/completions",
                      {"model": "smol", "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert code == 400 and needle in json.loads(text)["error"]["message"], text
