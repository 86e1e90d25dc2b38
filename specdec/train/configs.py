"""The settings of `specdec train` (collect, student, draft, EAGLE and Medusa training) as
dataclasses, apart from the training code so that the CLI can read their defaults for `--help`
without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CollectConfig:
    chat_prompts: int = 1024
    chat_batch: int = 16
    max_new_tokens: int = 192
    text_windows: int = 1024
    text_batch: int = 8
    seq_len: int = 256
    topk: int = 16
    shard_rows: int = 64
    seed: int = 0
    generic_prompts: int = 0  # open-ended chat prompts (everyday topics), answered by the target
    code_prompts: int = 0  # raw code completions of standard-library signatures + docstrings
    code_body_lines: int = 0  # and up to this many lines of each function's body (corpus.code_completion_prompts)
    self_prompts: int = 0  # user turns the target writes itself (chat template only), then answers
    self_prompt_tokens: int = 96  # longest self-written user turn


@dataclass
class StudentConfig:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    max_position: int = 2048
    head_vocab: int = 8192


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_rows: int = 16
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.0
    save_every: int = 100
    seed: int = 0


@dataclass
class EagleTrainConfig:
    steps: int = 900
    batch_rows: int = 16
    seq_len: int = 256
    lr: float = 3e-3  # with cls_weight 1.0: 53% one-step top-1 where 1e-3 / 0.1 (EAGLE's paper) gave 34%
    warmup: int = 30
    cls_weight: float = 1.0
    noise: float = 0.1
    head_vocab: int = 8192
    max_rows: int = 0  # 0 = every data row
    save_every: int = 50
    seed: int = 0
    unroll: int = 1  # training-time test: drafting steps trained on the head's own predictions
    unroll_decay: float = 0.8
    init: str | None = None  # an EAGLE head folder to start from (same target)
    bf16: bool | None = None  # bfloat16 autocast for the matrix products; None: where the CPU has bf16 units


@dataclass
class MedusaTrainConfig:
    num_heads: int = 4
    steps: int = 400
    batch_rows: int = 16
    seq_len: int = 64  # positions per row and step (x heads x subset: the soft labels' memory)
    lr: float = 1e-3
    warmup: int = 20
    head_vocab: int = 8192
    tree_nodes: int = 16
    topk: int = 4
    max_rows: int = 0
    save_every: int = 50
    seed: int = 0
