"""Where the benchmark scripts find the shared Spec-Bench dev set: `shared/` inside the
repository, beside it, or at /work/shared (the first that exists); `--data` overrides it in
every script. `add_prompt_options` and `dev_prompts`: the prompts of a run, some of each dev
category and the first HumanEval tasks, as the method grid and its kin pick them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (ROOT / "shared", ROOT.parent / "shared", Path("/work/shared")) if p.is_dir()),
              ROOT.parent / "shared")
DEV_SET = SHARED / "data" / "spec_bench" / "dev.jsonl"


def add_prompt_options(ap, per_category: int = 1, humaneval: int = 2) -> None:
    """The options that pick a run's prompts from the dev set and HumanEval (`dev_prompts`)."""
    ap.add_argument("--data", default=str(DEV_SET), help="Spec-Bench JSONL. Default: the shared dev set")
    ap.add_argument("--per-category", type=int, default=per_category,
                    help=f"dev prompts per category. Default: {per_category}")
    ap.add_argument("--humaneval", type=int, default=humaneval, help=f"HumanEval prompts. Default: {humaneval}")


def dev_prompts(tokenizer, args) -> list[list[int]]:
    """The token ids of the prompts `add_prompt_options` picked (specdec.bench.tasks.dev_and_humaneval)."""
    from specdec.bench.tasks import dev_and_humaneval

    return [ids for _, ids in dev_and_humaneval(tokenizer, args.data, args.per_category, args.humaneval)]
