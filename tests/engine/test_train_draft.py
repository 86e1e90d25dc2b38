"""specdec train draft, end to end on a tiny random target that uses the default model's
tokenizer: collect (resumable shards), train (resumable checkpoint), and the result loads
as a --draft with its vocabulary subset, and speculative greedy output equals plain."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.cli import main


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, default_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=default_model.model.vocab_size, hidden_size=48, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=default_model.eos_ids[0])
    LlamaForCausalLM(cfg).save_pretrained(d)
    default_model.tokenizer.save_pretrained(d)
    return d


@pytest.mark.default_model
def test_train_draft_end_to_end(tiny_target, tmp_path, capsys):
    out = tmp_path / "draft"
    args = ["train", "draft", "--model", str(tiny_target), "--out", str(out), "--chat-prompts", "4",
            "--chat-batch", "2", "--max-new-tokens", "6", "--text-windows", "4", "--steps", "3", "--batch-rows", "2",
            "--seq-len", "64", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--intermediate-size", "64", "--head-vocab", "512", "--quiet"]
    assert main(args) == 0
    shards = sorted((out / "data").glob("shard_*.pt"))
    assert len(shards) == 2  # one chat shard, one text shard
    meta = json.loads((out / "specdec_draft.json").read_text())
    assert len(meta["vocab_subset"]) == 512 and meta["train"]["steps"] == 3
    # resumable: a second run reuses the shards and the finished checkpoint
    mtimes = [p.stat().st_mtime for p in shards]
    assert main(args) == 0
    assert [p.stat().st_mtime for p in shards] == mtimes
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 3

    # the draft is usable: loads with its subset, and greedy speculation equals plain decoding
    from specdec.engine import Engine
    from specdec.methods import draft_source
    from specdec.models.loader import load_model
    from specdec.types import SamplingParams

    target = load_model(str(tiny_target), quiet=True)
    draft = load_model(str(out), quiet=True)
    drafter = draft_source(target, draft)
    assert drafter.subset is not None and drafter.subset.numel() == 512
    prompt = target.tokenizer.encode("def add(a, b):\n    return")
    params = SamplingParams(max_new_tokens=12)
    plain = Engine(target.model, eos_ids=()).generate([prompt], params)[0].tokens
    spec = Engine(target.model, drafter, k=3, eos_ids=(), fixed_k=True).generate([prompt], params)[0]
    assert spec.tokens == plain and spec.stats.proposed > 0


def test_train_needs_what(capsys):
    assert main(["train"]) == 2
    assert "specdec train draft" in capsys.readouterr().err


@pytest.mark.default_model
def test_self_written_prompts(default_model):
    """--self-prompts: the target writes user turns from its own chat template (sampled; the same
    seed gives the same turns); they are plain text, and turns that do not end in time are dropped."""
    from specdec.train.distill import CollectConfig, _self_prompts

    cfg = CollectConfig(self_prompt_tokens=48)
    a = _self_prompts(default_model, 6, cfg, torch.Generator().manual_seed(3))
    b = _self_prompts(default_model, 6, cfg, torch.Generator().manual_seed(3))
    assert a == b and 1 <= len(a) <= 6
    for text in a:
        assert text and "<|im_start|>" not in text and "<|im_end|>" not in text
        assert len(default_model.tokenizer.encode(text)) <= 48
    assert _self_prompts(default_model, 4, CollectConfig(self_prompt_tokens=2), torch.Generator().manual_seed(3)) == []


@pytest.mark.default_model
def test_collect_self_prompts_shards_resume(tiny_target, tmp_path):
    """Self-prompt shards are written (empty when no turn ended in time) and skipped on a rerun."""
    from specdec.models.loader import load_model
    from specdec.train.distill import CollectConfig, collect

    target = load_model(str(tiny_target), quiet=True)
    cfg = CollectConfig(chat_prompts=0, text_windows=0, self_prompts=3, chat_batch=2, shard_rows=2,
                        self_prompt_tokens=4, max_new_tokens=4)
    data = collect(target, tmp_path, cfg, quiet=True)
    shards = sorted(data.glob("shard_m*.pt"))
    assert [p.name for p in shards] == ["shard_m0000.pt", "shard_m0001.pt"]
    mtimes = [p.stat().st_mtime_ns for p in shards]
    collect(target, tmp_path, cfg, quiet=True)
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    assert not list(data.glob("shard_0*.pt"))  # no text windows were asked for


@pytest.mark.default_model
def test_train_draft_init_fine_tunes_an_existing_draft(tiny_target, tmp_path, capsys):
    """--init DIR starts from that draft's weights and shape: at learning rate 0 the fine-tuned draft
    is the same model, weight for weight (a fresh student would not be); the shape flags give way to
    the init's; a folder that is no draft is refused before anything is collected."""
    from safetensors.torch import load_file

    base = tmp_path / "base"
    common = ["--model", str(tiny_target), "--chat-prompts", "4", "--chat-batch", "2", "--max-new-tokens", "6",
              "--text-windows", "4", "--batch-rows", "2", "--seq-len", "64", "--quiet"]
    assert main(["train", "draft", "--out", str(base), *common, "--steps", "3", "--hidden-size", "32", "--layers", "1",
                 "--heads", "2", "--kv-heads", "1", "--intermediate-size", "64", "--head-vocab", "512"]) == 0
    tuned = tmp_path / "tuned"
    assert main(["train", "draft", "--out", str(tuned), *common, "--code-prompts", "2", "--steps", "2", "--lr", "0",
                 "--init", str(base)]) == 0  # (default shape flags: 256 wide, 4 layers; the init's win)
    a, b = load_file(str(base / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((tuned / "specdec_draft.json").read_text())
    assert meta["student"]["hidden_size"] == 32 and meta["init"]["path"] == str(base)
    assert meta["init"]["train"]["steps"] == 3 and meta["train"]["steps"] == 2
    assert (tuned / "data" / "shard_c0000.pt").is_file()  # its own data, code completions included

    (tmp_path / "nodraft").mkdir()
    capsys.readouterr()
    assert main(["train", "draft", "--out", str(tmp_path / "x"), *common, "--init", str(tmp_path / "nodraft")]) == 2
    assert "not a draft folder" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_code_completion_prompts_passes_and_body_lines():
    """Code prompts: a function's signature and docstring from the standard library, one module per
    pass (more prompts than modules come from later passes, none repeated from the same place);
    body_lines keeps the same functions in the same order, each prompt extended by the first lines
    of its own body (a prefix of the function's source), and leaves the default prompts alone."""
    import ast

    from specdec.train import corpus

    first = corpus.code_completion_prompts(3, 40)
    assert len(first) == 40 and all(p.lstrip().startswith(("def ", "async def ")) for p in first)
    assert all(ast.get_docstring(ast.parse(p).body[0]) for p in first)  # valid code: a def and its docstring
    more = corpus.code_completion_prompts(3, 600)
    assert more[:40] == first and len(more) == 600  # later passes extend the first one
    one_pass = corpus.code_completion_prompts(3, 10**6, per_file=1)
    assert len(one_pass) < 600 and more[: len(one_pass)] == one_pass  # one pass alone has fewer: the first ones
    with_body = corpus.code_completion_prompts(3, 40, body_lines=8)
    assert len(with_body) == 40
    assert all(b.startswith(a.rstrip("\n")) for a, b in zip(first, with_body))
    assert sum(len(b) > len(a) for a, b in zip(first, with_body)) >= 20  # most prompts got body lines
    assert corpus.code_completion_prompts(3, 40) == first  # deterministic, default unchanged
