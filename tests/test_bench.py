"""specdec bench: task files (errors name the line), category selection, and a small end-to-end
run on the default model whose JSON (last stdout line) holds every method and category."""

from __future__ import annotations

import json

import pytest

from specdec.bench.tasks import load_humaneval, load_jsonl, select
from specdec.cli import main
from specdec.types import SpecdecError


def test_spec_bench_rows_and_user_rows(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["first turn", "second"]}) + "\n"
        + json.dumps({"prompt": "def f():", "chat": False, "category": "code"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    tasks = load_jsonl(f)
    assert [t.category for t in tasks] == ["qa", "code", "user"]
    assert tasks[0].prompt == "first turn" and tasks[0].chat
    assert tasks[1].chat is False


@pytest.mark.parametrize("text, needle", [("{bad json\n", ":1: not valid JSON"), ('{"x": 1}\n', ":1: needs"),
                                          ('\n[1, 2]\n', ":2: expected a JSON object"), ("", "holds no prompts")])
def test_malformed_task_file(tmp_path, text, needle):
    f = tmp_path / "t.jsonl"
    f.write_text(text)
    with pytest.raises(SpecdecError, match=needle):
        load_jsonl(f)


def test_missing_task_file(tmp_path):
    with pytest.raises(SpecdecError, match="cannot read"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_select_limits_per_category_and_rejects_unknown():
    tasks = load_humaneval()
    assert len(tasks) == 164 and all(not t.chat for t in tasks)
    assert len(select(tasks, None, 3)) == 3
    with pytest.raises(SpecdecError, match="unknown category"):
        select(tasks, ["poetry"], None)


def test_unknown_method_is_a_clear_error(capsys):
    assert main(["bench", "--methods", "none,warp"]) == 2
    assert "unknown method" in capsys.readouterr().err


@pytest.mark.default_model
def test_bench_end_to_end(default_model, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--tasks", "humaneval", "--limit", "2", "--methods", "ngram", "--max-new-tokens", "8",
                 "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["methods"] == ["none", "ngram"]
    row = result["table"]["ngram"]["all"]
    assert row["prompts"] == 2 and row["new_tokens"] > 0 and row["tokens_per_s"] > 0
    assert row["equal_to_none"] == "2/2"  # greedy speculation reproduces plain decoding
    assert result["table"]["none"]["all"]["speedup_vs_none"] == 1.0
    assert (out / "results.json").is_file() and (out / "report.md").is_file()
