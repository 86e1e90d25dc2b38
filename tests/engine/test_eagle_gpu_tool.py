"""tools/eagle_gpu.py (the GPU recipe of the shipped EAGLE head), run on the CPU with a tiny
random target: the whole pipeline runs, and what it writes loads as a head for that target
and drafts exactly (greedy output equal to plain decoding)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from helpers import pinned_costs

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "eagle_gpu.py"
TOKENIZER = ROOT / "specdec" / "assets" / "drafts" / "smollm2-135m-instruct"


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=600)


def test_eagle_gpu_tool_dry_run_on_cpu(tmp_path, monkeypatch):
    from specdec.config import SpecConfig
    from specdec.engine import Engine
    from specdec.methods import TABLE
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"chat": ["Say hello.", "Name a colour."], "code": ["def add(a, b):\n"]}))
    tokens = tmp_path / "tokens.pt"
    (tmp_path / "data").mkdir()
    torch.save([(list(range(100, 160)), 1), (list(range(300, 340)), 1)], tmp_path / "data" / "shard_0000.pt")
    r = run("--export-tokens", tmp_path / "data", tokens)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "head"
    r = run("--device", "cpu", "--tiny-target", TOKENIZER, "--prompts", prompts, "--tokens", tokens, "--out", out,
            "--gen-seconds", 4, "--self-prompt-tokens", 4, "--gen-batch", 2, "--max-new-tokens", 6, "--train-seconds", 2, "--batch-rows", 2,
            "--seq-len", 16, "--unroll", 2, "--holdout", 0.3)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held-out top-1 per drafting step after" in r.stdout
    meta = json.loads((out / "specdec_eagle.json").read_text())
    assert meta["steps_done"] > 0 and meta["feature_rows"] >= 2 and len(meta["heldout_top1_after"]) == 2
    gen = torch.load(out / "gen_tokens.pt", weights_only=False)
    assert int(gen["lens"].sum()) == len(gen["tokens"]) and len(gen["lens"]) >= 1

    target = load_model(str(out / "tiny_target"), quiet=True)
    prompt = target.tokenizer.encode("def add(a, b):\n")
    plain = Engine(target.model, eos_ids=[]).generate([prompt], SamplingParams(max_new_tokens=12))[0].tokens
    [d] = TABLE["eagle"].build(SpecConfig(method="eagle", draft=str(out), tree_depth=3, tree_width=2, tree_nodes=4),
                               target, True)
    # guesses priced free: the barely trained head's tree is not cut away, whatever the machine's timing
    pinned_costs(monkeypatch, draft=0.0, guess=0.0)
    spec = Engine(target.model, d, k=3, eos_ids=[], fixed_k=True).generate([prompt], SamplingParams(max_new_tokens=12))[0]
    assert spec.tokens == plain and spec.stats.proposed > 0


def test_eagle_gpu_tool_says_what_is_missing(tmp_path):
    r = run("--device", "cpu", "--prompts", tmp_path / "nope.json", "--out", tmp_path / "o")
    assert r.returncode != 0 and "nope.json does not exist" in r.stderr
    if not torch.cuda.is_available():
        r = run("--out", tmp_path / "o")
        assert r.returncode != 0 and "no CUDA device here" in r.stderr
