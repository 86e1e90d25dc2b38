"""Peers that misbehave, for tests of specdec.bench.peers' child processes (a module of its own:
the spawned child imports it by name)."""

from __future__ import annotations

import os
import resource
import signal
import time

from specdec.bench.peers import Peer


class FakePeer(Peer):
    """generate returns [1, 2, 3]; or, by name: "crash" kills its process with SIGILL (as llama.cpp's
    AMX code did), "hang" sleeps past any timeout, "raises" raises ValueError."""

    def generate(self, ids, params):
        if self.name == "crash":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (no core file)
            os.kill(os.getpid(), signal.SIGILL)
        if self.name == "hang":
            time.sleep(3600)
        if self.name == "raises":
            raise ValueError("bad prompt")
        return [1, 2, 3]


def build(names: list[str], crash_while_loading: bool = False) -> list[Peer]:
    if crash_while_loading:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGILL)
    return [FakePeer(n) if n != "missing" else Peer(n, "not installed") for n in names]
