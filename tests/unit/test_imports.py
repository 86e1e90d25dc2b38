"""The package's import structure: no import cycles (found by walking every module's import
statements, those inside functions included, and the package __init__ each import runs), and
the command line, the configuration and `import specdec` load no heavy library, so parsing
flags and refusing bad input cost no model code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "specdec"
# the one known: models.families subclasses llama's Block, and llama builds a family's layers from it
# (inside functions). Splitting Block and its helpers out of llama.py would end it.
EXPECTED_CYCLES: list[set[str]] = [{"specdec.models.families", "specdec.models.llama"}]


def module_names() -> dict[str, Path]:
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports. `from a.b import c` is a.b.c where that is a
    module, else a.b; importing a.b.c also runs a and a.b (their __init__), so those count too."""
    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    p = package
                    for _ in range(node.level - 1):
                        p = p.rpartition(".")[0]
                    base = p + ("." + base if base else "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                t = owner(t)
                while t:
                    if t in mods and t != mod and not mod.startswith(t + "."):
                        graph[mod].add(t)
                    t = t.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph(module_names()))
    unexpected = [sorted(c) for c in found if c not in EXPECTED_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"


def test_the_walk_finds_a_cycle(tmp_path):
    """The detector itself: two modules importing each other, one of them inside a function."""
    graph = {"p.a": {"p.b"}, "p.b": set(), "p.c": set()}
    assert cycles(graph) == []
    graph["p.b"].add("p.a")
    assert cycles(graph) == [{"p.a", "p.b"}]
    mods = {"specdec.cli": PACKAGE / "cli.py", "specdec.config": PACKAGE / "config.py"}
    assert "specdec.config" in import_graph(mods)["specdec.cli"]


def test_cli_and_api_entry_points_import_no_heavy_library():
    code = ("import sys, specdec, specdec.cli, specdec.flags, specdec.config, specdec.api; "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'pydantic', 'numpy', 'gguf', 'uvicorn') "
            "if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


def test_help_and_flag_errors_import_no_heavy_library():
    """`--help` of every command, and a refused flag, print without loading torch (the parser
    reads its defaults from torch-free modules), so they answer at Python's start-up speed."""
    code = """
import contextlib, io, sys
from specdec.cli import main
for argv in (["--help"], ["generate", "--help"], ["serve", "--help"], ["bench", "--help"], ["validate", "--help"],
             ["train", "draft", "--help"], ["train", "eagle", "--help"], ["train", "medusa", "--help"],
             ["generate", "x", "-k", "nope"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(sorted(m for m in ('torch', 'transformers', 'numpy', 'gguf') if m in sys.modules))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
