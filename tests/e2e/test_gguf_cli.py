"""A GGUF target with a GGUF `--draft` through every command a user points at them: `specdec
generate --method draft`, `specdec serve` (a request), `specdec bench` and `specdec validate`,
each giving the greedy text of plain decoding (`generate --method none` on the same file).

Tiny Qwen2 files written by the test (tests/tiny_gguf.py, Q8_0 blocks: their greedy text varies),
the draft a one-layer file with the same tokenizer; and the target file as its own draft, whose
guesses are all accepted, so verification of whole guess runs is exercised too.
"""

from __future__ import annotations

import json
import sys

import pytest

from gguf_random import Q4_K, Q8_0
from tiny_gguf import write_tiny_gguf

PROMPTS = ["the theater is on the street", "at 3 o'clock there"]
N = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_cli")
    target = write_tiny_gguf(d / "target.gguf", "qwen2", Q8_0, seed=0, head_type=Q4_K)
    draft = write_tiny_gguf(d / "draft.gguf", "qwen2", Q8_0, seed=1, layers=1)
    return target, draft


def _generate(capsys, *argv) -> list[dict]:
    from specdec.cli import main

    rows = []
    for p in PROMPTS:
        capsys.readouterr()
        rc = main(["generate", p, "--raw", "--json", "--quiet", "--max-new-tokens", str(N), *argv])
        out = capsys.readouterr().out
        assert rc == 0, out
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


@pytest.fixture(scope="module")
def plain(files):
    """Plain greedy decoding of each prompt: {prompt: (token ids, text)}."""
    from specdec.engine import Engine
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    lm = load_model(str(files[0]), quiet=True)
    out = {}
    for p in PROMPTS:
        [r] = Engine(lm.model, None, k=0, eos_ids=()).generate([lm.tokenizer.encode(p)], SamplingParams(max_new_tokens=N))
        out[p] = (r.tokens, lm.tokenizer.decode(r.tokens, skip_special_tokens=True))
    assert len({t for toks, _ in out.values() for t in toks}) > 4  # (a text worth comparing)
    return out


@pytest.mark.parametrize("which", ["draft", "self"])
def test_generate_with_a_gguf_draft_equals_plain(files, plain, capsys, which):
    target, draft = files
    base = ["--model", str(target)]
    none = _generate(capsys, *base, "--method", "none")
    # (at a fixed k: a draft as slow as this tiny target would not run priced)
    spec = _generate(capsys, *base, "--method", "draft", "--draft", str(draft if which == "draft" else target),
                     "-k", "4", "--draft-confidence", "0", "--fixed-k")
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in none]
    assert [r["token_ids"] for r in none] == [plain[p][0][: len(r["token_ids"])] for p, r in zip(PROMPTS, none)]
    proposed = sum(r["stats"]["proposed"] for r in spec)
    accepted = sum(r["stats"]["accepted"] for r in spec)
    assert proposed > 0
    if which == "self":  # the target guessing for itself: every guess accepted
        assert accepted == proposed


def test_serve_with_a_gguf_draft_answers_exactly(files, plain):
    from server_helpers import post, served

    target, draft = files
    args = ["--model", str(target), "--method", "draft", "--draft", str(draft), "--fixed-k", "-k", "4"]
    with served(args) as (url, _):
        for p in PROMPTS:
            r = post(url + "/v1/completions", {"prompt": p, "max_tokens": N, "temperature": 0})
            assert plain[p][1].startswith(r["choices"][0]["text"]) and r["choices"][0]["text"], p
        with urllib_open(url + "/metrics") as m:
            metrics = m.read().decode()
        proposed = [line for line in metrics.splitlines() if line.startswith("specdec_draft_tokens_proposed_total ")]
        assert proposed and float(proposed[0].split()[1]) > 0  # the GGUF draft model guessed


def urllib_open(url):
    import urllib.request

    return urllib.request.urlopen(url, timeout=10)


def test_bench_with_a_gguf_draft_equals_plain(files, tmp_path, capsys):
    from specdec.cli import main

    target, draft = files
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": p, "chat": False, "category": "c"}) + "\n" for p in PROMPTS))
    capsys.readouterr()
    rc = main(["bench", "--tasks", str(tasks), "--model", str(target), "--draft", str(draft), "--methods",
               "none,draft,auto:with=draft", "--peers", "hf", "--max-new-tokens", str(N), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    for runner in ("draft", "auto:with=draft", "hf"):  # hf: transformers' own GGUF loading, an independent engine
        row = result["table"][runner]["all"]
        assert row["status"] == "ok" and row["equal_to_none"] == f"{len(PROMPTS)}/{len(PROMPTS)}", runner
    assert result["table"]["draft"]["all"]["draft_s"] > 0


def test_validate_with_a_gguf_draft_passes_its_exactness_checks(files, tmp_path, capsys):
    from specdec.cli import main

    target, draft = files
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "rep"
    rc = main(["validate", "--data", str(data), "--raw", "--model", str(target), "--draft", str(draft),
               "--methods", "draft,auto", "--k", "4", "--concurrency", "1", "--min-requests", "2",
               "--max-new-tokens", str(N), "--repeats", "1", "--dist-samples", "1", "--dist-draws", "32",
               "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads((out / "report.json").read_text())
    assert r["verdict"]["exactness_failures"] == []
    assert set(r["configs"]) == {"draft k=4", "auto k=4"}
    for name, cfg in r["configs"].items():
        assert cfg["equal"] == cfg["samples"] == len(PROMPTS), name
    assert r["load_findings"]["failures"] == 0 and r["load_findings"]["equal"] == r["load_findings"]["checked"] > 0
