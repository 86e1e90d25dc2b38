"""`specdec train draft|eagle --ray`: the target answers the training prompts on Ray actors.

Collecting a drafter's data (train.distill.collect) is mostly the target answering prompts
(instruction, open-ended and code prompts), `shard_rows` prompts to a shard file. With --ray
those shards go to actors that each hold the target (--threads torch threads each, default 1;
as many actors as the cluster's CPUs hold, or --replicas), two in flight per actor
(ray_batch.spread); the driver writes each shard as it comes back, whole and then renamed,
under the name the single-process run gives it, so a rerun skips the shards that exist, as a
single-process run does.

A shard alternates greedy and sampled batches of `chat_batch` prompts. The greedy batches are
the single-process data exactly (the same batches, and the kernels are row-stable). A sampled
batch draws from a generator seeded by its shard's name, where the single-process run draws
every shard from one generator in order; so sampled rows are another sample of the same
distribution, and the same on every rerun and cluster. The rest of collection (the
self-written prompts, the text windows scored in one forward each) runs in the driver.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

from . import check_cluster_flags, engine_threads, replica_count, require_ray, start_ray


def train_ray_args(args):
    """`args` when `train` should collect on Ray (--ray), else None; one error for --replicas or
    --address without --ray."""
    if not hasattr(args, "ray"):  # a train command without the Ray flags (medusa)
        return None
    check_cluster_flags(args)
    if args.ray:
        require_ray()
        return args
    return None


def shard_seed(seed: int, name: str) -> int:
    """The sampled batches' seed for one shard: fixed by the run's seed and the shard's name."""
    return seed * 1_000_003 + zlib.crc32(name.encode())


class AnswerWorker:
    """One actor holding the target; answers one shard's prompts as collect does."""

    def __init__(self, model: str | None, threads: int, cfg) -> None:
        import torch

        from ..models.loader import load_model

        torch.set_num_threads(threads)
        self.target, self.cfg = load_model(model, quiet=True), cfg

    def answer(self, name: str, prompts: list[str], chat: bool | None) -> list:
        import torch

        from ..train.distill import _chat_rows

        cfg, rows = self.cfg, []
        gen = torch.Generator().manual_seed(shard_seed(cfg.seed, name))
        for j in range(0, len(prompts), cfg.chat_batch):
            greedy = (j // cfg.chat_batch) % 2 == 0
            rows += list(_chat_rows(self.target, prompts[j:j + cfg.chat_batch], greedy, cfg, gen, chat))
        return rows


class AnswerPool:
    """The actors of one collection run (started on first use, so a run whose shards all exist
    starts no Ray), and the Ray instance it started, if any."""

    def __init__(self, args, cfg, quiet: bool) -> None:
        self.args, self.cfg, self.quiet = args, cfg, quiet
        self.ray = require_ray()
        self.workers: list = []
        self.started = False

    def _start(self, shards: int) -> None:
        ray, args = self.ray, self.args
        self.started = start_ray(args.address, self.quiet)
        cls = ray.remote(num_cpus=engine_threads(args), max_restarts=2, max_task_retries=2)(AnswerWorker)
        self.workers = [cls.remote(args.model, engine_threads(args), self.cfg)
                        for _ in range(min(replica_count(args, ray), shards))]

    def answer(self, data: Path, shards: list[tuple[str, list[str]]], chat: bool | None, bar) -> None:
        """Answer the shards (name, prompts) on the actors; each written to data/name as it comes."""
        import torch

        from .ray_batch import spread

        if not shards:
            return
        if not self.workers:
            self._start(len(shards))

        def done(job, rows):
            name, prompts = job
            tmp = data / f".{name}.tmp"
            torch.save(rows, tmp)
            os.replace(tmp, data / name)
            bar.update(len(prompts))

        spread(self.ray, self.workers, shards, lambda w, job: w.answer.remote(job[0], job[1], chat), done,
               lambda job: f"shard {job[0]}", data)

    def close(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        if self.started:
            self.ray.shutdown()
        if self.workers and not self.quiet:
            print(f"[specdec] the target answered on {len(self.workers)} Ray actors", file=sys.stderr)



def collect_training_data(target, out: Path, cfg, args, quiet: bool = False) -> Path:
    """train.distill.collect, with the target answering the prompts on Ray actors when `args`
    ask for it (--ray), else in this process."""
    from ..train.distill import collect

    ray_args = train_ray_args(args)
    if ray_args is None:
        return collect(target, out, cfg, quiet)
    pool = AnswerPool(ray_args, cfg, quiet)
    try:
        return collect(target, out, cfg, quiet, pool)
    finally:
        pool.close()
