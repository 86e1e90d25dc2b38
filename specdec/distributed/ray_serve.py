"""`specdec serve --ray --replicas N`: the OpenAI-compatible server as a Ray Serve deployment.

Each replica is one Ray actor holding its own model, engine and continuous batcher, with the
HTTP app that `server.app.create_app` builds mounted as the replica's ingress: the API, its
flags and its errors are the single server's. Ray Serve's proxy takes the HTTP connection on
--host/--port and hands each request to a replica (the less loaded of two picked at random).
Each replica runs --threads torch threads (default 1) and reserves that many CPUs from Ray, so
replicas that share a node do not fight over its cores.

/metrics on any replica answers for all of them: every replica posts its own /metrics text to
a small named actor (the board) each second and on each /metrics call; the answer sums the
counters, histograms and load gauges over the replicas seen in the last
`STALE_S` seconds, recomputes the acceptance rate from the summed counts, and repeats every
replica's own series with a `replica` label. A replica that dies takes its requests with it:
Ray Serve's proxy answers those that were running on it with a bare HTTP 500 (the `openai`
client retries it, by default twice) and ends a stream that had started without `[DONE]`;
it routes new requests to the other replicas and starts a replacement.

Also a Ray Serve application that a cluster's own config deploys:
`import_path: specdec.distributed.ray_serve:app_builder` with `args: {flags: "--method ngram"}`
(the `specdec serve` flags, as one string).
"""

from __future__ import annotations

import asyncio
import re
import shlex
import signal
import sys
import threading
import time

from ..types import SpecdecError
from . import engine_threads, replica_count, require_ray, start_ray

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
    """(model, batcher, method) as `specdec serve` builds them from its flags (the same choice
    of drafter: a draft model, the EAGLE head beside prompt lookup, or prompt lookup alone);
    the batcher decodes in its own thread, since a replica's main thread is Ray's."""
    import os

    from ..cli import _check_draft_path
    from ..drafters.eagle import is_eagle_dir
    from ..models.loader import default_draft_for, load_model
    from ..server.batcher import ContinuousBatcher

    method, drafter = args.method, None
    if method not in ("auto", "draft") and args.draft:
        raise SpecdecError(f"--draft is only used with --method auto or draft (got --method {method})")
    if args.draft:
        _check_draft_path(args.draft, method)
    lm = load_model(args.model, weights=args.weights, quiet=True)
    if lm.tokenizer is None:
        raise SpecdecError("the model has no tokenizer; the server needs one to read text")
    if method == "draft" or (method == "auto" and args.draft and not is_eagle_dir(os.path.expanduser(args.draft))):
        from ..drafters import REGISTRY

        path = args.draft or default_draft_for(lm)
        if path is None:
            raise SpecdecError("--method draft needs --draft PATH (a draft model with the target's tokenizer); "
                               "only the default model ships with a draft")
        drafter = REGISTRY["draft"](target=lm, draft=load_model(str(path), dtype=lm.model.dtype, pack=False))
    elif method == "auto":
        from ..drafters.hybrid import lookup_eagle_for

        drafter = lookup_eagle_for(lm, args.draft)
        if drafter is None:
            method = "ngram"
    batcher = ContinuousBatcher(lm.model, lm.eos_ids, method=method, k_max=args.k, max_batch=args.max_batch,
                                max_queue=args.max_queue, max_context=args.max_context, adaptive=not args.fixed_k,
                                drafter=drafter, thread=True)
    return lm, batcher, method


class MetricsBoard:
    """The latest /metrics text of each replica, with when it came."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.time(), text)

    def recent(self, max_age_s: float) -> dict[str, str]:
        now = time.time()
        self.texts = {r: (t, x) for r, (t, x) in self.texts.items() if now - t <= max_age_s}
        return {r: x for r, (t, x) in self.texts.items()}


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


@serve.deployment(name="SpecdecServer", health_check_period_s=5, health_check_timeout_s=30)
@serve.ingress()
class SpecdecServer:
    """One replica: its own model, engine and continuous batcher behind `create_app`'s API."""

    def __init__(self, args) -> None:
        import torch

        torch.set_num_threads(engine_threads(args))
        self.args = args
        self.lm, self.batcher, self.method = build_batcher(args)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_tag if getattr(ctx, "replica_tag", None) else str(ctx.replica_id)
        self.board = ray.remote(num_cpus=0)(MetricsBoard).options(
            name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True,
            lifetime="detached").remote()
        self.own_metrics = None
        self._stop = threading.Event()
        threading.Thread(target=self._post_metrics_loop, name="specdec-metrics-post", daemon=True).start()

    def __serve_build_asgi_app__(self):
        from fastapi.responses import PlainTextResponse

        from ..server.app import create_app

        args = self.args
        app = create_app(self.lm, self.batcher, args.served_model_name or self.lm.name, api_key=args.api_key,
                         request_timeout=args.request_timeout)
        own = [r for r in app.router.routes if getattr(r, "path", None) == "/metrics"]
        self.own_metrics = own[0].endpoint
        app.router.routes.remove(own[0])

        @app.get("/metrics")
        async def metrics():
            text = await self._own_metrics_text()
            await self.board.post.remote(self.replica, text)
            texts = await self.board.recent.remote(STALE_S)
            texts[self.replica] = text
            return PlainTextResponse(aggregate_metrics(texts), media_type="text/plain; version=0.0.4")

        return app

    async def _own_metrics_text(self) -> str:
        return (await self.own_metrics()).body.decode()

    def _post_metrics_loop(self) -> None:
        while not self._stop.wait(PUSH_EVERY_S):
            if self.own_metrics is None:
                continue
            try:
                self.board.post.remote(self.replica, asyncio.run(self._own_metrics_text()))
            except Exception:  # the board is being replaced, or Ray is shutting down: try again next tick
                pass

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose decode thread died is replaced."""
        thread = self.batcher.thread
        if thread is None or not thread.is_alive():
            raise RuntimeError("the batcher's decode thread is not running")

    def __del__(self) -> None:
        self._stop.set()
        self.batcher.close()


def deployment(args):
    """The bound application for `serve.run`: --replicas replicas of --threads CPUs each."""
    return SpecdecServer.options(
        num_replicas=replica_count(args, ray),
        ray_actor_options={"num_cpus": engine_threads(args)},
        # the batcher queues and refuses (429) as the single server does, so let requests reach it
        max_ongoing_requests=args.max_batch + args.max_queue,
    ).bind(args)


def app_builder(config: dict):
    """Ray Serve application builder for a cluster's config: `args: {flags: "..."}` holds
    `specdec serve` flags (--replicas, --threads, --method ...)."""
    from ..cli import build_parser

    flags = config.get("flags", "") if isinstance(config, dict) else ""
    args = build_parser().parse_args(["serve", *shlex.split(flags), "--ray"])
    return deployment(args)


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


def serve_on_ray(args) -> int:
    """The `serve --ray` command: start (or join) Ray, deploy, serve until Ctrl-C or SIGTERM."""
    started = start_ray(args.address)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        try:
            run_app(args)
        except Exception as e:  # a replica that could not start (bad model path, bad flags) ends up here
            raise SpecdecError(f"the Ray Serve deployment did not start: {str(e).strip().splitlines()[-1]}") from None
        print(f"[specdec] serving on http://{args.host}:{args.port}/v1 with {replica_count(args, ray)} Ray Serve "
              f"replicas of {engine_threads(args)} threads (method {args.method}, max batch {args.max_batch} each)",
              file=sys.stderr)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        print("[specdec] stopping", file=sys.stderr)
    finally:
        if started:  # a local instance of our own: stopping Ray stops everything on it, even if a
            ray.shutdown()  # signal to the whole process group already took Ray's own daemons down
        else:
            stop_app()
    return 0
