"""How often `specdec validate`'s distribution check catches a broken sampling rule, by draws.

The check (specdec/validate/measure.py `distribution`) samples D seeded continuations of 4 tokens
with prompt lookup drafting at every step and tests them against the target's exact probabilities.
This runs it on the test suite's tiny model (tests/oracle.py) over several seeds, with the engine as
it is and with the classic mistake of tests/oracle.py's `broken_verify_stochastic` (a rejected guess
resampled from p instead of the residual max(0, p - q)), and counts how often each passes / fails:
the false-alarm rate and the power that set the check's default draws.

    python benchmarks/dist_power.py --draws 200,400,800 --seeds 10
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPT = [3, 7, 1, 9, 3, 7, 1, 9, 3, 7, 1]  # repeats itself: prompt lookup always has a match


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", default="200,400,800")
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args()
    import torch

    import specdec.core.step
    from oracle import broken_verify_stochastic, native_of, tiny_hf_llama
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engine import Engine
    from specdec.validate import measure

    torch.set_num_threads(1)
    model = native_of(tiny_hf_llama(5, vocab=32, logit_scale=2.5))
    real = specdec.core.step.verify_stochastic
    doc = {}
    for draws in (int(d) for d in args.draws.split(",")):
        passed = caught = 0
        t0 = time.perf_counter()
        for seed in range(args.seeds):
            for rule in (real, broken_verify_stochastic):
                specdec.core.step.verify_stochastic = rule
                engine = Engine(model, NgramDrafter(), k=3, fixed_k=True)
                ok = measure.distribution(measure.Config("ngram k=3", "ngram", 3, False, engine), model, PROMPT,
                                          draws, 4, 1.0, 1000 * seed)["passed"]
                if rule is real:
                    passed += ok
                else:
                    caught += not ok
        specdec.core.step.verify_stochastic = real
        doc[draws] = {"correct_passed": passed, "broken_caught": caught, "seeds": args.seeds}
        print(f"{draws} draws: the engine passed {passed}/{args.seeds}, the broken rule was caught {caught}/"
              f"{args.seeds} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(json.dumps({"benchmark": "dist_power", "results": doc}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
