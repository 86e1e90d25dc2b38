"""specdec bench: task files (errors name the line), category selection, runners that are
skipped or fail mid-run (marked, not dropped), peers in child processes that crash (SIGILL) or
hang (tests/fake_peers.py) becoming rows that say so, the report files, and a small end-to-end run
on the default model whose JSON (last stdout line) holds every runner and category."""

from __future__ import annotations

import json
import time

import pytest
import torch

from specdec.bench import peers as peers_mod
from specdec.bench.report import format_table, write
from specdec.bench.runner import Runner, category_speedups, run
from specdec.bench.tasks import Task, load_humaneval, load_jsonl, select
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
    assert tasks[0].prompt == "first turn" and tasks[0].chat is None  # the template where the tokenizer has one
    assert tasks[1].chat is False


@pytest.mark.parametrize("text, needle", [("{bad json\n", ":1: not valid JSON"), ('{"x": 1}\n', ":1: needs"),
                                          ('{"prompt": "p", "chat": "no"}\n', ":1: 'chat' must be true or false"),
                                          ('\n[1, 2]\n', ":2: expected a JSON object"), ("", "holds no prompts")])
def test_malformed_task_file(tmp_path, text, needle):
    f = tmp_path / "t.jsonl"
    f.write_text(text)
    with pytest.raises(SpecdecError, match=needle):
        load_jsonl(f)


@pytest.mark.parametrize("row, needle", [
    ({"prompt": 5}, ":1: 'prompt' must be a string"),
    ({"messages": []}, ":1: 'messages' must be a non-empty list"),
    ({"messages": "hi"}, ":1: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, ":1: message 1 needs a string 'role' and a string 'content'"),
    ({"messages": [{"role": "user", "content": "a"}, "b"]}, ":1: message 2 needs"),
    ({"prompt": "a\ud800b"}, ":1: 'prompt' is not valid UTF-8"),  # a JSON escape of a lone surrogate
    ({"messages": [{"role": "user", "content": "\udcff"}]}, ":1: message 1 is not valid UTF-8"),
])
def test_task_rows_the_tokenizer_cannot_take_name_the_line(tmp_path, row, needle):
    """Rows that used to pass the reader and fail later inside the tokenizer or chat template."""
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(SpecdecError, match=needle):
        load_jsonl(f)


def test_task_file_with_a_byte_order_mark(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_bytes("\ufeff".encode() + json.dumps({"prompt": "bom"}).encode() + b"\n")
    assert [t.prompt for t in load_jsonl(f)] == ["bom"]


def test_missing_task_file(tmp_path):
    with pytest.raises(SpecdecError, match="cannot read"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_select_limits_per_category_and_rejects_unknown():
    tasks = load_humaneval()
    assert len(tasks) == 164 and all(not t.chat for t in tasks)
    assert len(select(tasks, None, 3)) == 3
    with pytest.raises(SpecdecError, match="unknown category"):
        select(tasks, ["poetry"], None)


def test_unknown_method_or_peer_is_a_clear_error(capsys):
    assert main(["bench", "--methods", "none,warp"]) == 2
    assert "method must be one of" in capsys.readouterr().err
    assert main(["bench", "--peers", "vllm"]) == 2
    assert "unknown peer" in capsys.readouterr().err
    assert main(["bench", "--methods", ","]) == 2  # used to run the 'none' baseline alone
    assert "names no method" in capsys.readouterr().err


def test_bad_categories_and_unwritable_out_fail_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import specdec.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model before checking input"))
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "category": "a"}) + "\n")
    assert main(["bench", "--tasks", str(f), "--categories", ",", "--peers", "none"]) == 2
    assert "names no category" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--tasks", str(f), "--peers", "none", "--out", str(blocker / "sub")]) == 2
    assert "cannot write the report" in capsys.readouterr().err  # was an internal error after the whole run


@pytest.mark.default_model
@pytest.mark.parametrize("prompt, needle", [("", "task 1 (user) is empty"), ("word " * 9000, "context")])
def test_a_prompt_no_runner_can_take_is_an_error_up_front(default_model, tmp_path, prompt, needle, capsys):
    """It used to fail every runner one by one and exit 0 with a table of failures."""
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": prompt, "chat": False}) + "\n")
    assert main(["bench", "--tasks", str(f), "--methods", "none", "--peers", "none", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "specdec: error:" in err


def _fake_tasks():
    return [Task("a1", "a", "x", False), Task("b1", "b", "y", False), Task("b2", "b", "z", False)]


def test_failing_and_skipped_runners_are_marked_and_the_rest_completes(tmp_path):
    from specdec.types import SamplingParams

    calls = {"boom": 0}

    def good(ids, params):
        return [1, 2, 3], None

    def boom(ids, params):
        calls["boom"] += 1
        if calls["boom"] == 2:
            raise RuntimeError("peer crashed")
        return [1, 2, 3], None

    def differs(ids, params):
        return [1, 2, 4] if ids == [2] else [1, 2, 3], None

    runners = [Runner("none", "specdec", None, "cannot build"), Runner("good", "peer", good),
               Runner("boom", "peer", boom), Runner("differs", "peer", differs), Runner("gone", "peer", None, "not installed")]
    # "none" is skipped here, so equality is not reported; rename the reference to test it below
    result = run(runners, _fake_tasks(), [[1], [2], [3]], SamplingParams(max_new_tokens=3), repeats=2, quiet=True)
    assert result["status"]["none"] == "skipped: cannot build"
    assert result["status"]["gone"] == "skipped: not installed"
    assert result["status"]["boom"].startswith("failed on b1: RuntimeError: peer crashed")
    assert calls["boom"] == 2  # not called again after the failure
    assert result["table"]["good"]["all"]["tokens_per_s"] > 0 and result["table"]["good"]["all"]["new_tokens"] == 9
    assert "tokens_per_s" not in result["table"]["boom"]["all"]  # a failed row is marked, not half-filled
    assert result["table"]["good"]["all"]["peak_rss_mb"] > 0
    text = format_table(result)
    assert "failed on b1" in text and "skipped: not installed" in text
    result.update({"machine": {"cpu": "test"}, "k": 4, "max_new_tokens": 3, "temperature": 0.0, "repeats": 2, "prompts": 3})
    write(result, tmp_path, "specdec bench --test")
    report = (tmp_path / "report.md").read_text()
    assert "`boom`: failed on b1" in report and "| good |" in report
    runners[0] = Runner("none", "specdec", good)
    result = run(runners, _fake_tasks(), [[1], [2], [3]], SamplingParams(max_new_tokens=3), repeats=1, quiet=True)
    assert result["table"]["differs"]["b"]["equal_to_none"] == "1/2"
    assert result["table"]["differs"]["all"]["equal_to_none"] == "2/3"
    assert result["table"]["good"]["all"]["speedup_vs_none"] > 0
    result.update({"machine": {"cpu": "test"}, "k": 4, "max_new_tokens": 3, "temperature": 0.0, "repeats": 1, "prompts": 3})
    files = write(result, tmp_path / "second", "specdec bench --test")
    assert "speedup.png" in files
    for f in files:
        assert (tmp_path / "second" / f).stat().st_size > 0
    assert "| differs |" in (tmp_path / "second" / "report.md").read_text()


def test_llamacpp_peer_without_the_package_is_skipped_with_a_note(monkeypatch):
    real = peers_mod.importlib.util.find_spec
    monkeypatch.setattr(peers_mod.importlib.util, "find_spec", lambda n: None if n == "llama_cpp" else real(n))
    [p] = peers_mod.build_peers(["llamacpp"], target=None, draft_dir=None, k=4, threads=1, n_ctx=64)
    assert "not installed" in p.error and ".[peers]" in p.error


@pytest.mark.default_model
def test_bench_end_to_end(default_model, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--tasks", "humaneval", "--limit", "2", "--methods", "ngram", "--max-new-tokens", "8",
                 "--peers", "hf,hf-lookup", "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["runners"] == ["none", "ngram", "hf", "hf-lookup"]
    row = result["table"]["ngram"]["all"]
    assert row["prompts"] == 2 and row["new_tokens"] > 0 and row["tokens_per_s"] > 0
    assert row["equal_to_none"] == "2/2"  # greedy speculation reproduces plain decoding
    assert result["table"]["none"]["all"]["speedup_vs_none"] == 1.0
    # transformers (float32 throughout) agrees with specdec (8-bit activations) up to near-ties, which
    # either may break its way (token by token: test_cli's test_generate_json_matches_transformers_greedy);
    # its assisted generation reproduces its own greedy decoding
    hf_equal = result["table"]["hf"]["all"]["equal_to_none"]
    assert int(hf_equal.split("/")[0]) >= 1
    assert result["table"]["hf-lookup"]["all"]["equal_to_none"] == hf_equal
    assert result["table"]["hf"]["all"]["speedup_vs_hf"] == 1.0
    for f in ("results.json", "report.md", "speedup.png"):
        assert (out / f).is_file()
    # acceptance by position is drawn when some runner drafted (a fresh lookup may not, in 8 tokens)
    drafted = any(result["table"][n]["all"].get("acceptance_by_pos") for n in result["runners"])
    assert (out / "acceptance.png").is_file() == drafted


def test_bench_plots_acceptance_by_draft_position(tmp_path):
    from specdec.bench.report import plots

    pytest.importorskip("matplotlib")
    row = {"all": {"speedup_vs_none": 1.2, "acceptance_by_pos": [0.8, 0.5, 0.3]}}
    result = {"runners": ["none", "ngram"], "status": {"none": "ok", "ngram": "ok"}, "categories": ["all"],
              "table": {"none": {"all": {"speedup_vs_none": 1.0}}, "ngram": row}}
    assert plots(result, tmp_path) == ["speedup.png", "acceptance.png"]
    assert (tmp_path / "acceptance.png").stat().st_size > 0


def test_peak_memory_sees_a_transient_allocation_and_starts_afresh_each_time():
    """The bench's peak memory: an allocation made and freed inside the block counts; the next
    block's peak starts from what is resident then (on Linux the kernel's high-water mark, reset
    on entry, with no sampling thread beside the measured code). In a fresh process, so that
    other tests' allocator state (memory kept after free) does not blur the second block."""
    import subprocess
    import sys

    code = """
import threading
import torch
from specdec.bench.runner import PeakMemory, rss_bytes
pm = PeakMemory()
before, threads = rss_bytes(), threading.active_count()
with pm:
    assert threading.active_count() == threads  # no sampling thread (Linux)
    x = torch.ones(50 * 2**20)  # 200 MB, touched
    del x
big = pm.peak
assert big >= before + 150 * 2**20, (big, before)
start = rss_bytes()
with pm:
    y = torch.ones(1024)
    del y
assert pm.peak < start + 50 * 2**20, (pm.peak, start)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-800:]


def test_category_speedups_sum_median_times_per_category():
    """Base time over a variant's time, each prompt's time the median of its repeats, summed per
    category and over all prompts."""
    times = {"none": {0: [2.0, 9.0, 2.2], 1: [4.0], 2: [1.0]},
             "fast": {0: [1.0, 1.1, 5.0], 1: [2.0], 2: [2.0]}}
    table = category_speedups(["a", "a", "b"], times, "none", ["fast"])
    assert table == {"a": {"fast": round(6.2 / 3.1, 3)}, "b": {"fast": 0.5}, "all": {"fast": round(7.2 / 5.1, 3)}}


# -- peers in child processes -----------------------------------------------------------------
def _process(names, timeout=60.0, crash_while_loading=False):
    from fake_peers import build

    from specdec.bench.peers import PeerProcess

    proc = PeerProcess(names, build, (names, crash_while_loading), threads=1, timeout=timeout)
    return proc, proc.start()


def test_a_peer_that_crashes_its_process_fails_with_the_signal_named():
    from specdec.bench.peers import PeerFailed
    from specdec.types import SamplingParams

    proc, ready = _process(["good", "crash", "raises", "missing"])
    try:
        assert ready == {"good": None, "crash": None, "raises": None, "missing": "not installed"}
        params = SamplingParams(max_new_tokens=3)
        tokens, peak, grow = proc.call("good", [5], params)
        assert tokens == [1, 2, 3] and peak > 0 and grow >= 0  # (the child's own memory)
        with pytest.raises(PeerFailed, match="ValueError: bad prompt"):
            proc.call("raises", [5], params)
        assert proc.call("good", [6], params)[0] == [1, 2, 3]  # an exception leaves the process running
        with pytest.raises(PeerFailed, match=r"crashed with SIGILL \(illegal instruction\)"):
            proc.call("crash", [5], params)
        with pytest.raises(PeerFailed, match="SIGILL"):  # the process is gone for every peer in it
            proc.call("good", [5], params)
    finally:
        proc.close()


def test_a_peer_that_hangs_is_ended_after_its_timeout():
    from specdec.bench.peers import PeerFailed
    from specdec.types import SamplingParams

    proc, ready = _process(["hang"])
    assert ready == {"hang": None}
    proc.timeout = 3.0
    t0 = time.perf_counter()
    with pytest.raises(PeerFailed, match=r"no answer in 3 s .*--peer-timeout"):
        proc.call("hang", [5], SamplingParams(max_new_tokens=3))
    assert time.perf_counter() - t0 < 30 and not proc._proc.is_alive()


def test_a_peer_process_that_crashes_while_loading_skips_its_peers():
    proc, ready = _process(["good", "other"], crash_while_loading=True)
    assert set(ready) == {"good", "other"}
    assert all("crashed with SIGILL" in why and "while loading" in why for why in ready.values())
    proc.close()


def test_a_crashed_and_a_hung_peer_become_rows_saying_so_and_the_run_goes_on():
    """Through the bench's runner: the peers in their own processes, one crashing, one hanging;
    the other runners' rows are complete."""
    from specdec.bench.peers import RemotePeer
    from specdec.types import SamplingParams

    procs = {}
    for name in ("good", "crash", "hang"):
        procs[name], ready = _process([name], timeout=120.0)
        assert ready == {name: None}
        procs[name].timeout = 5.0  # (a call's limit; loading took longer on a busy machine)
    peers = [RemotePeer(name, proc) for name, proc in procs.items()]
    runners = [Runner("none", "specdec", lambda ids, p: ([1, 2, 3], None))]
    runners += [Runner(p.name, "peer", lambda ids, prm, p=p: (p.generate(ids, prm), None), None,
                       lambda p=p: p.last_memory) for p in peers]
    try:
        result = run(runners, _fake_tasks(), [[1], [2], [3]], SamplingParams(max_new_tokens=3), repeats=1, quiet=True)
    finally:
        for proc in procs.values():
            proc.close()
    status = result["status"]
    assert status["crash"].startswith("failed on a1: PeerFailed: its process crashed with SIGILL")
    assert status["hang"].startswith("failed on a1: PeerFailed: no answer in 5 s")
    assert status["none"] == status["good"] == "ok"
    assert result["table"]["good"]["all"]["equal_to_none"] == "3/3"
    assert result["table"]["good"]["all"]["peak_rss_mb"] > 0  # the peer's process's, reported back
    assert "failed on a1" in format_table(result)
