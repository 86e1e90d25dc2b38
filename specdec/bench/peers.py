"""Peer engines for `specdec bench`: the same prompts through other people's decoders.

* transformers `generate` on the same fp32 weights: plain (`hf`), its prompt-lookup
  decoding (`hf-lookup`, `prompt_lookup_num_tokens=k`), and assisted generation with the
  same draft model specdec uses (`hf-assist`, `assistant_model=`, transformers' own
  schedule for the number of assistant tokens).
* llama.cpp through llama-cpp-python on the model's GGUF file: plain (`llamacpp`) and its
  prompt-lookup drafter (`llamacpp-lookup`, `LlamaPromptLookupDecoding(num_pred_tokens=k)`).
  Both engines read the same file's blocks with 8-bit activations, but round and sum in their
  own ways, so greedy texts may part after a near-tie; the report says how far they agree.

Each peer is a `Peer` with `generate(ids, params) -> list[int]` (new token ids, EOS
included if it was produced). `build_peers` runs them in child processes (`PeerProcess`: the
transformers peers share one, each llama.cpp peer has its own), each call with a timeout: a
peer whose process crashes (llama.cpp built for AMX dies with SIGILL on some CPUs) or does not
answer in time raises `PeerFailed` saying so, and the benchmark goes on with the others. A
peer that cannot be built (package missing, no GGUF file, its process crashed while loading)
carries `error` and is reported as skipped; one that fails mid-run is reported as failed with
the error. This module knows nothing about tables or categories.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path
from types import SimpleNamespace

PEERS = ("hf", "hf-lookup", "hf-assist", "llamacpp", "llamacpp-lookup")
#: seconds a peer's process may take to load its model, and to answer one generate call
PEER_TIMEOUT = 600.0


class Peer:
    kind = "peer"

    def __init__(self, name: str, error: str | None = None) -> None:
        self.name = name
        self.error = error  # set when the peer cannot run at all (skipped)

    def generate(self, ids: list[int], params) -> list[int]:
        raise NotImplementedError


class HFPeer(Peer):
    """transformers `generate` with the given extra keyword arguments."""

    def __init__(self, name: str, model, eos_ids, extra: dict | None = None) -> None:
        super().__init__(name)
        self.model = model
        self.eos_ids = list(eos_ids)
        self.extra = extra or {}

    def generate(self, ids, params):
        import torch

        kw = dict(max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_ids or None,
                  pad_token_id=self.eos_ids[0] if self.eos_ids else 0)
        if params.greedy:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                      top_k=params.top_k or None, min_p=params.min_p or None)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        inp = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(inp, attention_mask=torch.ones_like(inp), **kw, **self.extra)
        return out[0, len(ids):].tolist()


class LlamaCppPeer(Peer):
    """llama-cpp-python's `Llama.generate` over token ids (optionally with prompt lookup)."""

    def __init__(self, name: str, gguf: Path, threads: int, n_ctx: int, lookup_k: int | None, eos_ids) -> None:
        super().__init__(name)
        from llama_cpp import Llama

        draft = None
        if lookup_k:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k)
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False, draft_model=draft, logits_all=draft is not None)
        self.eos_ids = set(int(e) for e in eos_ids) | {int(self.llm.token_eos())}

    def generate(self, ids, params):
        self.llm.reset()
        out: list[int] = []
        kw = dict(top_k=1, temp=0.0) if params.greedy else dict(
            temp=params.temperature, top_p=params.top_p, top_k=params.top_k or 0, min_p=params.min_p or 0.0)
        if not params.greedy and params.seed is not None:
            self.llm.set_seed(params.seed)
        for tok in self.llm.generate(ids, reset=True, **kw):
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= params.max_new_tokens:
                break
        return out


def build_peers(names: list[str], target, draft_dir: Path | None, k: int, threads: int, n_ctx: int,
                timeout: float = PEER_TIMEOUT) -> list[Peer]:
    """The requested peers, each running in a child process (module docstring); a peer that
    cannot be built is returned with `error` set. close_peers ends the processes."""
    out: dict[str, Peer] = {}
    groups: list[list[str]] = []
    for name in names:
        if name.startswith("hf"):
            if name == "hf-assist" and draft_dir is None:
                out[name] = Peer(name, "no draft model for this target: pass --draft PATH")
            elif not groups or not groups[0][0].startswith("hf"):
                groups.insert(0, [name])  # (the transformers peers share one process: one fp32 model)
            else:
                groups[0].append(name)
        elif importlib.util.find_spec("llama_cpp") is None:
            out[name] = Peer(name, "llama-cpp-python is not installed (pip install -e '.[peers]'; it compiles "
                                   "llama.cpp, about 5 minutes on two cores)")
        elif getattr(target, "gguf", None) is None:
            out[name] = Peer(name, "the target was not loaded from a GGUF file, so llama.cpp has nothing to run")
        else:
            groups.append([name])
    spec = SimpleNamespace(path=str(target.path) if target is not None else None,
                           gguf=getattr(target, "gguf", None), eos_ids=list(getattr(target, "eos_ids", [])))
    draft = None if draft_dir is None else str(draft_dir)
    for group in groups:
        proc = PeerProcess(group, build_local, (group, spec, draft, k, threads, n_ctx), threads, timeout)
        for name, error in proc.start().items():
            out[name] = Peer(name, error) if error else RemotePeer(name, proc)
    return [out[n] for n in names]


def close_peers(peers: list[Peer]) -> None:
    """End the peers' child processes."""
    for p in peers:
        if isinstance(p, RemotePeer):
            p.process.close()


def build_local(names: list[str], target, draft_dir: str | None, k: int, threads: int, n_ctx: int) -> list[Peer]:
    """The peers built in this process (what build_peers's processes run); one that cannot be
    built is returned with `error` set."""
    out: list[Peer] = []
    hf_model = None
    for name in names:
        if name.startswith("hf"):
            try:
                if hf_model is None:
                    hf_model = _hf_model(target.path)
                if name == "hf":
                    out.append(HFPeer(name, hf_model, target.eos_ids))
                elif name == "hf-lookup":
                    out.append(HFPeer(name, hf_model, target.eos_ids, {"prompt_lookup_num_tokens": k}))
                else:
                    out.append(HFPeer(name, hf_model, target.eos_ids, {"assistant_model": _hf_model(draft_dir)}))
            except Exception as e:  # a peer that cannot load must not stop the benchmark
                out.append(Peer(name, f"transformers could not load the model: {type(e).__name__}: {e}"))
        else:
            try:
                out.append(LlamaCppPeer(name, Path(target.gguf), threads, n_ctx,
                                        k if name == "llamacpp-lookup" else None, target.eos_ids))
            except Exception as e:
                out.append(Peer(name, f"llama.cpp could not load {target.gguf}: {type(e).__name__}: {e}"))
    return out


class PeerFailed(RuntimeError):
    """A peer's process crashed or did not answer in time."""


def _died(exitcode: int | None) -> str:
    """How a child process ended, in words: 'crashed with SIGILL (illegal instruction)', ..."""
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
            what = signal.strsignal(sig)
            return f"crashed with {sig.name} ({what.lower() if what else 'signal ' + str(-exitcode)})"
        except ValueError:
            return f"crashed with signal {-exitcode}"
    return f"exited with status {exitcode}"


_SIGILL_HINT = ("; llama.cpp built for instructions this CPU or its kernel does not run (its AMX path on some "
                "Xeons): rebuild it without them, see docs/troubleshooting.md")


class PeerProcess:
    """Peers built and run in a child process (spawned: a fresh interpreter, no threads forked):
    `start` builds them there, `builder(*builder_args)` (a module-level function returning Peers
    named `names`), and says which could not be built; `call` runs one generate call with a
    timeout and returns the new tokens with the child's peak resident memory during the call and
    how far it grew above its level before it. A crash or a timeout raises PeerFailed (the child
    is ended; every later call raises the same); an exception in the peer raises PeerFailed with
    its text (the child goes on)."""

    def __init__(self, names: list[str], builder, builder_args: tuple, threads: int,
                 timeout: float = PEER_TIMEOUT) -> None:
        self.names, self.timeout = list(names), timeout
        self._args = (builder, builder_args, threads)
        self._proc = self._conn = None
        self.dead: str | None = None  # why the process is gone

    def start(self) -> dict[str, str | None]:
        """Start the child and build the peers: name -> None (ready) or why it cannot run."""
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, *self._args), daemon=True)
        self._proc.start()
        child.close()  # (only the child holds its end: its death reads as the end of the pipe here)
        self._conn = parent
        try:
            return self._answer(self.timeout, "while loading")
        except PeerFailed as e:
            return {n: str(e) for n in self.names}

    def call(self, name: str, ids: list[int], params) -> tuple[list[int], int, int]:
        if self.dead:
            raise PeerFailed(self.dead)
        try:
            self._conn.send((name, list(ids), params))
        except (BrokenPipeError, OSError):
            pass  # (the child is gone: _answer says how)
        return self._answer(self.timeout, "")

    def _answer(self, timeout: float, when: str):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                    kind, value = self._conn.recv()
                    if kind == "error":  # (the peer raised; its process goes on)
                        raise PeerFailed(value)
                    return value
            except (EOFError, ConnectionResetError, BrokenPipeError):
                self._proc.join(5)
                why = _died(self._proc.exitcode)
                hint = _SIGILL_HINT if self._proc.exitcode == -signal.SIGILL and any(
                    n.startswith("llamacpp") for n in self.names) else ""
                self._fail(f"its process {why}{' ' + when if when else ''}{hint}")
            if time.monotonic() >= deadline:
                self._fail(f"no answer in {timeout:.0f} s{' ' + when if when else ''} (hung or far too slow; "
                           "--peer-timeout sets the limit): its process was ended")

    def _fail(self, why: str):
        self.dead = why
        self.close()
        raise PeerFailed(why)

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(2)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.dead = self.dead or "closed"


def _child_main(conn, builder, builder_args, threads) -> None:
    """A PeerProcess's child: build the peers, then answer (name, ids, params) with
    ("ok", (tokens, peak rss, growth)) or ("error", text) until told to stop (None)."""
    import torch

    from .runner import PeakMemory, rss_bytes

    torch.set_num_threads(threads)
    peers = {p.name: p for p in builder(*builder_args)}
    conn.send(("ok", {n: p.error for n, p in peers.items()}))
    pm = PeakMemory()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        name, ids, params = msg
        try:
            before = rss_bytes()
            with pm:
                tokens = peers[name].generate(ids, params)
            conn.send(("ok", (tokens, pm.peak, pm.peak - before)))
        except Exception as e:  # reported by the parent as this runner's failure
            conn.send(("error", f"{type(e).__name__}: {e}"))


class RemotePeer(Peer):
    """A peer running in a PeerProcess; `last_memory` is (peak resident bytes of its process during
    the last call, growth above its level before the call)."""

    def __init__(self, name: str, process: PeerProcess) -> None:
        super().__init__(name)
        self.process = process
        self.last_memory = (0, 0)

    def generate(self, ids, params):
        tokens, peak, grow = self.process.call(self.name, ids, params)
        self.last_memory = (peak, grow)
        return tokens


def _hf_model(path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    p = Path(path)
    if p.is_file():  # a GGUF file (the native model reads it in place): transformers' own GGUF loading
        m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    m.generation_config.pad_token_id = m.generation_config.pad_token_id or 0
    return m
