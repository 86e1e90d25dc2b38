"""What the server tests share: a free loopback port, an app served in a thread, plain HTTP calls,
`specdec serve` as a process, counters that balance, and plain greedy text to compare against."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

MAX_CONTEXT = 512  # the context of the `server` fixture in tests/server/conftest.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn in a thread on a free loopback port; yields its base URL."""
    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def http(url, body=None, raw: bytes | None = None, key: str | None = "sekrit"):
    """(status, text) of a GET (no body) or POST, with the standard library only."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def plain_greedy(lm, prompt, chat: bool, n: int) -> str:
    """What plain greedy decoding (no drafter) gives for `prompt` on the loaded model `lm`."""
    from specdec.engine import Engine
    from specdec.text import encode_prompt
    from specdec.types import SamplingParams

    ids = encode_prompt(lm.tokenizer, prompt, chat)
    [r] = Engine(lm.model, None, eos_ids=lm.eos_ids).generate([ids], SamplingParams(max_new_tokens=n))
    return lm.tokenizer.decode(r.tokens, skip_special_tokens=True)


# `specdec serve` as a process (the tree's code, whichever `specdec` is installed)
SERVE = [sys.executable, "-c", "import sys; from specdec.cli import main; sys.exit(main())", "serve", "--threads", "1",
         "--max-batch", "2", "--max-context", "512", "--log-level", "warning"]


def wait_health(url: str, proc, timeout: float = 120.0) -> None:
    """Wait until the server process `proc` answers /health (fails if it exits or is too slow)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {proc.stderr.read()}")
            time.sleep(0.3)
    raise AssertionError("server did not start")


def post(url: str, body: dict) -> dict:
    """The JSON answer to a POST of `body`."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def served(args: list[str]):
    """A `specdec serve` process on a free port with these arguments, once its /health answers:
    yields (url, process); killed on the way out."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(SERVE + ["--port", str(port)] + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_health(url, proc)
        yield url, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def balanced(batcher) -> bool:
    """Every request the batcher took is finished, cancelled, failed, decoding or queued."""
    s = batcher.stats()
    return s.requests == s.finished + s.cancelled + s.failed + s.batch + s.queued


def wait_idle(batcher, seconds: float = 10.0) -> None:
    """Wait until the batcher has no row and no queue (fails after `seconds`)."""
    t0 = time.time()
    while time.time() - t0 < seconds:
        s = batcher.stats()
        if s.batch == 0 and s.queued == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the batcher did not go idle: {batcher.stats()}")
