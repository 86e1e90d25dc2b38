"""lm-evaluation-harness (`lm-eval`, model type `local-completions`) against a real `specdec serve`
process, as users point it at OpenAI-compatible servers: a tiny multiple-choice task and a
log-likelihood task built here from a local JSONL (nothing downloaded), requests sent as token
ids with `echo` and `logprobs`. Every log-likelihood lm-eval reports equals the one computed
directly from the model's logits (log-softmax of one plain forward over the same tokens), and
its greedy flag equals the argmax check, with the server's speculation on (`--method auto`, the
default) and off (`--method none`); sequential and concurrent clients, one prompt and several per
request. Scoring requests (max_tokens 1) never speculate, so a small greedy generation task rides
along: its answers equal plain greedy decoding and, with auto, the drafters proposed tokens. Skipped when lm_eval is not installed (`pip install -e .[dev]`)."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request

import pytest
import torch

from server_helpers import SERVE, free_port, wait_health

pytestmark = pytest.mark.default_model

TOL = 2e-3

MC_DOCS = [  # multiple choice: one request per choice
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "a banana"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["seven", "four", "the moon"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["cold", "loud", "green"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a * b", " print"], "answer": 0},
]
LL_DOCS = [  # plain log-likelihood of a continuation (lm-eval's acc here is the greedy flag)
    {"context": "The quick brown fox jumps over the lazy", "continuation": " dog"},
    {"context": "1, 2, 3, 4, 5,", "continuation": " 6, 7, 8"},
    {"context": "Once upon a time, there was a", "continuation": " little girl who lived in a village"},
]
GEN_DOCS = [  # greedy generation: lm-eval's other request type, long enough for the drafters to speculate
    {"prompt": "def fibonacci(n):\n", "answer": ""},
    {"prompt": "The days of the week are Monday, Tuesday,", "answer": ""},
]
GEN_TOKENS = 24


def _write_tasks(d) -> None:
    (d / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN_DOCS))
    (d / "specdec_gen.yaml").write_text(f"""task: specdec_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n\\n"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC_DOCS))
    (d / "ll.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LL_DOCS))
    (d / "specdec_mc.yaml").write_text(f"""task: specdec_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
""")
    (d / "specdec_ll.yaml").write_text(f"""task: specdec_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "ll.jsonl"}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")


def _score(lm, ctx: list[int], cont: list[int], shift: int = 0) -> tuple[float, bool, float]:
    """Direct log P(cont | ctx) from the target decoding the tokens one per forward (plain decoding's
    numbers, which the server's prefill in exact chunks shares: specdec/prefix_cache.py), whether
    every continuation token is the argmax, and the smallest top-1/top-2 gap among them (ties make
    the flag moot). shift != 0 scores the wrong tokens (a broken server's answer) for the self-check."""
    ids = ctx + cont
    cache = lm.model.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        logits = torch.cat([lm.model(torch.tensor([[tok]]), torch.tensor([[t]]), cache)[0][0]
                            for t, tok in enumerate(ids)])
    lp = torch.log_softmax(logits.double(), -1)
    pos = torch.arange(len(ctx) - 1, len(ids) - 1) + shift
    pos = pos.clamp(0, len(ids) - 1)
    rows = lp[pos]
    tok = torch.tensor(cont)
    top2 = rows.topk(2, -1).values
    return (rows[torch.arange(len(cont)), tok].sum().item(), bool((rows.argmax(-1) == tok).all()),
            (top2[:, 0] - top2[:, 1]).min().item())


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory, default_model):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    _write_tasks(d)
    default_model.tokenizer.save_pretrained(d / "tokenizer")  # lm-eval tokenizes locally: no hub
    return d


@pytest.mark.parametrize("method,batch_size,concurrent", [("auto", 1, 2), ("none", 2, 1)])
def test_lm_eval_loglikelihoods_equal_the_models(default_model, tasks_dir, monkeypatch, method, batch_size,
                                                   concurrent):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install -e .[dev])")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    import datasets.config
    import huggingface_hub.constants
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from specdec.engine import Engine
    from specdec.types import SamplingParams

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tasks_dir / "hf_datasets_cache"))

    # what lm-eval sends and gets back, and the instance it builds (for its own tokenization)
    sent, seen = [], {}
    orig = LocalCompletionsAPI._create_payload

    def create(self, messages, *a, **kw):  # both call paths (sequential and concurrent) build bodies here
        seen["lm"] = self
        body = orig(self, messages, *a, **kw)
        sent.append(body)
        return body
    monkeypatch.setattr(LocalCompletionsAPI, "_create_payload", create)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--method", method], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_health(url, proc)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            model_name = json.loads(r.read())["data"][0]["id"]
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": url + "/v1/completions", "model": model_name, "tokenizer_backend": "huggingface",
                        "tokenizer": str(tasks_dir / "tokenizer"), "tokenized_requests": True,
                        "batch_size": batch_size, "num_concurrent": concurrent, "max_retries": 1, "timeout": 60},
            tasks=["specdec_mc", "specdec_ll", "specdec_gen"], task_manager=TaskManager(include_path=str(tasks_dir)),
            log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
            fewshot_random_seed=0)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as m:
            metrics = m.read().decode()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert out is not None
    lm = seen["lm"]
    # lm-eval's requests as lm-eval sends them: token ids (lists of token-id lists when batched),
    # echo with logprobs 1 and max_tokens 1
    gen = [b for b in sent if "echo" not in b]
    sent = [b for b in sent if "echo" in b]
    assert sent and all(b["echo"] is True and b["logprobs"] == 1 and b["max_tokens"] == 1 for b in sent)
    prompts = [p for b in sent for p in b["prompt"]]
    assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts)
    if batch_size > 1:
        assert any(len(b["prompt"]) > 1 for b in sent)  # several prompts in one request

    off = {1: [], -1: []}
    checked, sent_set = 0, {tuple(p) for p in prompts}
    for task, ndocs in (("specdec_mc", len(MC_DOCS)), ("specdec_ll", len(LL_DOCS))):
        samples = out["samples"][task]
        assert len(samples) == ndocs
        for s in samples:
            assert len(s["arguments"]) == len(s["resps"])
            for (context, continuation), resp in zip(s["arguments"], s["resps"]):
                got_ll, got_greedy = resp[0]
                ctx, cont = lm._encode_pair(context, continuation)
                assert tuple(ctx + cont) in sent_set  # exactly the tokens scored here went to the server
                want_ll, want_greedy, gap = _score(default_model, ctx, cont)
                assert abs(got_ll - want_ll) < TOL, (task, context, continuation, got_ll, want_ll)
                if gap > TOL:
                    assert got_greedy == want_greedy, (task, context, continuation)
                for shift in (1, -1):  # what a server scoring the tokens one position off would have returned
                    off[shift].append(abs(_score(default_model, ctx, cont, shift=shift)[0] - got_ll))
                checked += 1
    assert checked == sum(len(d["choices"]) for d in MC_DOCS) + len(LL_DOCS)
    # the check above catches a broken score: shifted scores fail it on (nearly) every request
    for shift, diffs in off.items():
        assert sum(d > TOL for d in diffs) >= len(diffs) - 1, (shift, diffs)
    # the task's accuracy follows from those scores: the model knows these easy answers
    assert out["results"]["specdec_mc"]["acc,none"] >= 0.5
    # greedy generations through lm-eval equal plain greedy decoding of the ids it sent
    gen_prompts = [p for b in gen for p in b["prompt"]]
    assert len(gen_prompts) == len(GEN_DOCS) and all(b["temperature"] == 0 for b in gen)
    for s in out["samples"]["specdec_gen"]:
        ids = lm.tok_encode(s["arguments"][0][0])
        assert ids in gen_prompts
        [r] = Engine(default_model.model, None, eos_ids=default_model.eos_ids).generate(
            [ids], SamplingParams(max_new_tokens=GEN_TOKENS))
        want = default_model.tokenizer.decode(r.tokens, skip_special_tokens=True).split("\n\n\n")[0]
        assert want.strip() and s["resps"][0][0] == want, (s["resps"][0][0], want)
    counters = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line and not line.startswith("#") and "{" not in line}
    assert counters["specdec_requests_failed_total"] == 0
    if method == "auto":  # the drafters were at work on the generations (scoring requests never speculate)
        assert counters["specdec_draft_tokens_proposed_total"] > 0, counters
    else:
        assert counters["specdec_draft_tokens_proposed_total"] == 0, counters
