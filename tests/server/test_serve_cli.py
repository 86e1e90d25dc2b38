"""`specdec serve` as a process, the way users start it: the model decodes in the main thread
and HTTP runs in a second one. A greedy completion equals plain greedy decoding, /metrics
shows the EAGLE head's trees at work (auto is the default method), `--log-level debug` logs
each step's decision, Ctrl-C stops it cleanly, SIGTERM drains (open streams end finished or
with an error event, always with [DONE]), and a port that is taken is a clear error; `--method draft` (the shipped draft model) and `--method
auto --draft DRAFT_MODEL` answer exactly too, and a path that is not a model is refused before
loading."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import threading
import urllib.error
import urllib.request

import pytest

from server_helpers import SERVE, free_port, plain_greedy, post, served, wait_health

pytestmark = pytest.mark.default_model

def _exact_completion_then_metrics(url: str, proc, default_model) -> dict:
    """Once the server answers: a greedy completion equals plain greedy decoding; returns /metrics
    as {name: value} (a labelled series as name{label="value"})."""
    wait_health(url, proc)
    prompt = "def fibonacci(n):\n"
    r = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0})
    assert r["choices"][0]["text"] == plain_greedy(default_model, prompt, False, 24)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as m:
        return dict(line.rsplit(" ", 1) for line in m.read().decode().splitlines()
                    if line and not line.startswith("#"))


def test_serve_process_answers_exactly_and_stops_on_ctrl_c(default_model):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Ctrl-C as a terminal sends it: a run started in the background (nohup, `&`) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler (this test then timed out in
    # suites started with nohup on 2026-12-02)
    # --fixed-k: every step drafts (the cost model would rarely take a tree on a 24-token answer),
    # so the answer is checked through the shipped head's trees
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--log-level", "debug", "--fixed-k"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = _exact_completion_then_metrics(url, proc, default_model)
        assert float(metrics["specdec_generated_tokens_total"]) == 24
        assert float(metrics['specdec_source_rows_total{source="eagle"}']) > 0  # auto: the shipped head's trees
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # say what the server printed, should it not stop
            proc.kill()
            raise AssertionError(f"serve did not stop within 30 s of Ctrl-C; stderr: {proc.stderr.read()[-3000:]}")
        assert rc == 0
        err = proc.stderr.read()
        assert "stopping" in err
        assert "[specdec] step: batch 1, draft cap" in err  # --log-level debug: every step's decision
        assert "[specdec] prefill: " in err  # and every request's prefill
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_on_a_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run(SERVE + ["--port", str(port), "--method", "ngram"], capture_output=True, text=True,
                           timeout=180)
    assert p.returncode != 0
    assert f"could not serve on 127.0.0.1:{port}" in p.stderr


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_serve_with_the_draft_model_answers_exactly(default_model, method):
    """--method draft (the shipped draft model), and --method auto --draft DRAFT_MODEL (prompt
    lookup beside the draft model instead of the EAGLE head's trees)."""
    from specdec.models.loader import default_draft_for

    extra = ["--draft", str(default_draft_for(default_model))] if method == "auto" else []
    with served(["--method", method, "--fixed-k", "-k", "4"] + extra) as (url, proc):
        metrics = _exact_completion_then_metrics(url, proc, default_model)
        assert float(metrics["specdec_draft_tokens_proposed_total"]) > 0  # the draft model guessed
        assert float(metrics["specdec_draft_tokens_accepted_total"]) > 0
        assert float(metrics['specdec_source_rows_total{source="draft"}']) > 0
        assert 'specdec_source_rows_total{source="eagle"}' not in metrics


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_serve_with_a_head_drafter_alone_answers_exactly(default_model, method):
    """--method medusa / eagle (the heads shipped for the default model) in the server's batcher,
    built as `generate` builds them: the answer equals plain greedy decoding and the heads guessed."""
    with served(["--method", method, "--fixed-k"]) as (url, proc):
        metrics = _exact_completion_then_metrics(url, proc, default_model)
        assert float(metrics["specdec_draft_tokens_proposed_total"]) > 0
        assert float(metrics["specdec_draft_tokens_accepted_total"]) > 0


def test_serve_draft_that_is_not_a_model_is_a_clear_error(tmp_path):
    p = subprocess.run(SERVE + ["--method", "draft", "--draft", str(tmp_path)], capture_output=True, text=True,
                       timeout=180)
    assert p.returncode != 0
    assert f"{tmp_path} is not a draft model" in p.stderr


def _stream_lines(url: str, body: dict, got: dict, key: str, first: threading.Event) -> None:
    """Read one SSE response into got[key] = [data payloads]; sets `first` at the first event."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    events = got.setdefault(key, [])
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except Exception as e:  # noqa: BLE001 - "response ended prematurely" is what the test looks for
        events.append(f"EXCEPTION {type(e).__name__}: {e}")
        first.set()


def test_sigterm_drains_and_ends_every_open_stream(default_model):
    """SIGTERM with streams open: no request is admitted any more (503), each open stream ends
    either finished or with an error event, always followed by data: [DONE], and the process
    exits 0 soon after the drain time. /health says "starting" (503) until warm, then "ok"."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--method", "ngram", "--drain-timeout", "1",
                                     "--max-batch", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        statuses = []
        t0 = time.time()
        while time.time() - t0 < 120:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    statuses.append(json.loads(r.read())["status"])
                    break
            except urllib.error.HTTPError as e:
                statuses.append(json.loads(e.read())["status"])
            except OSError:
                pass
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read())
            time.sleep(0.1)
        assert statuses[-1] == "ok" and set(statuses) <= {"starting", "ok"}, statuses
        got, firsts, threads = {}, [], []
        for i, n in enumerate((400, 400, 3)):
            first = threading.Event()
            body = {"prompt": f"Story {i}: once upon a time", "max_tokens": n, "temperature": 1.2, "seed": i,
                    "stream": True}
            threads.append(threading.Thread(target=_stream_lines, args=(url, body, got, i, first)))
            firsts.append(first)
            threads[-1].start()
        for f in firsts:
            assert f.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        try:
            post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            raise AssertionError("a request during the drain was admitted")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and "shutting down" in json.loads(e.read())["error"]["message"]
        for t in threads:
            t.join(timeout=30)
        rc = proc.wait(timeout=30)
        assert rc == 0
        ended_by_error = 0
        for i, events in got.items():
            assert events[-1] == "[DONE]", (i, events[-3:])
            last = json.loads(events[-2])
            if "error" in last:
                ended_by_error += 1
                assert "shutting down" in last["error"]["message"]
            else:
                assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
        assert ended_by_error >= 1  # the 400-token streams could not finish in the 1 s drain
        assert "drained and stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
