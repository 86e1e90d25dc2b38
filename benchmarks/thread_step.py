"""A decode step of the default model run from the main thread vs from a second thread.

Why `specdec serve` keeps the model in its main thread (see ContinuousBatcher.run): on a
machine with few cores, torch's OpenMP kernels launched from a second thread were much
slower here. One forward of one token after a 300-token prompt, median of --steps.

    python benchmarks/thread_step.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.models.loader import load_model

    model = load_model(None, quiet=True).model
    cache = model.new_cache(1, 1024)
    model(torch.randint(0, 1000, (1, 300)), torch.arange(300)[None], cache)
    L = int(cache.lengths[0])
    tok, pos = torch.tensor([[5]]), torch.tensor([[L]])

    def steps(out: list) -> None:
        for _ in range(5):
            model(tok, pos, cache)
            cache.truncate(L)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            model(tok, pos, cache)
            cache.truncate(L)
            out.append(time.perf_counter() - t0)

    results = {}
    for where in ("main", "second thread", "main again"):
        out: list = []
        if where == "second thread":
            th = threading.Thread(target=steps, args=(out,))
            th.start()
            th.join()
        else:
            steps(out)
        results[where] = statistics.median(out) * 1e3
        print(f"{where:14s} {results[where]:6.2f} ms per decode step", flush=True)
    print(f"threads {args.threads}: second thread / main = {results['second thread'] / results['main']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
