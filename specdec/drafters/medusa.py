"""Medusa heads (Cai et al. 2024): a few heads that each guess one token further ahead.

Head i (1..H) maps the target's final feature f_t at the last scored position to a guess of
x_{t+1+i}: a residual block f + SiLU(W_i f + b_i) followed by the target's own LM head
(restricted to a frequency-ranked vocabulary subset; exact, q is 0 elsewhere). The token
x_{t+1} itself is the target's (the pending token), so the heads draft the tokens after it.
One pass over the heads per step, no autoregression.

The candidates form a *static tree* chosen from measured per-head top-k accuracies
(`choose_tree`): a node is a tuple of ranks (r_1, .., r_d) meaning "head 1's r_1-th guess,
then head 2's r_2-th guess, ..."; assuming heads are right independently, the node is on
the accepted path with probability prod_i acc_i(r_i), and the expected number of accepted
tokens is the sum of those probabilities over the tree. Greedily keeping the N most
probable tuples maximises it (a tuple is never more probable than its prefix, so the set is
a tree). Candidates are deterministic (q one-hot), exact under tree verification; with
`tree=False` the heads' top-1 guesses form a chain.

Files: `medusa.safetensors` and `specdec_medusa.json` (target, hidden size, vocabulary, a
hash of the target's head, the subset, the accuracies and the tree).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.kernel_glue import rowstable_drafting
from ..models.llama import step_call
from ..tree import best_nodes
from ..types import SamplingParams, SpecdecError
from .base import Draft, DraftContext, Drafter, fastest
from .heads import load_head, subset_head

MEDUSA_META = "specdec_medusa.json"
MEDUSA_WEIGHTS = "medusa.safetensors"
DEFAULT_MEDUSA_DIR = Path(__file__).resolve().parents[1] / "assets" / "medusa" / "smollm2-135m-instruct"


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.hidden, self.num_heads = hidden, num_heads
        self.proj = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_heads))
        for p in self.proj:  # start as the identity block: every head begins as "the target's next token"
            nn.init.zeros_(p.weight)
            nn.init.zeros_(p.bias)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """f [..., D] -> per-head features [..., H, D]."""
        return torch.stack([f + F.silu(p(f)) for p in self.proj], dim=-2)


def choose_tree(acc: list[list[float]], nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` most probable rank tuples given acc[head][rank] (see the module docstring),
    in an order where every prefix comes before its extensions."""
    import heapq

    H = len(acc)
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < nodes:
        negp, t = heapq.heappop(heap)
        out.append(t)
        if len(t) < H:
            for r in range(len(acc[len(t)])):
                heapq.heappush(heap, (negp * acc[len(t)][r], t + (r,)))
    out.sort(key=lambda t: (len(t), t))
    return out


def is_medusa_dir(path) -> bool:
    return path is not None and (Path(path) / MEDUSA_META).is_file()


def default_medusa_for(target) -> Path | None:
    if getattr(target, "source", None) == "default" and is_medusa_dir(DEFAULT_MEDUSA_DIR):
        return DEFAULT_MEDUSA_DIR
    return None


def save_medusa(heads: MedusaHeads, out: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in heads.state_dict().items()}, str(out / MEDUSA_WEIGHTS))
    (out / MEDUSA_META).write_text(json.dumps({**meta, "hidden": heads.hidden, "num_heads": heads.num_heads}, indent=1))


def load_medusa(path, target) -> tuple[MedusaHeads, dict]:
    """Load heads and check that they were trained for this target."""
    return load_head(path, target, MEDUSA_META, MEDUSA_WEIGHTS, lambda m: MedusaHeads(m["hidden"], m["num_heads"]),
                     lambda m: m["hidden"], "a Medusa heads", "specdec train medusa")


class MedusaDrafter(Drafter):
    name = "medusa"
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, target_model, vocab_subset=None, tree: list[tuple[int, ...]] | None = None,
                 saved=None) -> None:
        """saved: a folder where the Q8_0 copy of the subset head is kept between runs
        (loader.drafter_copies_dir; None: made at every start)."""
        self.heads = heads
        self.subset, self.W = subset_head(target_model, vocab_subset)
        # the subset head on the row-stable kernels where the target's steps run on them (over a
        # Q8_0 copy on 8-bit activations where the target reads GGUF blocks): the default model's
        # 8192 rows for 4 heads in ~0.22 ms of one thread; a drafted step's planning took a median
        # 1.8 ms at 2 threads against 2.8 as a float32 matmul (dev script, 15 prompts)
        self.W_rs = rowstable_drafting((), self.W, target_model, saved)
        self.tree = tree  # rank tuples (static tree) or None for a chain of top-1 guesses
        self.max_nodes = len(tree) if tree else 0
        self.topk = 1 + max((max(t) for t in tree), default=0) if tree else 1
        if tree:
            index = {t: i + 1 for i, t in enumerate(tree)}
            self.parents = [index.get(t[:-1], 0) if len(t) > 1 else 0 for t in tree]
            if any(len(t) > 1 and t[:-1] not in index for t in tree):
                raise SpecdecError("a Medusa tree must contain every prefix of its nodes")
        self.last: list[torch.Tensor | None] = []

    def begin(self, prompts, params, max_len) -> None:
        if self.tree and len(self.tree) + 2 >= max_len:
            raise SpecdecError(f"a Medusa tree of {len(self.tree)} nodes does not fit in a context of {max_len}")
        self.last = [None] * len(prompts)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        B = len(ctx.tokens)
        if max_tokens <= 0:
            return Draft.empty(B)
        for b in range(B):
            if ctx.hidden is not None and ctx.hidden[b] is not None and len(ctx.hidden[b]):
                self.last[b] = ctx.hidden[b][-1]
        if any(x is None for x in self.last):
            raise RuntimeError("Medusa drafter is missing target features (the engine did not pass hidden states)")
        f = torch.stack(self.last)  # [B, D]: the feature of the last scored token
        H = min(self.heads.num_heads, max_tokens)
        hf = self.heads(f)[:, :H]  # [B, H, D]
        if self.W_rs is not None and step_call(hf):
            logits = self.W_rs[0](hf.reshape(B * H, -1).contiguous(), *self.W_rs[1:]).reshape(B, H, -1)
        else:
            logits = hf.float() @ self.W.float().T  # [B, H, S]
        top = logits.topk(self.topk, dim=-1)  # [B, H, topk]
        ids = self.subset[top.indices] if self.subset is not None else top.indices
        if not self.tree:
            return Draft(ids[:, :, 0], torch.full((B,), H, dtype=torch.long))
        nodes = [t for t in self.tree if len(t) <= H]
        toks = torch.stack([ids[:, len(t) - 1, t[-1]] for t in nodes], 1)  # [B, N]
        parents = torch.tensor(self.parents[: len(nodes)], dtype=torch.long)[None].expand(B, -1).clone()
        if len(nodes) <= max_tokens:
            return Draft(toks, torch.full((B,), len(nodes), dtype=torch.long), None, parents)
        # a node budget below the tree: each row keeps its likeliest nodes, by the heads' own
        # probabilities along each node's path (a child is never likelier than its parent)
        lp = torch.log_softmax(logits, -1).gather(2, top.indices)  # [B, H, topk]
        rows = []
        for b in range(B):
            path = [float(sum(lp[b, i, r] for i, r in enumerate(t))) for t in nodes]
            kept = best_nodes(toks[b].tolist(), parents[b].tolist(), path, max_tokens)
            rows.append(kept[:2])
        return Draft(torch.tensor([t for t, _ in rows], dtype=torch.long),
                     torch.full((B,), max_tokens, dtype=torch.long), None,
                     torch.tensor([p for _, p in rows], dtype=torch.long))

    def commit(self, num_accepted, paths=None) -> None:
        pass

    def skip(self) -> None:
        pass  # a step without drafting: the next proposal reads the newest feature it is handed

    @torch.inference_mode()
    def time_alone(self) -> tuple[float, float]:
        """(seconds per proposal of the whole tree, 0: the heads read only the newest feature, so
        nothing is ever caught up on), the fastest of a few proposals on a zero feature after a
        warm-up (a first call pays one-off costs: the weights' pages, buffers). Unpriced, a fresh
        engine's first probe was priced as free; each cost ~2 plain steps. The rows' features
        stay as they were."""
        saved = self.last
        dim = self.W.shape[1]
        try:
            self.last = [torch.zeros(dim, dtype=next(self.heads.parameters()).dtype)]
            ctx = DraftContext([[0]], SamplingParams(), None)
            return fastest(lambda: self.propose(ctx, self.max_nodes or self.heads.num_heads)), 0.0
        finally:
            self.last = saved

    def keep_rows(self, rows) -> None:
        self.last = [self.last[r] for r in rows]

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        self.last.append(None)  # its feature comes with the next proposal
