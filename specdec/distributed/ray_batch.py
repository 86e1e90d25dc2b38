"""`specdec generate --prompts-file BIG.jsonl --ray --out DIR`: batch generation over Ray actors.

The rows (prompt, sample) are cut into the same chunks of --batch-size rows that the
single-process `generate` decodes together, and each chunk keeps its single-process seed
(--seed + the chunk's first row), so every prompt gets the text the single-process run gives
it, greedy or seeded. Chunks go to actors that each hold one engine (--threads torch threads,
default 1); as a chunk finishes, the driver writes it to DIR/part-<first row>.jsonl (written
whole, then renamed: a part file that exists is complete). A rerun of the same job skips the
chunks whose part files exist; DIR/job.json records what the job is (the prompts and every
setting that changes the text), so a different job is refused instead of mixed in. When every
chunk is done, DIR/results.jsonl holds one object per prompt, in prompt order, as
`generate --json` prints them.

Plain Ray actors, not Ray Data: Ray Data's streaming executor schedules its own read and
write tasks beside the actor pool and needs CPUs for them, so on a small node whose CPUs all
hold engines it stalls, and its own output files would not give per-chunk resumption.

This module does the fan-out and the files; decoding is the engine's (built by config.build_engine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from ..types import SpecdecError
from . import engine_threads, replica_count, require_ray, start_ray

RESULTS = "results.jsonl"
JOB = "job.json"
# generate's options that do not change any prompt's text (how and where the job runs)
RUN_ONLY = {"command", "prompt", "prompts_file", "quiet", "fresh", "threads", "json", "ray", "replicas",
            "address", "out"}


class EngineWorker:
    """One engine in one actor. Errors the user can fix (a bad model path, a prompt too long)
    come back as values, not as a dead actor, so the driver can print them in one line."""

    def __init__(self, args) -> None:
        import torch

        from .. import learned
        from ..config import SpecConfig, build_engine, load_target

        self.args, self.error = args, None
        torch.set_num_threads(engine_threads(args))
        try:
            self.cfg = SpecConfig.from_args(args)
            self.target = load_target(self.cfg, quiet=True)
            if self.target.tokenizer is None:
                raise SpecdecError(f"{self.target.path} has no tokenizer; specdec generate needs one to read text prompts")
            self.engine = build_engine(self.cfg, self.target)
            # read what earlier runs learned (speed only); many actors never write the file at once
            self.restored = not args.fresh and learned.restore(self.engine, self.cfg.learned_key(self.target))
        except SpecdecError as e:
            self.error = str(e)

    def ready(self) -> str | None:
        return self.error

    def encode(self, rows_in: list[tuple]) -> dict:
        """Every prompt's ids, checked as single-process `generate` checks them (prompts.encode_prompts),
        plus the notes it prints: {"ids", "notes", "error"}."""
        from ..prompts import encode_prompts

        try:
            ids, notes = encode_prompts(self.args, self.cfg, self.target.tokenizer, rows_in,
                                        self.target.model.max_context, self.engine.sources)
        except SpecdecError as e:
            return {"ids": None, "notes": [], "error": str(e)}
        return {"ids": ids, "notes": notes, "error": None}

    def generate(self, start: int, rows: list[tuple[int, int]], ids: list[list[int]]) -> list[dict]:
        """Decode one chunk (rows[start:start + batch] of the single-process run) with the
        seed that run gives it; one `--json`-shaped object per row."""
        from ..text import TextStream

        args, tok = self.args, self.target.tokenizer
        params = self.cfg.sampling
        if params.seed is not None:  # as cmd_generate: each batch draws from its own seeded stream
            params = dataclasses.replace(params, seed=params.seed + start)
        streams = [TextStream(tok, args.stop) for _ in ids]

        def stop_fn(r, out_ids):
            return streams[r].reached_stop(out_ids)

        results = self.engine.generate(ids, params, None, stop_fn if streams[0].stops else None)
        out = []
        for (i, s), res, text in zip(rows, results, streams):
            text.finish(res.tokens)
            out.append({"index": i, "sample": s, "text": text.text,
                        "token_ids": res.tokens, "finish_reason": res.stats.finish_reason,
                        "stats": res.stats.as_dict(), "model": self.target.name, "weights": self.target.weights,
                        "learned_state": self.restored})
        return out


def job_identity(args, rows_in: list[tuple]) -> dict:
    """What makes two runs the same job: the prompts (hashed) and every setting that changes text."""
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in RUN_ONLY}
    prompts = hashlib.sha256(json.dumps(rows_in, ensure_ascii=False).encode()).hexdigest()
    return {"prompts_sha256": prompts, "prompts": len(rows_in), "settings": settings}


def prepare_out(out: str, job: dict) -> Path:
    """DIR, created if needed; refuses a DIR that holds another job's results."""
    d = Path(os.path.expanduser(out))
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"--out {out}: cannot create the folder ({e.strerror})") from None
    f = d / JOB
    if f.exists():
        try:
            old = json.loads(f.read_text())
        except (OSError, ValueError):
            old = None
        if old != json.loads(json.dumps(job)):
            raise SpecdecError(f"--out {out} holds the results of another job (other prompts or settings, see "
                               f"{f}); give a new folder, or delete this one to start over")
    else:
        write_atomic(f, json.dumps(job, indent=1) + "\n")
    return d


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def part_path(d: Path, start: int) -> Path:
    return d / f"part-{start:08d}.jsonl"


def write_part(d: Path, start: int, objs: list[dict], prompts: list) -> None:
    lines = [json.dumps({**o, "prompt": prompts[o["index"]]}, ensure_ascii=False) for o in objs]
    write_atomic(part_path(d, start), "\n".join(lines) + "\n")


def read_parts(d: Path, chunks: list[tuple[int, list]]) -> dict[tuple[int, int], dict]:
    out = {}
    for start, _ in chunks:
        for line in part_path(d, start).read_text(encoding="utf-8").splitlines():
            o = json.loads(line)
            out[(o["index"], o["sample"])] = o
    return out


def write_results(d: Path, args, prompts: list, done: dict[tuple[int, int], dict]) -> None:
    """DIR/results.jsonl: one object per prompt, as `generate --json` prints it."""
    lines = []
    for i, p in enumerate(prompts):
        comps = [{k: done[(i, s)][k] for k in ("text", "token_ids", "finish_reason", "stats")} for s in range(args.n)]
        first = done[(i, 0)]
        obj = {"index": i, "prompt": p, **comps[0], "method": args.method, "model": first["model"],
               "weights": first["weights"], "learned_state": first["learned_state"]}
        if args.n > 1:
            obj["completions"] = comps
        lines.append(json.dumps(obj, ensure_ascii=False))
    write_atomic(d / RESULTS, "\n".join(lines) + "\n")


def run_chunks(ray, args, d: Path, rows_in: list[tuple], pending: list[tuple[int, list]]) -> int:
    """Decode the pending chunks on actors, two in flight per actor so none waits between
    chunks; each finished chunk is written at once. Returns the number of actors used."""
    from tqdm import tqdm

    worker_cls = ray.remote(num_cpus=engine_threads(args), max_restarts=2, max_task_retries=2)(EngineWorker)
    workers = [worker_cls.remote(args) for _ in range(min(replica_count(args, ray), len(pending)))]
    try:
        for err in ray.get([w.ready.remote() for w in workers]):
            if err:
                raise SpecdecError(err)
        checked = ray.get(workers[0].encode.remote(rows_in))
        if not args.quiet:
            for note in checked["notes"]:
                print(f"[specdec] note: {note}", file=sys.stderr)
        if checked["error"]:
            raise SpecdecError(checked["error"])
        ids, prompts = checked["ids"], [p for p, _ in rows_in]
        bar = tqdm(total=sum(len(rows) for _, rows in pending), unit="row", desc="[specdec] generate",
                   disable=args.quiet, file=sys.stderr)

        def done(job, objs):
            start, rows = job
            write_part(d, start, objs, prompts)
            bar.update(len(rows))

        spread(ray, workers, pending, lambda w, job: w.generate.remote(job[0], job[1], [ids[i] for i, _ in job[1]]),
               done, lambda job: f"rows {job[0]}-{job[0] + len(job[1]) - 1}", d)
        bar.close()
    finally:
        for w in workers:
            ray.kill(w)
    return len(workers)


def spread(ray, workers: list, jobs: list, call, done, describe, where) -> None:
    """Run every job on the actors, two in flight per actor so none waits between jobs; `done(job,
    result)` as each finishes (in the driver, so results are written one at a time). call(actor,
    job) starts a job (an ObjectRef); describe(job) names it in the error of an actor that died
    after Ray's retries, which says the finished jobs are kept under `where`."""
    todo, inflight = list(jobs), {}

    def submit(w):
        if todo:
            job = todo.pop(0)
            inflight[call(w, job)] = (w, job)

    for w in workers * 2:
        submit(w)
    while inflight:
        [ref], _ = ray.wait(list(inflight), num_returns=1)
        w, job = inflight.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise SpecdecError(f"an engine actor died on {describe(job)} after Ray's retries ({type(e).__name__}); "
                               f"finished work is kept under {where}: rerun the same command to resume") from None
        done(job, result)
        submit(w)


def generate_on_ray(args) -> int:
    """The `generate --ray` command: see the module docstring."""
    from ..config import SpecConfig
    from ..prompts import read_prompts

    ray = require_ray()
    if not args.prompts_file:
        raise SpecdecError("--ray reads its prompts from --prompts-file FILE.jsonl (one JSON object per line)")
    if not args.out:
        raise SpecdecError("--ray writes its results under --out DIR (one JSON object per prompt in "
                           f"DIR/{RESULTS}); give a folder")
    SpecConfig.from_args(args)  # bad settings fail before starting anything
    rows_in = read_prompts(args)
    d = prepare_out(args.out, job_identity(args, rows_in))
    rows = [(i, s) for i in range(len(rows_in)) for s in range(args.n)]
    chunks = [(start, rows[start:start + args.batch_size]) for start in range(0, len(rows), args.batch_size)]
    pending = [c for c in chunks if not part_path(d, c[0]).exists()]
    if not args.quiet and len(pending) < len(chunks):
        print(f"[specdec] resuming: {len(chunks) - len(pending)} of {len(chunks)} chunks are already done in {d}",
              file=sys.stderr)
    t0, actors = time.perf_counter(), 0
    if pending:
        started = start_ray(args.address, args.quiet)
        try:
            actors = run_chunks(ray, args, d, rows_in, pending)
        finally:
            if started:
                ray.shutdown()
    prompts = [p for p, _ in rows_in]
    done = read_parts(d, chunks)
    write_results(d, args, prompts, done)
    if not args.quiet:
        tokens = sum(o["stats"]["new_tokens"] for o in done.values())
        wall = time.perf_counter() - t0
        print(f"[specdec] {len(prompts)} prompts ({len(rows)} rows in {len(chunks)} chunks, {len(pending)} decoded "
              f"now on {actors} actors), {tokens} tokens in all; wall {wall:.1f} s; results in {d / RESULTS}",
              file=sys.stderr)
    return 0
