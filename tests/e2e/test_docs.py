"""The documentation works as written: the README's quick-start commands run on the default model,
the files the docs name exist, the benchmarks index lists every script, and the docs site builds.

README.md marks each quick-start block with `<!-- quickstart: NAME -->` on the line above a
```bash fence. The tests extract those blocks and run every command in them with the `specdec`
console script, from a temporary folder, each checked for what the README says it produces. The
commands are sized in the README itself to finish in seconds to a minute, so the tests run them
exactly as a user would copy them. `serve` is started on a free port instead of 8000, asked the
README's request, and stopped with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from server_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "benchmarks"
QUICKSTARTS = ("generate", "serve", "serve-client", "validate", "bench", "train")
RUN_TIMEOUT = 900  # seconds a quick-start command may take on a slow, shared machine
README_PORT = "8000"


def quickstart_blocks(text: str) -> dict[str, list[str]]:
    """{name: commands} of the README's marked ```bash blocks; a backslash-newline joins lines,
    blank lines and comments are left out. Two blocks of one name are an error."""
    blocks: dict[str, list[str]] = {}
    for m in re.finditer(r"<!-- quickstart: ([\w-]+) -->\n```bash\n(.*?)\n```", text, re.S):
        name = m.group(1)
        assert name not in blocks, f"two quick-start blocks named {name!r} in README.md"
        lines = m.group(2).replace("\\\n", " ").splitlines()
        blocks[name] = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    return blocks


def python_block(text: str, heading: str) -> str:
    """The first ```python block after the Markdown heading `heading`."""
    start = text.index(f"\n## {heading}\n")
    m = re.compile(r"```python\n(.*?)\n```", re.S).search(text, start)
    assert m, f"no python block under '## {heading}'"
    return m.group(1)


def _env() -> dict:
    """The environment of a user's shell, with this checkout's specdec first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"`{cmd}` exited with {p.returncode}:\n{p.stderr[-3000:]}"
    return p


def _need_console_script() -> None:
    assert shutil.which("specdec"), "the `specdec` console script is not on PATH: install with pip install -e ."


# ---------------------------------------------------------------------------- no model needed
def test_readme_is_short_and_marks_every_quickstart():
    text = README.read_text()
    assert len(text.splitlines()) < 250, "README.md is a user document: keep it under 250 lines"
    blocks = quickstart_blocks(text)
    assert set(blocks) == set(QUICKSTARTS), f"quick-start blocks: {sorted(blocks)}"
    for name, cmds in blocks.items():
        assert cmds, f"quick-start block {name!r} is empty"
        if name != "serve-client":
            assert any(c.startswith("specdec ") for c in cmds), f"{name}: {cmds}"
    assert f"--port {README_PORT}" in blocks["serve"][0]
    assert f":{README_PORT}/" in blocks["serve-client"][0]
    assert not re.search(r"^#+ .*(20\d\d-\d\d-\d\d|round)", text, re.M | re.I), "no dates or rounds in headings"


def test_readme_fresh_machine_commands_match_ci():
    """The README's two fresh-machine commands: the first installs what .ci/run installs and ends
    in a generate; the second is .ci/run's test command."""
    first_block = re.search(r"```bash\n(.*?)\n```", README.read_text(), re.S).group(1).splitlines()
    assert len(first_block) == 2
    install, tests = first_block
    assert tests == "python3 -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython3 -m pytest -q\n" in ci
    packages = re.findall(r'pip install [^\n]*?"([^"]+)"', ci)  # what CI installs, each quoted there
    assert packages, ".ci/run installs nothing?"
    for pkg in packages:
        assert pkg in install, f".ci/run installs {pkg}; the README's first command does not"
    assert install.split(" && ")[-1].startswith("specdec generate ")


def _named_paths(text: str) -> set[str]:
    """Repository paths a page names: specdec/..., benchmarks/..., tests/..., tools/..., docs/..."""
    found = re.findall(r"(?<![\w./-])((?:specdec|benchmarks|tests|tools|docs)/[\w./-]*\w)", text)
    return {p for p in found if "." in p.rsplit("/", 1)[-1] or (ROOT / p).is_dir()}


def test_docs_name_only_files_that_exist():
    pages = [README, BENCHMARKS / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    missing = []
    for page in pages:
        text = page.read_text()
        for p in _named_paths(text):
            if not (ROOT / p).exists():
                missing.append(f"{page.relative_to(ROOT)}: {p}")
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # relative Markdown links
            if not re.match(r"[a-z]+:", link) and not (page.parent / link).exists():
                missing.append(f"{page.relative_to(ROOT)}: link {link}")
    assert not missing, "the docs name files the repository lacks:\n" + "\n".join(missing)


def test_benchmarks_index_lists_every_script():
    index = (BENCHMARKS / "README.md").read_text()
    listed = set(re.findall(r"`((?:experiments/)?\w+\.py)`", index))
    scripts = {p.relative_to(BENCHMARKS).as_posix() for p in BENCHMARKS.rglob("*.py")}
    assert scripts - listed == set(), f"benchmarks/README.md does not list {sorted(scripts - listed)}"
    assert listed - scripts == set(), f"benchmarks/README.md lists missing scripts {sorted(listed - scripts)}"


def test_mkdocs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]' installs it)")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").is_file()


# ------------------------------------------------------------------ the default model's commands
@pytest.mark.default_model
def test_quickstart_generate(tmp_path):
    _need_console_script()
    plain, as_json = quickstart_blocks(README.read_text())["generate"]
    p = _run(plain, tmp_path)
    assert p.stdout.strip(), "generate printed no text"
    assert "tok/s" in p.stderr and "weights:" in p.stderr, "the summary line is missing"
    out = json.loads(_run(as_json, tmp_path).stdout.strip().splitlines()[-1])
    assert out["text"] and out["token_ids"] and out["stats"]["new_tokens"] == len(out["token_ids"])


@pytest.mark.default_model
def test_quickstart_bench(tmp_path):
    _need_console_script()
    [cmd] = quickstart_blocks(README.read_text())["bench"]
    result = json.loads(_run(cmd, tmp_path).stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "specdec bench" and result["prompts"] == 2
    runners = json.dumps(result)
    for method in ("none", "ngram", "auto"):
        assert f'"{method}"' in runners


@pytest.mark.default_model
def test_quickstart_validate(tmp_path):
    _need_console_script()
    for cmd in quickstart_blocks(README.read_text())["validate"]:
        p = _run(cmd, tmp_path)
    report = json.loads((tmp_path / "validate-report" / "report.json").read_text())
    assert (tmp_path / "validate-report" / "report.html").is_file()
    assert not report["verdict"]["exactness_failures"]
    assert "validate" in p.stdout


@pytest.mark.default_model
def test_quickstart_train(tmp_path):
    _need_console_script()
    train, decode = quickstart_blocks(README.read_text())["train"]
    _run(train, tmp_path)
    meta = json.loads((tmp_path / "my-draft" / "specdec_draft.json").read_text())
    assert len(meta["vocab_subset"]) == 512
    assert _run(decode, tmp_path).stdout.strip(), "decoding with the trained draft printed nothing"


@pytest.mark.default_model
def test_quickstart_serve(tmp_path):
    _need_console_script()
    blocks = quickstart_blocks(README.read_text())
    [serve], [client] = blocks["serve"], blocks["serve-client"]
    port = str(free_port())
    serve = serve.replace(f"--port {README_PORT}", f"--port {port}")
    client = client.replace(f":{README_PORT}/", f":{port}/")
    # a suite started in the background passes SIGINT ignored to its children: restore it for Ctrl-C
    proc = subprocess.Popen(shlex.split(serve), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        t0 = time.time()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, f"`{serve}` exited:\n{proc.stderr.read()[-3000:]}"
                assert time.time() - t0 < RUN_TIMEOUT, "the server did not start"
                time.sleep(0.5)
        answer = json.loads(_run(client, tmp_path).stdout)
        assert answer["choices"][0]["message"]["content"], answer
        assert answer["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.default_model
def test_readme_python_api_runs(tmp_path):
    code = python_block(README.read_text(), "Python API")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "'new_tokens'" in p.stdout
