"""specdec on Ray: `generate --ray` (engine actors) and `serve --ray` (Ray Serve replicas).

Each test starts from a local Ray instance that this module starts (2 CPUs, no dashboard) and
stops. Oracles: the single-process `specdec generate` for the batch results and for the
replicas' greedy text. Skipped, with the reason, where Ray is not installed.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest

from specdec.cli import build_parser, main

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason='Ray is not installed (pip install -e ".[ray]")')
PROMPTS = ["Say a word.", "Name a color.", "def add(a, b):", "Count to five.", "What is 2+2?"]


@pytest.fixture(scope="module")
def local_ray():
    from specdec.distributed import start_ray

    started = start_ray(None, quiet=True)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def prompts_file(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return f


def single_process(argv, capsys) -> list[dict]:
    assert main(["generate", *argv, "--json", "--quiet"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def read_results(d) -> list[dict]:
    return [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]


def same_text(ours: list[dict], oracle: list[dict]) -> None:
    assert len(ours) == len(oracle)
    for a, b in zip(ours, oracle):
        assert {"prompt", "text", "token_ids", "finish_reason", "stats"} <= set(a)
        assert (a["index"], a["prompt"], a["text"], a["token_ids"], a["finish_reason"]) == \
            (b["index"], b["prompt"], b["text"], b["token_ids"], b["finish_reason"])
        assert [c["token_ids"] for c in a.get("completions", [])] == [c["token_ids"] for c in b.get("completions", [])]


# --- without Ray, or with Ray-only flags alone ------------------------------------------
def test_ray_flag_without_ray_says_how_to_install(monkeypatch, prompts_file, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["generate", "--prompts-file", str(prompts_file), "--ray", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs Ray" in err[0] and 'pip install -e ".[ray]"' in err[0]
    assert main(["serve", "--ray"]) == 2
    assert 'pip install -e ".[ray]"' in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["generate", "x", "--out", "d"], "--out only apply with --ray"),
    (["serve", "--replicas", "2"], "--replicas only apply with --ray"),
])
def test_ray_only_flags_need_ray(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_an_unreachable_cluster_address_is_one_clear_error():
    from specdec.distributed import check_reachable
    from specdec.types import SpecdecError

    with pytest.raises(SpecdecError, match=r"could not reach the Ray cluster at --address 127.0.0.1:\d+ .*ray start --head"):
        check_reachable(f"127.0.0.1:{_free_port()}")  # a port nothing listens on
    check_reachable("auto")  # left to Ray


# --- batch generation on actors -----------------------------------------------------------
@needs_ray
@pytest.mark.real_guard  # the oracle runs as a user's single-process run does
@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--seed", "3", "--n", "2"]], ids=["greedy", "seeded"])
def test_batch_on_two_actors_equals_single_process(local_ray, default_model, prompts_file, tmp_path, sampling, capsys):
    common = ["--prompts-file", str(prompts_file), "--max-new-tokens", "10", "--batch-size", "3", *sampling]
    oracle = single_process(common, capsys)
    out = tmp_path / "out"
    assert main(["generate", *common, "--ray", "--replicas", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "on 2 actors" in err
    same_text(read_results(out), oracle)
    assert len(list(out.glob("part-*.jsonl"))) == -(-len(PROMPTS) * (2 if sampling else 1) // 3)


@needs_ray
@pytest.mark.real_guard
def test_batch_resumes_after_an_interruption(local_ray, default_model, prompts_file, tmp_path, monkeypatch, capsys):
    from specdec.distributed import ray_batch

    common = ["--prompts-file", str(prompts_file), "--max-new-tokens", "10", "--batch-size", "2",
              "--temperature", "0.7", "--seed", "11"]
    oracle = single_process(common, capsys)
    out = tmp_path / "out"
    real_write = ray_batch.write_part

    def write_then_interrupt(*a, **k):  # Ctrl-C right after the first chunk is on disk
        real_write(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_batch, "write_part", write_then_interrupt)
    assert main(["generate", *common, "--ray", "--replicas", "2", "--out", str(out)]) == 130
    parts = list(out.glob("part-*.jsonl"))
    assert len(parts) == 1 and not (out / "results.jsonl").exists()
    kept = (parts[0], parts[0].stat().st_mtime_ns, parts[0].read_text())
    capsys.readouterr()

    monkeypatch.setattr(ray_batch, "write_part", real_write)
    assert main(["generate", *common, "--ray", "--replicas", "2", "--out", str(out)]) == 0
    assert "resuming: 1 of 3 chunks are already done" in capsys.readouterr().err
    assert (kept[0].stat().st_mtime_ns, kept[0].read_text()) == kept[1:]  # not decoded again
    same_text(read_results(out), oracle)

    # the same folder with other settings is another job: refused, nothing mixed in
    assert main(["generate", *common[:-1], "12", "--ray", "--out", str(out)]) == 2
    assert "holds the results of another job" in capsys.readouterr().err


# --- Ray Serve replicas -------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app(local_ray):
    from ray import serve

    from specdec.distributed.ray_serve import run_app, stop_app, wait_until_ready

    args = build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--port", str(_free_port()),
                                      "--max-batch", "8", "--max-context", "640", "--log-level", "warning"])
    url = run_app(args, name="specdec-test")
    assert wait_until_ready(url, 120), "the replicas did not come up in 120 s"
    yield url
    stop_app("specdec-test")
    serve.shutdown()


@pytest.fixture
def client(ray_app):
    from openai import OpenAI

    return OpenAI(base_url=ray_app + "/v1", api_key="none", max_retries=0, timeout=120)


def generate_text(prompt: str, tokens: int, chat: bool, capsys) -> str:
    return single_process([prompt, "--chat" if chat else "--raw", "--max-new-tokens", str(tokens)], capsys)[0]["text"]


def metrics(url: str) -> dict[str, float]:
    import urllib.request

    from specdec.distributed.ray_serve import parse_prometheus

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return {name + labels: v for (name, labels), v in parse_prometheus(r.read().decode())[1].items()}


def settled_metrics(url: str) -> dict[str, float]:
    """/metrics once every replica's last post holds its latest counts (two reads agree)."""
    last = metrics(url)
    for _ in range(20):
        time.sleep(1.2)
        now = metrics(url)
        if {k: v for k, v in now.items() if "_total" in k} == {k: v for k, v in last.items() if "_total" in k}:
            return now
        last = now
    return last


@needs_ray
def test_replicas_answer_the_openai_client_streaming_and_not(client, ray_app, default_model, capsys):
    prompt = "def add(a, b):\n"
    want = generate_text(prompt, 24, False, capsys)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert streamed == want
    chat_want = generate_text("Name a color.", 16, True, capsys)
    msgs = [{"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == chat_want
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == chat_want


@needs_ray
def test_load_spreads_over_both_replicas_and_metrics_add_up(client, ray_app):
    before = settled_metrics(ray_app)
    n, results = 8, []

    def one(j):
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Item {j}:", max_tokens=8, temperature=0)
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(j,)) for j in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == n
    after = settled_metrics(ray_app)  # the other replicas post their counts each second
    assert after["specdec_replicas"] == 2
    per_replica = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("specdec_requests_total{")}
    assert len(per_replica) == 2 and all(v > 0 for v in per_replica.values()), per_replica
    assert after["specdec_requests_total"] - before["specdec_requests_total"] == sum(per_replica.values()) == n
    assert after["specdec_generated_tokens_total"] - before["specdec_generated_tokens_total"] == sum(results)
    assert after['specdec_request_seconds_bucket{le="+Inf"}'] == after["specdec_request_seconds_count"] >= n


@needs_ray
def test_a_client_that_goes_away_frees_its_row_on_the_replica(ray_app):
    import http.client

    before = settled_metrics(ray_app)["specdec_requests_cancelled_total"]
    host, port = ray_app.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Numbers: 1, 2,",
                                                        "max_tokens": 500, "temperature": 0, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # mid-stream
    for _ in range(60):
        if metrics(ray_app)["specdec_requests_cancelled_total"] > before:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the replica kept decoding for a client that had gone")


@needs_ray
def test_a_replica_killed_under_load_fails_its_requests_cleanly(client, ray_app, default_model, capsys):
    import openai

    prompt = "Numbers: 1, 2, 3,"  # raw text that goes on to the token limit
    want = generate_text(prompt, 160, False, capsys)
    assert len(default_model.tokenizer.encode(want)) >= 150
    outcomes = {}

    def one(j):
        try:
            if j % 2:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=160, temperature=0, stream=True))
            else:
                text = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=160,
                                                 temperature=0).choices[0].text
            outcomes[j] = ("ok", text)
        except openai.APIError as e:  # a 503, or a stream's error event: each says what happened
            outcomes[j] = ("error", f"{type(e).__name__}: {e} {getattr(e, 'body', '')}")

    threads = [threading.Thread(target=one, args=(j,)) for j in range(8)]
    for t in threads:
        t.start()
    busy = None
    for _ in range(150):  # kill a replica while it decodes some of these requests
        m = metrics(ray_app)
        busy = next((k.split('"')[1] for k, v in m.items()
                     if k.startswith(("specdec_batch_size{", "specdec_queue_size{")) and v > 0), None)
        if busy:
            break
        time.sleep(0.2)
    assert busy, "no replica was seen decoding"
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")
             and "specdec-test#SpecdecEngine#" in a["name"]]
    victim = next(a for a in names if a["name"].endswith("#" + busy))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    for t in threads:
        t.join(timeout=180)
    assert len(outcomes) == 8, "a request neither completed nor failed within 180 s"
    for kind, detail in outcomes.values():
        assert (kind == "ok" and detail == want) or (kind == "error" and "replica serving this request stopped" in detail), detail
    print("outcomes:", sorted(outcomes.values()), file=sys.stderr)
    # the service keeps answering: the other replica at once, a replacement soon
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == want[:len(r.choices[0].text)]
    for _ in range(120):
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::") and "specdec-test#SpecdecEngine#" in a["name"]]
        if len(names) == 2 and victim["name"] not in names:
            break
        time.sleep(1)
    else:
        pytest.fail("Ray Serve did not start a replacement replica within 120 s")
