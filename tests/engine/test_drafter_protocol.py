"""The drafter protocol is all the core needs: a toy drafter written only against
`specdec.drafters.Drafter` runs in `Engine.generate` and in the server's batcher (rows joining and
leaving) with output equal to transformers' plain greedy decoding; Medusa and EAGLE (any
registered drafter) run in the batcher too; the registry imports a drafter's module only when
its method is asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import helpers
from helpers import prompts, run_join_leave, run_jobs, target, target_dir
from specdec.core.scheduler import ContinuousBatcher
from specdec.drafters import Draft, DraftContext, Drafter
from specdec.engine import Engine
from specdec.types import SamplingParams, SpecdecError

from oracle import hf_greedy


class EchoDrafter(Drafter):
    """Guesses that the row repeats what followed the previous occurrence of its last token
    (a one-token prompt lookup), as a chain or as a tree whose second branch guesses the
    last token itself. Per-row state: how many proposals each row had (joins and leaves must
    keep it in step with the batch)."""

    def __init__(self, tree: bool = False) -> None:
        self.tree = tree
        self.max_nodes = 6 if tree else 0
        self.seen: list[int] = []
        self.commits = 0

    def begin(self, prompts, params, max_len):
        self.seen = [0] * len(prompts)

    def add_row(self, max_len, prompt=None):
        self.seen.append(0)

    def keep_rows(self, rows):
        self.seen = [self.seen[r] for r in rows]

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        assert len(ctx.tokens) == len(self.seen), "core and drafter disagree on the rows"
        rows = []
        for b, row in enumerate(ctx.tokens):
            self.seen[b] += 1
            last, guess = row[-1], []
            for i in range(len(row) - 2, -1, -1):
                if row[i] == last:
                    guess = row[i + 1 : i + 1 + max_tokens]
                    break
            rows.append(guess)
        if not self.tree:
            n = max(1, max(len(g) for g in rows))
            toks = torch.tensor([g + [0] * (n - len(g)) for g in rows], dtype=torch.long)
            return Draft(toks, torch.tensor([len(g) for g in rows]))
        # tree: node 1.. the lookup chain under the root, then the last token again under the root
        toks, pars, counts = [], [], []
        for row, g in zip(ctx.tokens, rows):
            g = g[: self.max_nodes - 1]
            toks.append(g + [row[-1]] + [0] * (self.max_nodes - 1 - len(g)))
            pars.append(list(range(len(g))) + [0] * (self.max_nodes - len(g)))
            counts.append(len(g) + 1)
        return Draft(torch.tensor(toks), torch.tensor(counts), None, torch.tensor(pars))

    def commit(self, num_accepted, paths=None):
        assert len(num_accepted) == len(self.seen)
        self.commits += 1


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.mark.parametrize("tree", [False, True])
def test_a_protocol_only_drafter_runs_in_generate(tree):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    d = EchoDrafter(tree)
    # (a fixed k: every step drafts; priced, an unmeasured tree may wait for a probe these answers
    # are too short for)
    res = Engine(target().model, d, k=4, fixed_k=True).generate(ps, SamplingParams(max_new_tokens=16))
    assert [r.tokens for r in res] == [hf_greedy(hf, p, 16) for p in ps]
    assert d.commits > 0 and sum(r.stats.proposed for r in res) > 0


@pytest.mark.parametrize("tree", [False, True])
def test_a_protocol_only_drafter_runs_in_the_batcher(tree):
    d = EchoDrafter(tree)
    b = ContinuousBatcher(target().model, (), [d], method="echo", k_max=4, max_batch=3, max_context=96, adaptive=False)
    got, want = run_join_leave(b)
    assert got == want
    s = b.stats()
    assert d.commits > 0 and s.proposed > 0 and s.accepted > 0 and s.batch == 0
    assert s.source_rows.get("echodrafter", 0) > 0


@pytest.mark.parametrize("method,tree", [("medusa", True), ("medusa", False), ("eagle", True)])
def test_registered_head_drafters_run_in_the_batcher(method, tree):
    """Medusa (chain and static tree) and an EAGLE tree in the server's batcher, every row drafting
    (a fixed k: priced, a tree nothing has measured waits for a probe these answers are too short
    for): every answer equals plain greedy decoding."""
    d = helpers.medusa(tree=tree) if method == "medusa" else helpers.eagle(tree, depth=3, width=2, nodes=6)
    b = ContinuousBatcher(target().model, (), [d], method=method, k_max=3, max_batch=3, max_context=96,
                          adaptive=False)
    got, want = run_join_leave(b)
    assert got == want
    assert b.stats().proposed > 0


def test_a_seeded_sample_in_the_generic_batcher_does_not_depend_on_the_load():
    """Seeded sampled rows take no guesses from a generic drafter: the same tokens alone and
    beside greedy rows that speculate."""
    d = EchoDrafter()
    b = ContinuousBatcher(target().model, (), [d], method="echo", k_max=4, max_batch=3, max_context=96, adaptive=False)
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, seed=5)
    try:
        alone = run_jobs(b, [(prompts()[0], seeded)])
        shared = run_jobs(b, [(prompts()[1], SamplingParams(max_new_tokens=12)), (prompts()[0], seeded)])
    finally:
        b.close()
    assert shared[1] == alone[0] and b.stats().proposed > 0


def test_a_drafter_outside_the_protocol_is_refused():
    class Loose:  # has the methods, but does not declare the protocol
        def propose(self, ctx, k): ...

    with pytest.raises(SpecdecError, match="subclass specdec.drafters.Drafter"):
        Engine(target().model, Loose(), k=2)
    with pytest.raises(SpecdecError, match="Drafter"):
        ContinuousBatcher(target().model, (), [Loose()], method="loose", thread=False)


def test_the_method_table_imports_a_source_only_when_it_builds_it():
    code = ("import sys, specdec.methods as m, specdec.drafters; "
            "assert not [x for x in sys.modules if x.startswith('specdec.drafters.') and x != 'specdec.drafters.base'];"
            "assert 'medusa' in m.TABLE; m.TABLE['ngram'].build(None, None, True); "
            "loaded = sorted(x for x in sys.modules if x.startswith('specdec.drafters.')); "
            "assert loaded == ['specdec.drafters.base', 'specdec.drafters.ngram'], loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("tree", [False, True])
def test_a_protocol_only_drafter_runs_in_validate(tree):
    """`specdec validate`'s path with the toy drafter: acceptance at concurrency 1 (greedy equal
    to plain decoding), the chi-square distribution check on seeded samples, and the load test
    through the server's batcher (`measure.load` with the drafter's method), every answer equal
    to transformers' greedy decoding."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from specdec.bench.tasks import Task
    from specdec.validate import measure, pipeline
    from specdec.validate.samples import Samples

    model = target().model
    ps = prompts()
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir(0)), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = 0
    want = [hf_greedy(hf, p, 12) for p in ps]
    lm = SimpleNamespace(model=model, eos_ids=[], name="tiny", source="tiny-dir", gguf=None)
    samples = Samples([Task(str(i), "c", "p", False) for i in range(len(ps))], ps, source="mem", fmt="jsonl",
                      total=len(ps))
    config = measure.Config("echo", "echo", 4, tree, Engine(model, EchoDrafter(tree), k=4, fixed_k=True))
    opts = pipeline.Options(max_new_tokens=12, repeats=1, concurrency=(), dist_samples=1, dist_draws=160,
                            dist_tokens=3, quiet=True)
    r = pipeline.run(lm, samples, [config], Engine(model), opts, {}, "test", {})
    s = r["configs"]["echo"]
    assert s["equal"] == len(ps) and not s["not_equal"] and s["proposed"] > 0, s
    assert [d["status"] for d in r["distribution"]] == ["pass"], r["distribution"]
    params = SamplingParams(max_new_tokens=12)
    load = measure.load(model, [], ps, params, levels=[1, 3], k=4, min_requests=3, repeats=1, reference=want,
                        make_sources=lambda: [EchoDrafter(tree)], method="echo")
    for name in measure.LOAD_SETTINGS:
        for c in (1, 3):
            row = load["table"][name][c]
            assert row["failures"] == 0 and row["equal"] == row["checked"] == row["requests"] == 3, row
    assert load["table"]["fixed"][1]["mean_guesses"] > 0 and load["drafting"] == "method echo"


def test_a_draft_models_timing_is_steady_only_without_a_catch_up():
    """`draft_timing` marks a proposal that first read a whole prompt (or steps it sat out) as not
    steady, so the cost models never price drafting from a catch-up; a proposal after a commit
    (one unseen token a row) is steady; the seconds are the proposal's own."""
    import time

    from specdec.drafters.draft_model import DraftModelDrafter

    d = DraftModelDrafter(target(1).model)
    ps = prompts()
    d.begin(ps, SamplingParams(), 64)
    assert Drafter.draft_timing(d) is None  # the protocol's default: the core times propose itself
    ctx = [p + [1] for p in ps]  # nothing fed yet: the whole prompts are read first
    t0 = time.perf_counter()
    d.propose(DraftContext(ctx, SamplingParams(), None), 3)
    wall = time.perf_counter() - t0
    seconds, steady = d.draft_timing()
    assert not steady and 0 < seconds <= wall
    d.commit([1, 0, 2])
    draft = d.propose(DraftContext([c + [7] * (n + 1) for c, n in zip(ctx, [1, 0, 2])], SamplingParams(), None), 3)
    assert d.draft_timing()[1] and draft.tokens.shape == (3, 3)
    d.commit([0, 0, 0])
    d.skip()  # steps sat out: more than a step's worth to catch up on
    d.propose(DraftContext([c + [7] * 12 for c in ctx], SamplingParams(), None), 3)
    assert not d.draft_timing()[1]


@pytest.mark.default_model
def test_the_documented_draft_source_runs_in_generate_serve_and_validate(default_model):
    """docs/draft-sources.md's example, run as written (a known source and its one-line method):
    through the Python API (generate), the server's batcher (build_batcher) and validate's
    pipeline; greedy output equals plain decoding in each, and its guesses were verified."""
    import re
    from pathlib import Path

    from specdec.config import SpecConfig, build_batcher
    from specdec.methods import TABLE
    from specdec.text import encode_prompt
    from specdec.validate import measure

    text = (Path(__file__).resolve().parents[2] / "docs" / "draft-sources.md").read_text()
    code = re.search(r"```python\n(.*?)\n```", text, re.S).group(1)
    space: dict = {}
    try:
        exec(code, space)  # noqa: S102 - the documented example, as a user runs it
        out, spec, prompt = space["out"], space["spec"], space["prompt"]
        plain = space["speculator"].generate(prompt, chat=False, max_new_tokens=32)
        assert out.token_ids == plain.token_ids and out.stats.sources["phrases"][0] > 0, out.stats.sources
        ids = encode_prompt(default_model.tokenizer, prompt, False)
        lm, batcher = build_batcher(SpecConfig(method="phrases"), quiet=True, thread=True)
        try:
            [served] = run_jobs(batcher, [(ids, SamplingParams(max_new_tokens=32))])
        finally:
            batcher.close()
        assert served == plain.token_ids and batcher.stats().source_rows.get("phrases", 0) > 0
        config = measure.Config("phrases", "phrases", 8, False, spec.engine)
        none = space["speculator"].engine
        runs = measure.acceptance([config], none, [ids], SamplingParams(max_new_tokens=32), repeats=1)
        [row] = runs["phrases"]["samples"]
        assert row["equal"] and row["proposed"] > 0, row
    finally:
        TABLE.pop("phrases", None)
