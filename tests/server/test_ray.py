"""specdec on Ray: `generate --ray` (engine actors) and `serve --ray` (Ray Serve replicas).

Each test starts from a local Ray instance that this module starts (2 CPUs, no dashboard) and
stops. Oracles: the single-process `specdec generate` for the batch results and for the
replicas' greedy text. Skipped, with the reason, where Ray is not installed.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from server_helpers import free_port
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
    (["generate", "x", "--out", "d"], "--out only applies with --ray"),
    (["serve", "--replicas", "2"], "--replicas only applies with --ray"),
    (["serve", "--max-replicas", "2", "--address", "auto"], "--address, --max-replicas only apply with --ray"),
])
def test_ray_only_flags_need_ray(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_an_unreachable_cluster_address_is_one_clear_error():
    from specdec.distributed import check_reachable
    from specdec.types import SpecdecError

    with pytest.raises(SpecdecError, match=r"could not reach the Ray cluster at --address 127.0.0.1:\d+ .*ray start --head"):
        check_reachable(f"127.0.0.1:{free_port()}")  # a port nothing listens on
    check_reachable("auto")  # left to Ray


@pytest.mark.parametrize("flags, needle", [
    (["--replicas", "2", "--max-replicas", "3"], "a fixed --replicas N or autoscaling with --max-replicas N, not both"),
    (["--min-replicas", "2"], "give --max-replicas N too"),
    (["--max-replicas", "2", "--min-replicas", "3"], "--min-replicas 3 is more than --max-replicas 2"),
])
def test_autoscaling_flags_that_do_not_fit_are_one_error_before_ray_starts(flags, needle, monkeypatch, capsys):
    import specdec.distributed as dist

    monkeypatch.setattr(dist, "start_ray", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setitem(sys.modules, "ray", None)  # also without Ray installed: the flags are checked first
    from specdec.distributed import autoscaling
    from specdec.types import SpecdecError

    with pytest.raises(SpecdecError, match=needle):
        autoscaling(build_parser().parse_args(["serve", "--ray", *flags]))


@needs_ray
def test_app_builder_maps_flags_to_the_deployments_and_refuses_bad_ones():
    """The application a cluster's Serve config deploys (import_path ...:app_builder, args: {flags})."""
    from specdec.distributed.ray_serve import app_builder

    def engine_config(app):
        [engine] = app._bound_deployment.init_args  # the router is bound to the engine deployment
        return engine._bound_deployment._deployment_config, engine._bound_deployment.ray_actor_options

    config, actor = engine_config(app_builder({"flags": "--max-replicas 3 --target-ongoing 4 --drain-timeout 7 "
                                                        "--threads 2"}))
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 4)
    assert config.graceful_shutdown_timeout_s == 7 + 5 and actor["num_cpus"] == 2
    config, _ = engine_config(app_builder({"flags": "--replicas 2 --max-batch 6"}))
    assert config.num_replicas == 2 and config.autoscaling_config is None
    assert config.max_ongoing_requests == 6 + 256  # a full batch plus the batcher's queue reach the replica
    for bad, needle in (({"flags": "--max-batch zero"}, "--max-batch: expected a whole number, got 'zero'"),
                        ({"flags": "--replicas 2 --max-replicas 3"}, "not both"),
                        ({"flag": "--replicas 2"}, "takes one argument, flags")):
        with pytest.raises(ValueError, match=needle) as e:
            app_builder(bad)
        assert "\n" not in str(e.value) and "specdec: error" not in str(e.value)


def test_generate_and_its_ray_actors_check_prompts_with_one_function(default_model, tmp_path):
    """prompts.encode_prompts, which `generate` and EngineWorker.encode both call: a row's own "chat"
    wins over --chat, an empty raw prompt and one past the context are errors naming the file
    and row, a prompt that leaves less room than --max-new-tokens is a note."""
    from specdec.config import SpecConfig
    from specdec.prompts import encode_prompts
    from specdec.text import encode_prompt
    from specdec.types import SpecdecError

    tok = default_model.tokenizer
    args = build_parser().parse_args(["generate", "--prompts-file", "P.jsonl", "--max-new-tokens", "40"])
    cfg = SpecConfig.from_args(args)
    ids, notes = encode_prompts(args, cfg, tok, [("Hi there", False), ("Hi there", None)], 64, [])
    assert ids == [encode_prompt(tok, "Hi there", False), encode_prompt(tok, "Hi there", None)] and ids[0] != ids[1]
    assert any("P.jsonl: prompt 2 has" in n and "of --max-new-tokens 40 fit" in n for n in notes)
    with pytest.raises(SpecdecError, match=r"P.jsonl: prompt 2 is empty and goes in raw"):
        encode_prompts(args, cfg, tok, [("Hi", False), ("", False)], 64, [])
    with pytest.raises(SpecdecError, match=r"P.jsonl: prompt 1 has \d+ tokens but the model's context is 4"):
        encode_prompts(args, cfg, tok, [("one two three four five six", False)], 4, [])


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


# --- training data on actors ------------------------------------------------------------
@needs_ray
@pytest.mark.real_guard
def test_training_data_on_actors_equals_the_single_process_greedy_rows_and_resumes(local_ray, default_model, tmp_path):
    """`train draft --ray`'s collection: each shard alternates a greedy and a sampled batch of one
    prompt; the greedy rows equal the single-process run's bit for bit, sampled rows answer the
    same prompts, and a rerun keeps the shards that exist and rebuilds a missing one exactly."""
    import torch

    from specdec.distributed.ray_collect import collect_training_data
    from specdec.train.distill import CollectConfig, collect

    cfg = CollectConfig(chat_prompts=4, chat_batch=1, shard_rows=2, max_new_tokens=8, text_windows=0, seed=0)
    one = collect(default_model, tmp_path / "one", cfg, quiet=True)
    args = build_parser().parse_args(["train", "draft", "--out", str(tmp_path / "ray"), "--ray", "--replicas", "2"])
    on_ray = collect_training_data(default_model, tmp_path / "ray", cfg, args, quiet=True)
    names = sorted(p.name for p in one.glob("shard_*.pt"))
    assert names == sorted(p.name for p in on_ray.glob("shard_*.pt")) == ["shard_0000.pt", "shard_0001.pt"]
    for name in names:
        a, b = torch.load(one / name), torch.load(on_ray / name)
        assert len(a) == len(b) == 2
        (ta, la, ia, va), (tb, lb, ib, vb) = a[0], b[0]  # the greedy batch
        assert ta == tb and la == lb and torch.equal(ia, ib) and torch.equal(va, vb)
        assert a[1][0][:a[1][1]] == b[1][0][:b[1][1]] and len(b[1][0]) > b[1][1]  # same prompt, an answer
    first = torch.load(on_ray / "shard_0001.pt")
    torch.save(["kept"], on_ray / "shard_0000.pt")
    (on_ray / "shard_0001.pt").unlink()
    collect_training_data(default_model, tmp_path / "ray", cfg, args, quiet=True)
    assert torch.load(on_ray / "shard_0000.pt") == ["kept"]  # done shards are skipped
    again = torch.load(on_ray / "shard_0001.pt")  # a missing one is rebuilt, sampled rows included
    assert all(x[0] == y[0] and torch.equal(x[2], y[2]) for x, y in zip(first, again)) and len(first) == len(again)


def test_train_ray_flags_without_ray_are_one_error():
    from specdec.distributed.ray_collect import train_ray_args
    from specdec.types import SpecdecError

    parse = build_parser().parse_args
    assert train_ray_args(parse(["train", "eagle", "--out", "x"])) is None  # --out is train's own flag
    with pytest.raises(SpecdecError, match="--replicas only applies with --ray"):
        train_ray_args(parse(["train", "draft", "--out", "x", "--replicas", "2"]))


# --- Ray Serve replicas -------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_app(local_ray):
    """Two replicas deployed as a cluster's Serve config deploys them (app_builder), HTTP as
    `serve --ray` starts it."""
    from ray import serve

    from specdec.distributed.ray_serve import app_builder, stop_app, wait_until_ready

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_builder({"flags": "--replicas 2 --max-batch 8 --max-context 640 --log-level warning "
                                    "--drain-timeout 3"}), name="specdec-test", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
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
    # one unit in counters and histograms, summed over the replicas alike
    assert after["specdec_request_seconds_count"] == after["specdec_requests_finished_total"]


@needs_ray
def test_replicas_warm_up_before_they_report_ready(ray_app):
    from ray import serve

    handle = serve.get_deployment_handle("SpecdecEngine", app_name="specdec-test")
    assert all(handle.warm_up_seconds.remote().result() > 0 for _ in range(6))


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


@needs_ray
def test_drain_lets_open_requests_finish_and_ends_the_rest(ray_app, client):
    """What SIGTERM does to `serve --ray` (drain_replicas, last in this module since it stops the
    replicas admitting): a short request finishes, a long stream ends with an error event and
    [DONE], a long plain request gets a 503, a new request gets a 503, and the drain returns once
    nothing is open."""
    import http.client

    import ray

    from specdec.distributed.ray_serve import BOARD_NAME, BOARD_NAMESPACE, drain_replicas

    host, port = ray_app.removeprefix("http://").split(":")
    out = {}

    def post(name, body):
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"model": "SmolLM2-135M-Instruct", **body}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        out[name] = (r.status, r.read().decode())

    long = {"prompt": "Once upon a time", "max_tokens": 600, "temperature": 1.5, "seed": 1}
    jobs = {"short": {"prompt": "Hi", "max_tokens": 4}, "stream": {**long, "stream": True}, "plain": long}
    threads = [threading.Thread(target=post, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for _ in range(100):  # every request admitted
        if sum(v for k, v in metrics(ray_app).items() if k.startswith("specdec_batch_size{")) >= 2:
            break
        time.sleep(0.1)
    t0 = time.time()
    drain = threading.Thread(target=drain_replicas, args=(3.0,))
    drain.start()
    board = ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
    # every replica says it drains (each is told within a tick, says so the next; on a loaded
    # machine that took over 10 s, and a request sent before it was rightly admitted)
    for _ in range(600):
        if ray.get(board.draining.remote(), timeout=10):
            break
        time.sleep(0.1)
    else:
        pytest.fail("no replica said it drains within 60 s of drain_replicas")
    post("late", {"prompt": "Hi", "max_tokens": 4})
    drain.join(timeout=60)
    for t in threads:
        t.join(timeout=60)
    assert not drain.is_alive() and time.time() - t0 < 90
    assert out["short"][0] == 200 and json.loads(out["short"][1])["choices"][0]["finish_reason"] == "length"
    assert out["late"][0] == 503 and "shutting down" in out["late"][1]
    assert out["plain"][0] == 503 and "shutting down" in out["plain"][1]
    events = [e for e in out["stream"][1].split("\n\n") if e]
    assert out["stream"][0] == 200 and '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
