"""Where the benchmark scripts find the shared Spec-Bench dev set: `shared/` inside the
repository, beside it, or at /work/shared (the first that exists); `--data` overrides it in
every script."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (ROOT / "shared", ROOT.parent / "shared", Path("/work/shared")) if p.is_dir()),
              ROOT.parent / "shared")
DEV_SET = SHARED / "data" / "spec_bench" / "dev.jsonl"
