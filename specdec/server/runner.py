"""`specdec serve` as a process: HTTP in a second thread, the model in this one, warm-up before
ready, and a graceful stop.

Start-up: HTTP answers at once; /health says "starting" (503) and requests get 503 while the
batcher warms up on this thread (`ContinuousBatcher.warm_up`), and the text side warms too
(tokenizer, chat template); then "ok". SIGTERM (`docker stop`, Kubernetes, systemd): admit
nothing new (503, /health "draining"), let running and queued requests finish for up to
`drain_timeout` seconds, then end each one still open (a stream gets an error event and
`data: [DONE]`, a waiting client a 503), stop HTTP and exit 0. Ctrl-C stops the same way
without the drain.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from ..types import SpecdecError


def warm_text(state) -> None:
    """The text side's one-off costs (the chat template's compilation, the tokenizer's caches)."""
    text = state.text
    try:
        ids = text.encode_chat([{"role": "user", "content": "Hello."}])
        text.decode(ids)
        text.encode_completion("def f(x):\n    return x")
    except Exception:  # noqa: BLE001 - a model without a chat template: its first request will say so
        pass


def serve(app, batcher, host: str, port: int, log_level: str = "info", drain_timeout: float = 30.0) -> None:
    """Serve `app` (from create_app over `batcher`) until SIGTERM or Ctrl-C. Raises SpecdecError
    when the address cannot be served."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))

    def serve_http():
        try:
            server.run()
        finally:
            batcher.close()  # the HTTP side ended (or never started): stop decoding

    # the model runs in this (main) thread, HTTP in a second one: see ContinuousBatcher.run
    http = threading.Thread(target=serve_http, name="specdec-http", daemon=True)
    http.start()

    def on_sigterm(signum, frame):
        print(f"[specdec] SIGTERM: finishing open requests (at most {drain_timeout:g} s), admitting none",
              file=sys.stderr)
        batcher.drain(drain_timeout)

    signal.signal(signal.SIGTERM, on_sigterm)
    t0 = time.perf_counter()
    try:
        warm_text(app.state.specdec)
        batcher.run(warm=True)
    except KeyboardInterrupt:
        print("[specdec] stopping", file=sys.stderr)
        batcher.end_all("shutdown")  # open streams end with an error event and [DONE]
    finally:
        time.sleep(0.2)  # let the event loop hand the last events to their clients
        server.should_exit = True
        http.join(timeout=10)
    if not server.started:
        raise SpecdecError(f"could not serve on {host}:{port} (see the error above: is the port in use, or the host "
                           "not an address of this machine?)")
    if batcher.draining:
        print(f"[specdec] drained and stopped after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
