"""`specdec serve --ray --replicas N`: the OpenAI-compatible server as a Ray Serve application.

Two deployments. `SpecdecEngine` replicas each hold their own model, engine and continuous
batcher, and the HTTP app that `server.app.create_app` builds over them: the API, its flags
and its errors are the single server's. Each runs --threads torch threads (default 1) and
reserves that many CPUs from Ray, so replicas that share a node do not fight over its cores.
`SpecdecRouter` is the HTTP ingress behind Ray Serve's proxy (--host/--port): it forwards each
request as it came to an engine replica (the less loaded of two picked at random), which runs
it through its app in process and streams the ASGI messages back. The router exists for the
replica that dies: a request it had not answered yet goes once more to another replica, then
fails with an OpenAI-style 503; a stream that had started ends with an error event. (Ray
Serve's proxy alone answers the first with a bare 500 and cuts the second off silently.)

/metrics on any replica answers for all of them: every replica posts its own /metrics text to
a small named actor (the board) each second and on each /metrics call; the answer sums the
counters, histograms and load gauges over the replicas heard from in the last `STALE_S`
seconds, recomputes the acceptance rate from the summed counts, and repeats every replica's
own series with a `replica` label.

Start and stop as `specdec serve` does: a replica warms up (the batcher's `warm_up`, the text
side) before its constructor returns, so Ray Serve routes nothing to it until it is warm. On
SIGTERM or Ctrl-C, `serve --ray` posts a drain to the board; each replica sees it within
`PUSH_EVERY_S`, stops admitting (503, /health "draining") and lets its open requests run for up
to --drain-timeout seconds (then ends them: a stream with an error event and `data: [DONE]`);
once every replica reports none open, the application is deleted. A replica that Ray Serve
itself stops (autoscaling down, a redeploy) gets the same grace: Serve routes nothing new to it
and waits up to --drain-timeout for its requests (`graceful_shutdown_timeout_s`).

--replicas N is fixed; --max-replicas N autoscales on queue depth (Ray Serve's autoscaling on
the requests in flight per replica, running and queued, aiming at --target-ongoing).

Also a Ray Serve application that a cluster's own config deploys:
`import_path: specdec.distributed.ray_serve:app_builder` with `args: {flags: "--method ngram"}`
(the `specdec serve` flags, as one string).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shlex
import signal
import sys
import threading
import time

from ..types import SpecdecError
from . import autoscaling, engine_threads, replica_count, require_ray, start_ray

ray = require_ray()
from ray import serve  # noqa: E402  (after the check that says how to install Ray)

APP_NAME = "specdec"
BOARD_NAME = "specdec-metrics-board"
BOARD_NAMESPACE = "specdec"
PUSH_EVERY_S = 1.0
STALE_S = 10.0  # a replica not heard from for this long is taken as gone
# gauges that are per-replica means, not sums (acceptance is recomputed from the counts)
MEAN_GAUGES = {"specdec_mean_accepted_length", "specdec_draft_length"}


def build_batcher(args):
    """(model, batcher, method) as `specdec serve` builds them from its flags
    (config.build_batcher); the caller warms the batcher and runs it in a thread of its
    own, since a replica's main thread is Ray's."""
    from ..config import SpecConfig, build_batcher

    return build_batcher(SpecConfig.from_args(args), quiet=True, thread=False)


class MetricsBoard:
    """The latest /metrics text of each replica, with when it came and how many requests it had
    open; and the drain `serve --ray` asks for at shutdown, which every post answers with."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}
        self.open: dict[str, tuple[float, int, bool]] = {}  # replica -> (posted at, open requests, draining)
        self.drain_until: float | None = None
        self.drain_since: float | None = None

    def post(self, replica: str, text: str, open_requests: int = 0, draining: bool = False) -> float | None:
        """Record a replica's metrics, its open requests and whether it drains (refuses new
        requests); returns the seconds left of an asked-for drain, else None."""
        now = time.time()
        self.texts[replica] = (now, text)
        self.open[replica] = (now, open_requests, draining)
        return None if self.drain_until is None else max(0.0, self.drain_until - now)

    def recent(self, max_age_s: float) -> dict[str, str]:
        now = time.time()
        self.texts = {r: (t, x) for r, (t, x) in self.texts.items() if now - t <= max_age_s}
        return {r: x for r, (t, x) in self.texts.items()}

    def drain(self, seconds: float) -> None:
        self.drain_since, self.drain_until = time.time(), time.time() + seconds

    def _live(self) -> list[tuple[float, int, bool]]:
        now = time.time()
        return [v for v in self.open.values() if now - v[0] <= STALE_S]

    def draining(self) -> bool:
        """A drain was asked for and every replica heard from lately has said it drains (it refuses
        new requests), in a post since the drain began."""
        return self.drain_since is not None and all(t > self.drain_since and on for t, _, on in self._live())

    def drained(self) -> bool:
        """Every replica heard from lately drains, with nothing open."""
        return self.draining() and all(n == 0 for _, n, _ in self._live())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_prometheus(text: str) -> tuple[dict[str, str], dict[tuple[str, str], float]]:
    """({metric: type}, {(name, labels): value}) from Prometheus text format lines."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            if m:
                samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return types, samples


def _with_label(labels: str, replica: str) -> str:
    extra = f'replica="{replica}"'
    return "{" + extra + "}" if not labels else "{" + extra + "," + labels[1:]


def _fmt(v: float) -> str:
    return str(int(v)) if v == int(v) and abs(v) < 1e15 else f"{v:.6f}"


def aggregate_metrics(texts: dict[str, str]) -> str:
    """One Prometheus text for all replicas: sums (counters, histograms, batch and queue
    sizes), means of the per-replica means, the acceptance rate from the summed counts, then
    each replica's own series labelled `replica="..."`."""
    parsed = {r: parse_prometheus(t) for r, t in sorted(texts.items())}
    types, order, total, count = {}, [], {}, {}
    for _, (t, samples) in parsed.items():
        types.update(t)
        for key, v in samples.items():
            if key not in total:
                order.append(key)
                total[key], count[key] = 0.0, 0
            total[key] += v
            count[key] += 1
    proposed = total.get(("specdec_draft_tokens_proposed_total", ""), 0.0)
    accepted = total.get(("specdec_draft_tokens_accepted_total", ""), 0.0)
    lines = ["# TYPE specdec_replicas gauge", f"specdec_replicas {len(texts)}"]
    typed = set()
    for key in order:
        name, labels = key
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        if family not in typed and family in types:
            lines.append(f"# TYPE {family} {types[family]}")
            typed.add(family)
        v = total[key]
        if name == "specdec_acceptance_rate":
            v = accepted / proposed if proposed else 0.0
        elif name in MEAN_GAUGES:
            v = v / count[key]
        lines.append(f"{name}{labels} {_fmt(v)}")
    for r, (_, samples) in parsed.items():
        lines += [f"{name}{_with_label(labels, r)} {_fmt(v)}" for (name, labels), v in samples.items()]
    return "\n".join(lines) + "\n"


@serve.deployment(name="SpecdecEngine", health_check_period_s=5, health_check_timeout_s=30,
                  graceful_shutdown_wait_loop_s=1)
class SpecdecEngine:
    """One replica: its own model, engine and continuous batcher, and `create_app`'s HTTP app
    over them, which `http` runs in process for each request the router forwards. Warm before
    the constructor returns (Ray Serve routes nothing to it until then)."""

    def __init__(self, args) -> None:
        import torch

        from ..server.runner import warm_text

        torch.set_num_threads(engine_threads(args))
        self.args = args
        self.lm, self.batcher = build_batcher(args)
        self.method = self.batcher.method
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_tag if getattr(ctx, "replica_tag", None) else str(ctx.replica_id)
        self.board = ray.remote(num_cpus=0)(MetricsBoard).options(
            name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True, lifetime="detached").remote()
        self.app, self.own_metrics = self._build_app()
        warm_text(self.app.state.specdec)
        self.warm_up_s = self.batcher.warm_up()
        self.decoder = threading.Thread(target=self.batcher.run, name="specdec-batcher", daemon=True)
        self.decoder.start()
        self.batcher.ready.wait(30)
        self._stop = threading.Event()
        threading.Thread(target=self._post_metrics_loop, name="specdec-metrics-post", daemon=True).start()

    def _build_app(self):
        """create_app's app with /metrics answering for every replica; (app, a function giving this
        replica's own /metrics text). A middleware answers /metrics before the app's own route."""
        from fastapi.responses import JSONResponse, PlainTextResponse

        from ..server.app import app_settings, create_app
        from ..server.errors import APIError
        from ..server.requests import check_metrics_key

        args = self.args
        app = create_app(self.lm, self.batcher, args.served_model_name or self.lm.name, **app_settings(args))

        def own_text() -> str:
            body, _content_type = app.state.specdec.metrics.render()
            return body.decode() if isinstance(body, bytes) else body

        @app.middleware("http")
        async def metrics_for_every_replica(request, call_next):
            if request.url.path != "/metrics" or request.method != "GET":
                return await call_next(request)
            try:
                check_metrics_key(app.state.specdec, request)
            except APIError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            text = own_text()
            await self.board.post.remote(self.replica, text)
            texts = await self.board.recent.remote(STALE_S)
            texts[self.replica] = text
            return PlainTextResponse(aggregate_metrics(texts), media_type="text/plain; version=0.0.4")

        return app, own_text

    def _post_metrics_loop(self) -> None:
        """Post this replica's /metrics and open requests each tick; start draining when the board
        says a drain was asked for."""
        while not self._stop.wait(PUSH_EVERY_S):
            try:
                s = self.batcher.stats()
                left = ray.get(self.board.post.remote(self.replica, self.own_metrics(), s.batch + s.queued,
                                                      self.batcher.draining), timeout=10)
            except Exception:  # the board is being replaced, or Ray is shutting down: try again next tick
                continue
            if left is not None and not self.batcher.draining:
                self.batcher.drain(left)

    async def http(self, request: dict, body: bytes):
        """Run one HTTP request through the app in process, yielding its ASGI messages as the
        app sends them (token by token for a stream). When the caller stops reading (the
        client went away), the app sees a disconnect and frees the request's batch row."""
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent_body = False

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 0), "root_path": "",
                 "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
                 "query_string": request["query_string"], "headers": request["headers"]}
        task = asyncio.ensure_future(self.app(scope, receive, out.put))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while (message := await out.get()) is not None:
                yield message
            task.result()
        finally:
            gone.set()
            if not task.done():
                await asyncio.wait([task], timeout=5)

    def warm_up_seconds(self) -> float:
        """How long this replica's warm-up took (before it reported ready)."""
        return self.warm_up_s

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose decode thread died is replaced (one that
        ended a drain is being stopped, not replaced)."""
        if not self.decoder.is_alive() and not self.batcher.draining:
            raise RuntimeError("the batcher's decode thread is not running")

    def __del__(self) -> None:
        self._stop.set()
        self.batcher.close()
        self.decoder.join(timeout=10)


REPLICA_LOST = ("the replica serving this request stopped before it finished (Ray Serve starts a replacement); "
                "send the request again")


@serve.deployment(name="SpecdecRouter", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress()
class SpecdecRouter:
    """The HTTP ingress: forwards each request, as it came, to an engine replica (Ray Serve
    picks the less loaded of two) and streams the answer back. A request whose replica dies
    before answering goes once more to another replica (nothing of it reached the client,
    so sending it again is safe) and then fails with an OpenAI-style 503 (Retry-After: 1);
    a stream that had started ends with the `data: {"error": ...}` event a timed-out stream
    ends with. Ray Serve's own proxy would answer the first with a bare 500 and end the
    second without a word. Decodes nothing itself, so it reserves no CPU."""

    def __init__(self, engine) -> None:
        self.engine = engine.options(stream=True)

    def __serve_build_asgi_app__(self):
        async def app(scope, receive, send):  # a plain coroutine function: uvicorn takes it for ASGI 3
            await self.asgi(scope, receive, send)

        return app

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        request = {"method": scope["method"], "path": scope["path"], "query_string": scope.get("query_string", b""),
                   "headers": [(bytes(k), bytes(v)) for k, v in scope["headers"]]}
        forward = asyncio.ensure_future(self.forward(request, body, send))
        client_gone = asyncio.ensure_future(receive())  # the next message can only be http.disconnect
        try:
            await asyncio.wait([forward, client_gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Ray Serve's proxy may cancel this handler itself when the client goes (instead of
            # sending http.disconnect): either way the forward stops, which cancels the replica's
            # `http` and frees the row.
            forward.cancel()
            client_gone.cancel()
            await asyncio.gather(forward, client_gone, return_exceptions=True)

    async def forward(self, request: dict, body: bytes, send) -> None:
        for attempt in (1, 2):
            state = {"started": False, "stream": False}
            answer = self.engine.http.remote(request, body)
            try:
                async for message in answer:
                    if message["type"] == "http.response.start":
                        state["started"] = True
                        state["stream"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                              for k, v in message.get("headers", []))
                    await send(message)
                    if message["type"] == "http.response.body" and not message.get("more_body", False):
                        return
                raise RuntimeError("the replica's answer ended early")
            except asyncio.CancelledError:
                answer.cancel()  # the client went: the replica stops decoding for it
                raise
            except Exception:
                answer.cancel()  # a send to a gone client failed, or the replica died
                if state["started"]:
                    tail = ("data: " + json.dumps({"error": {"message": REPLICA_LOST, "type": "server_error"}})
                            + "\n\n") if state["stream"] else ""
                    await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
                    return
                if attempt == 2:
                    err = json.dumps({"error": {"message": REPLICA_LOST, "type": "server_error", "param": None,
                                                "code": "replica_lost"}}).encode()
                    await send({"type": "http.response.start", "status": 503,
                                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                            (b"content-length", str(len(err)).encode())]})
                    await send({"type": "http.response.body", "body": err, "more_body": False})


def deployment(args):
    """The bound application for `serve.run`: the router in front of the engine replicas
    (--replicas of them, or autoscaled between --min-replicas and --max-replicas) of --threads
    CPUs each. Ray Serve gives a replica it stops --drain-timeout seconds for its open requests
    (the router a few more, to pass their answers on)."""
    scaling = autoscaling(args)
    size = {"autoscaling_config": scaling} if scaling else {"num_replicas": replica_count(args, ray)}
    engine = SpecdecEngine.options(
        **size,
        ray_actor_options={"num_cpus": engine_threads(args)},
        # the batcher queues and refuses (429) as the single server does, so let requests reach it
        max_ongoing_requests=args.max_batch + args.max_queue,
        graceful_shutdown_timeout_s=args.drain_timeout + 5,
    ).bind(args)
    return SpecdecRouter.options(graceful_shutdown_timeout_s=args.drain_timeout + 10).bind(engine)


def app_builder(config: dict):
    """Ray Serve application builder for a cluster's config: `args: {flags: "..."}` holds
    `specdec serve` flags (--replicas, --threads, --method ...). Bad flags raise one ValueError
    that says which (argparse would exit the process Ray builds the application in)."""
    from ..flags import build_parser

    if not isinstance(config, dict) or not isinstance(config.get("flags", ""), str) or set(config) - {"flags"}:
        raise ValueError('specdec\'s Ray Serve application takes one argument, flags: the `specdec serve` flags as '
                         'one string, e.g. args: {flags: "--method ngram --replicas 2"}')
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = build_parser().parse_args(["serve", *shlex.split(config.get("flags", "")), "--ray"])
    except SystemExit:
        lines = said.getvalue().strip().splitlines() or ["not valid"]
        raise ValueError(f"specdec serve flags {config.get('flags', '')!r}: "
                         f"{lines[-1].removeprefix('specdec: error: ')}") from None
    try:
        return deployment(args)
    except SpecdecError as e:
        raise ValueError(str(e)) from None


def wait_until_ready(url: str, timeout_s: float) -> bool:
    import urllib.request

    end = time.time() + timeout_s
    while time.time() < end:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def run_app(args, name: str = APP_NAME) -> str:
    """Deploy on the current Ray instance with HTTP on --host/--port; returns the base URL."""
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(deployment(args), name=name, route_prefix="/", blocking=False)
    return f"http://{args.host}:{args.port}"


def stop_app(name: str = APP_NAME) -> None:
    """Delete the application and the metrics board (Ray Serve itself stays up for the
    cluster's other applications)."""
    serve.delete(name)
    try:
        ray.kill(ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE))
    except ValueError:  # no board (no replica came up)
        pass


def drain_replicas(seconds: float) -> None:
    """Ask every replica to drain (see the module docstring) and wait until none has a request
    open, or the drain time and a tick for the replicas to end what was left have passed."""
    print(f"[specdec] stopping: finishing open requests (at most {seconds:g} s), admitting none", file=sys.stderr)
    try:
        board = ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
        ray.get(board.drain.remote(seconds), timeout=10)
        end = time.time() + seconds + 2 * PUSH_EVERY_S + 2
        while time.time() < end and not ray.get(board.drained.remote(), timeout=10):
            time.sleep(0.5)
    except Exception:  # noqa: BLE001 - no board (no replica came up) or Ray already going down: stop anyway
        pass


def serve_on_ray(args) -> int:
    """The `serve --ray` command: start (or join) Ray, deploy, serve until Ctrl-C or SIGTERM."""
    autoscaling(args)  # flags that do not fit together fail before Ray starts
    started = start_ray(args.address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too where a shell started us with it ignored
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        try:
            run_app(args)
        except Exception as e:  # a replica that could not start (bad model path, bad flags) ends up here
            raise SpecdecError(f"the Ray Serve deployment did not start: {str(e).strip().splitlines()[-1]}") from None
        scaling = autoscaling(args)
        size = (f"{scaling['min_replicas']}-{scaling['max_replicas']} (autoscaled)" if scaling
                else str(replica_count(args, ray)))
        print(f"[specdec] serving on http://{args.host}:{args.port}/v1 with {size} Ray Serve "
              f"replicas of {engine_threads(args)} threads (method {args.method}, max batch {args.max_batch} each)",
              file=sys.stderr)
        while not stop.wait(1.0):
            pass
        drain_replicas(args.drain_timeout)
    finally:
        if started:  # a local instance of our own: stopping Ray stops everything on it, even if a
            ray.shutdown()  # signal to the whole process group already took Ray's own daemons down
        else:
            stop_app()
    return 0
