"""EAGLE drafting head (Li et al. 2024, EAGLE; EAGLE-2's dynamic tree).

The head is one decoder layer that runs over the target's *feature* sequence: at position
t it reads fc([embed(x_{t+1}); f_t]), where f_t is the target's final (normed) hidden
state at t and x_{t+1} the token that actually followed, and predicts f_{t+1}; the target's
own LM head (restricted to a frequency-ranked vocabulary subset, still exact: q is 0
elsewhere) turns that prediction into a distribution over x_{t+2}. Drafting continues on
the head's own predicted features.

Proposals are either a chain (k steps, argmax or sampled with the head's q) or, with
`tree=True`, an EAGLE-2 style dynamic tree: at each of `depth` steps the `width` frontier
nodes with the highest cumulative draft log-probability are expanded by their `width` best
tokens, and finally the `nodes` best nodes overall (an ancestor-closed set, since scores
only fall along a path) are sent for verification as deterministic candidates (q one-hot,
exact with tree verification in both greedy and sampling modes).

The engine supplies the target's features of newly committed positions (DraftContext.hidden,
since this drafter sets `needs_hidden`). The head keeps its own small KV cache: committed
pairs stay, speculative positions are dropped after each step. A row more than
`CATCH_UP_WINDOW` pairs behind (a prompt, or steps the cost model declined the head) starts its
cache again at the window's first pair: a probe of the head that read a long backlog took 4-6
plain steps of the default model, ~2.5 with the window (its read ~0.2); the head then attends over
the window and what follows it (positions stay the text's; the cache's slots start at the window,
`self.base`).

Where the target's decoding steps run on the row-stable kernels (specdec/kernels), the head drafts
on them too (`rowstable_drafting`): its projections and subset head over Q8_0 copies where the
target reads GGUF blocks, over fp32 weights otherwise; and its short steps (the tree's expansions,
a step's catch-up) take the kernels' norms and fused rotation + cache write + attention
(`rope_attend`, with the tree's visibility as an additive mask) instead of a dozen torch ops and
SDPA (`_kernel_step`): its drafting only, so exactness is untouched.

Files: `eagle.safetensors` (fc, layer; the target's embedding and head are not stored) and
`specdec_eagle.json` (target name, hidden size, vocabulary size, a hash of the target's
head weights, the vocabulary subset, the recipe). A head trained for another target is
refused with a clear message.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.llama import (ATTEND_HEAD_SIZES, ATTEND_MAX_T, BLOCK_MAX_ROWS, Linear, additive_mask,
                             mkldnn_packing_available, packed_linear, step_call)
from ..kv_cache import keep_in_place, with_room
from .. import tree as tree_mod
from ..models.kernel_glue import pack_drafting_head, rowstable_drafting
from ..policy import PROBE_EVERY, NodeOdds, best_prefix
from ..sampling import draw
from ..types import SamplingParams, SpecdecError
from .base import Draft, DraftContext, Drafter, steady
from .heads import load_head, subset_head, target_fingerprint  # noqa: F401  (target_fingerprint: used by train/)

EAGLE_META = "specdec_eagle.json"
EAGLE_WEIGHTS = "eagle.safetensors"


DEFAULT_EAGLE_DIR = Path(__file__).resolve().parents[1] / "assets" / "eagle" / "smollm2-135m-instruct"


def default_eagle_for(target) -> Path | None:
    """The head shipped for the embedded default target, if this is that target."""
    if getattr(target, "source", None) == "default" and is_eagle_dir(DEFAULT_EAGLE_DIR):
        return DEFAULT_EAGLE_DIR
    return None


class EagleHead(nn.Module):
    """fc + one Llama decoder layer over [embedding; feature] pairs."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 rope_theta: float = 10000.0, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.intermediate, self.rope_theta, self.eps = intermediate, rope_theta, eps
        self.fc = Linear(2 * hidden, hidden, bias=True)
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.wqkv = Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.wo = Linear(heads * head_dim, hidden, bias=False)
        self.w_gate_up = Linear(hidden, 2 * intermediate, bias=False)
        self.w_down = Linear(intermediate, hidden, bias=False)
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._rope_table: torch.Tensor | None = None  # [2, positions, Dh]: cos, signed sin

    def pack(self, dtype: torch.dtype | None = None) -> "EagleHead":
        """oneDNN-prepacked projections for CPU inference (see models.llama.Linear), optionally
        packed in `dtype` (bfloat16: half the bytes per drafting step; drafting quality barely
        moves and exactness does not depend on it)."""
        if mkldnn_packing_available() and self.fc.weight is not None and self.fc.weight.dtype == torch.float32:
            for lin in (self.fc, self.wqkv, self.wo, self.w_gate_up, self.w_down):
                lin.pack(dtype)
        return self

    def config(self) -> dict:
        return dict(hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                    intermediate=self.intermediate, rope_theta=self.rope_theta, eps=self.eps)

    def _cos_sin(self, positions):
        """cos and signed sin [B, T, 1, Dh] for the roll form of rotary embeddings (as the
        target's); on the CPU from a table grown on demand: drafting rotates at every step,
        and a lookup is a few ops where recomputing is a dozen."""
        if positions.device.type != "cpu":  # (training on a GPU: no table, no host sync)
            freqs = positions[..., None].float() * self.inv_freq  # [B, T, Dh/2]
            cos, sin = freqs.cos(), freqs.sin()
            return torch.cat((cos, cos), -1)[:, :, None], torch.cat((-sin, sin), -1)[:, :, None]
        need = int(positions.max()) + 1
        tab = self._rope_table
        if tab is None or tab.shape[1] < need:
            n = max(need, 2 * (tab.shape[1] if tab is not None else 1024))
            freqs = torch.arange(n).float()[:, None] * self.inv_freq.cpu()[None]  # [n, Dh/2]
            cos, sin = freqs.cos(), freqs.sin()
            tab = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)))  # [2, n, Dh]
            self._rope_table = tab
        cs = tab[:, positions]  # [2, B, T, Dh]
        return cs[0, :, :, None], cs[1, :, :, None]

    def qkv(self, emb, feat, positions):
        """-> (x [B,T,D] residual stream, q [B,H,T,Dh], k, v [B,Hkv,T,Dh])."""
        B, T, _ = emb.shape
        H, Hkv, Dh = self.heads, self.kv_heads, self.head_dim
        x = self.fc(torch.cat((emb, feat), dim=-1))
        h = F.rms_norm(x, (self.hidden,), self.attn_norm, self.eps)
        qkv = self.wqkv(h).view(B, T, H + 2 * Hkv, Dh)
        cos, sin = self._cos_sin(positions)
        qk = qkv[:, :, : H + Hkv]  # queries and keys rotate together
        # rotate_half(x) * sin == roll(x, Dh/2) * (sin with its first half negated): same bits
        qk = (qk * cos + qk.roll(Dh // 2, dims=-1) * sin).transpose(1, 2)
        return x, qk[:, :H], qk[:, H:], qkv[:, :, H + Hkv :].transpose(1, 2)

    def finish(self, x, q, keys, vals, mask=None, causal=False):
        B, _, T, _ = q.shape
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, is_causal=causal,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
        h = F.rms_norm(x, (self.hidden,), self.mlp_norm, self.eps)
        gate, up = self.w_gate_up(h).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)

    def forward(self, emb, feat, positions):
        """Training: whole sequences, causal. emb = embed(x_{1..T}), feat = f_{0..T-1} -> f^_{1..T}."""
        x, q, k, v = self.qkv(emb, feat, positions)
        return self.finish(x, q, k, v, causal=True)


def kernel_steps(head: EagleHead, target_model=None):
    """The kernels a head's short drafting steps may run through (EagleDrafter._kernel_step), or
    None: the row-stable kernels (torch.ops.specdec_rs) where `rowstable_drafting` put every
    projection of the head's layer on them (no biases in the layer), and only for shapes the
    kernels' norms and attention take."""
    lins = (head.wqkv, head.wo, head.w_gate_up, head.w_down)
    if head.heads % head.kv_heads:
        return None
    rs = getattr(target_model, "rowstable", None)
    if (rs is not None and all(lin.rs is rs and lin.bias is None for lin in lins) and head.hidden % 8 == 0
            and head.head_dim in ATTEND_HEAD_SIZES):
        return rs
    return None


def head_from_target(cfg) -> EagleHead:
    """An EAGLE head shaped like one layer of the target (native LlamaConfig)."""
    return EagleHead(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                     cfg.rope_theta, cfg.rms_norm_eps)


def save_eagle(head: EagleHead, out: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(out / EAGLE_WEIGHTS))
    (out / EAGLE_META).write_text(json.dumps({**meta, "config": head.config()}, indent=1))


def is_eagle_dir(path) -> bool:
    return path is not None and (Path(path) / EAGLE_META).is_file()


def load_eagle(path, target) -> tuple[EagleHead, dict]:
    """Load a head and check that it was trained for this target."""
    return load_head(path, target, EAGLE_META, EAGLE_WEIGHTS, lambda m: EagleHead(**m["config"]),
                     lambda m: m["config"]["hidden"], "an EAGLE head", "specdec train eagle")


class EagleDrafter(Drafter):
    """Chain or dynamic-tree drafting with an EagleHead (see the module docstring).

    A drafted tree is cut to the nodes worth verifying (`trim`): each node has a path probability,
    the drafter learns how often nodes of that probability are accepted (`policy.NodeOdds`), and
    keeps the best nodes for as long as one more raises the expected committed tokens per unit of
    step time, (1 + sum of kept odds) / (1 + c + r * kept), c the head's drafting time and r a
    verified node's cost in plain steps, as the scheduler's cost model prices them
    (`DraftContext.draft_cost`, `guess_cost`). A confident head keeps its whole tree, an unsure one
    a node or two, or none; every PROBE_EVERY-th tree is verified whole, so that the odds of the
    nodes a cut drops stay measured."""

    name = "eagle"
    needs_hidden = True
    partial_rows = True  # the tree's expansions run for the rows that take it only

    def __init__(self, head: EagleHead, target_model, vocab_subset=None, tree: bool = True, depth: int = 5,
                 width: int = 4, nodes: int = 24, trim: bool = True, saved=None) -> None:
        """saved: a folder where the Q8_0 copies of the head's weights are kept between runs
        (loader.drafter_copies_dir; None: made at every start)."""
        if depth < 1 or width < 1 or nodes < 1:
            raise SpecdecError(f"EAGLE tree settings must be >= 1 (depth {depth}, width {width}, nodes {nodes})")
        self.head = head
        self.target = target_model
        self.samples_guesses = not tree  # a chain samples from the head's q; trees are deterministic
        # the target's token embedding, looked up row by row: a GGUF target's reads the file's
        # rows asked for (no float table of the whole vocabulary, ~4 bytes a weight)
        self.embed = target_model.embed
        self.dim, self.dtype = target_model.embed.embedding_dim, target_model.dtype
        self.subset, self.W = subset_head(target_model, vocab_subset)  # W [S, D]
        h = head
        lins = (h.fc, h.wqkv, h.wo, h.w_gate_up, h.w_down)
        # the row-stable kernels, where the target's steps run on them
        self.W_rs = rowstable_drafting(lins, self.W, target_model, saved)
        self.W_packed, self.pack_dtype = pack_drafting_head(self.W)  # the head's layer packs alike
        self.kops = kernel_steps(head, target_model)
        if self.W_packed is not None:
            head.pack(self.pack_dtype)
        self.vocab_size = target_model.vocab_size
        self.tree, self.depth, self.width, self.nodes = tree, depth, width, nodes
        self.max_nodes = nodes if tree else 0
        self.trim = trim and tree
        self.odds = NodeOdds()  # P(a tree node is accepted | the head's path probability), learnt
        self.last_scores: list[list[float]] = []  # the last tree's path log-probabilities (per drafted row, per node)
        self._node_p: dict[int, list[float]] = {}  # per row of the last tree: its nodes' path probabilities
        self._trees = 0  # trees drafted (every PROBE_EVERY-th is verified whole)
        self._timing = (0.0, True)  # (seconds, steady) of the last proposal

    def draft_timing(self) -> tuple[float, bool]:
        return self._timing

    # -- cache ------------------------------------------------------------------------
    def begin(self, prompts, params, max_len) -> None:
        B = len(prompts)
        h = self.head
        if self.tree and self.nodes + 1 >= max_len:
            raise SpecdecError(f"an EAGLE tree of {self.nodes} nodes does not fit in a context of {max_len}")
        size = max_len + max(self.nodes, self.depth) + 2
        # the cache's rows live in stores with room for more (a server's rows join and leave):
        # self.k / self.v are views of the first B rows. A new batch keeps the last one's stores
        # where they fit and were made in the same inference mode (a server's batch starts empty
        # and its rows join one by one: new stores would be copied ~4 times as they grow to 32
        # rows, ~2% of a burst of 32 short requests)
        shape = (h.kv_heads, size, h.head_dim)
        old = getattr(self, "_ks", None)
        if old is not None and old.shape[1:] == shape and old.dtype == self.dtype and old.shape[0] >= B \
                and old.is_inference() == torch.is_inference_mode_enabled():
            self._ks[:B].zero_()
            self._vs[:B].zero_()
        else:
            self._ks = torch.zeros(B, *shape, dtype=self.dtype)
            self._vs = torch.zeros_like(self._ks)
        self.k, self.v = self._ks[:B], self._vs[:B]
        self.n = [0] * B  # committed pairs read per row (pair t sits at slot t - base)
        self.base = [0] * B  # per row: the first pair its cache holds (CATCH_UP_WINDOW)
        self.feat: list[list[torch.Tensor]] = [[] for _ in range(B)]  # known target features, per row
        self.last_h: torch.Tensor | None = None

    def _write(self, k, v, slots, rows=None):
        """k, v [B, Hkv, T, Dh] into per-row slots [B, T] (of cache rows `rows`, default all)."""
        B, T = slots.shape
        idx = (torch.arange(B) if rows is None else rows)[:, None].expand(B, T)
        self.k[idx, :, slots] = k.transpose(1, 2)
        self.v[idx, :, slots] = v.transpose(1, 2)

    def _step(self, tokens, feats, positions, slots, visible, rows=None, causal=False):
        """Run the head on [B, T] new pairs written at `slots`; visible [B, T, S] bool over
        cache slots 0..S-1, or None with causal=True when every row feeds pairs 0..T-1 (a
        prompt: SDPA's causal kernel, several times faster than a dense mask at thousands of
        pairs); rows: which cache rows these are (default all, in order). Returns the head's
        output features [B, T, D]. Short steps of every row at consecutive slots go through the
        kernels where the head's layer is on them (`_kernel_step`)."""
        B, T = tokens.shape
        if (self.kops is not None and rows is None and not causal and T <= ATTEND_MAX_T and B * T <= BLOCK_MAX_ROWS
                and (T == 1 or bool((slots == slots[:, :1] + torch.arange(T)).all()))):
            return self._kernel_step(tokens, feats, positions, slots[:, 0], visible)
        emb = self.embed(tokens)
        x, q, k, v = self.head.qkv(emb, feats, positions)
        if q.dtype != self.k.dtype:  # a bf16 target: the rotary table is fp32 and promotes q, k
            q, k, v = q.to(self.k.dtype), k.to(self.k.dtype), v.to(self.k.dtype)
        self._write(k, v, slots, rows)
        S = tokens.shape[1] if causal else visible.shape[-1]
        keys, vals = (self.k[:, :, :S], self.v[:, :, :S]) if rows is None else (self.k[rows, :, :S], self.v[rows, :, :S])
        if causal:
            return self.head.finish(x, q, keys, vals, causal=True)
        return self.head.finish(x, q, keys, vals, mask=visible[:, None])

    def _kernel_step(self, tokens, feats, positions, start, visible):
        """`_step` through the kernels (`kernel_steps`) for new pairs at the consecutive slots
        start[b] .. start[b] + T - 1 of every cache row: the projections on the kernels, the
        kernels' RMS norms, and one call that rotates q and k, writes k and v to the cache and
        attends over the first S slots with `visible` [B, T, S] as an additive mask in the layout
        the kernel reads ([B, 1, G*T, S], row g*T + t: token t of query head g). The numbers differ
        from `_step`'s torch path by the order of float sums only."""
        h, kops = self.head, self.kops
        S = visible.shape[-1]
        mask = None if bool(visible.all()) else additive_mask(visible, h.heads // h.kv_heads)
        x = h.fc(torch.cat((self.embed(tokens), feats), dim=-1))
        cos, sin = h._cos_sin(positions)
        o = kops.rope_attend(h.wqkv(kops.rms_norm(x, h.attn_norm, h.eps)), cos, sin, self.k, self.v, start, h.heads,
                             S, mask)
        x = x + h.wo(o)
        return x + h.w_down(kops.silu_mul(h.w_gate_up(kops.rms_norm(x, h.mlp_norm, h.eps))))

    def _logits(self, h):
        """[..., D] -> [..., S] scores over the subset (or the full vocabulary)."""
        if self.W_rs is not None and step_call(h):
            return self.W_rs[0](h, *self.W_rs[1:])
        if self.W_packed is not None:
            return packed_linear(h.to(self.pack_dtype), self.W_packed).float()
        return h.float() @ self.W.float().T

    def _ids(self, idx):
        return self.subset[idx] if self.subset is not None else idx

    def remember(self, ctx: DraftContext) -> None:
        """Keep the target features the engine handed over (a wrapping drafter that skips this
        head for a step must still call this: the engine passes each feature once)."""
        if ctx.hidden is None:
            return
        for b, h in enumerate(ctx.hidden):
            if h is not None:
                self.feat[b].extend(h.unbind(0))

    #: a row further behind than this (a prompt just handed over) catches up on its own, so
    #: a long prompt joining a running batch is not padded onto every other row
    CATCH_UP_ALONE = 16
    #: a row further behind than this reads only its last this many pairs, in a cache started
    #: again there (the module docstring); ~28 us a pair on the default model's head. With every
    #: step drafted (17 dev prompts, 96 tokens, `--fixed-k`) the head took 1.645-1.656 tokens a
    #: forward at 32, 1.685 at 64, 1.683-1.695 with no window; fresh engines (method_grid, four
    #: runs each, 2-core Xeon) read eagle 0.97-0.99 and auto at t 0.8 0.98-1.00 of plain decoding
    #: at 32, 0.96-0.98 and 0.96-0.98 at 64: where the head is rarely chosen its catch-up's price
    #: matters more than what it reads
    CATCH_UP_WINDOW = 32

    def _behind(self, tokens: list[list[int]]) -> list[int]:
        """Per row, the committed pairs its next catch-up reads (at most CATCH_UP_WINDOW where
        it is further behind)."""
        return [min(max(len(t) - 1 - n, 0), self.CATCH_UP_WINDOW) for t, n in zip(tokens, self.n)]

    @torch.inference_mode()
    def _catch_up(self, ctx: DraftContext) -> torch.Tensor:
        """Feed every committed (f_t, x_{t+1}) pair not yet in the cache; return the head's
        output at each row's last pair: the predicted feature for the pending token [B, D]."""
        B = len(ctx.tokens)
        self.remember(ctx)
        want = [len(t) - 1 for t in ctx.tokens]  # pairs t = 0 .. len-2 are known
        for b in range(B):
            if len(self.feat[b]) < want[b]:
                raise RuntimeError("EAGLE drafter is missing target features (the engine did not pass hidden states)")
            if want[b] - self.n[b] > self.CATCH_UP_WINDOW:  # the cache starts again at the window
                self.n[b] = self.base[b] = want[b] - self.CATCH_UP_WINDOW
        new = [list(range(self.n[b], want[b])) for b in range(B)]
        h = torch.zeros(B, self.dim, dtype=self.dtype)
        far = [b for b in range(B) if len(new[b]) > self.CATCH_UP_ALONE]
        near = [b for b in range(B) if len(new[b]) <= self.CATCH_UP_ALONE]
        groups = [[b] for b in far] + ([near] if near else [])
        for rows in groups:
            whole = len(rows) == B
            h[rows] = self._feed(ctx, [new[b] for b in rows], [want[b] for b in rows],
                                 None if whole else torch.tensor(rows))
        for b, idx in enumerate(new):
            if not idx:  # nothing new for this row (cannot happen after a step, kept for safety)
                h[b] = self.last_h[b] if self.last_h is not None else h[b]
        self.n = want
        self.last_h = h
        return h  # [B, D]

    def _feed(self, ctx: DraftContext, new: list[list[int]], want: list[int], rows) -> torch.Tensor:
        """One head step over the pairs `new` of cache rows `rows` (None: all rows, in order);
        the output at each row's last new pair [len(new), D]."""
        B, T = len(new), max(max(len(x) for x in new), 1)
        rows_l = list(range(B)) if rows is None else rows.tolist()
        D = self.dim
        toks = torch.zeros(B, T, dtype=torch.long)
        feats = torch.zeros(B, T, D, dtype=self.dtype)
        pos = torch.zeros(B, T, dtype=torch.long)
        slots = torch.zeros(B, T, dtype=torch.long)
        for i, idx in enumerate(new):
            r = rows_l[i]
            base = self.base[r]
            for j, t in enumerate(idx):
                toks[i, j] = ctx.tokens[r][t + 1]
                feats[i, j] = self.feat[r][t]
                pos[i, j], slots[i, j] = t, t - base
            for j in range(len(idx), T):  # padding: garbage written past the committed pairs, never read
                pos[i, j] = want[i] + j
                slots[i, j] = min(want[i] - base + j, self.k.shape[2] - 1)
        S = int(slots.max()) + 1
        if S == T and all(len(idx) == T and idx[0] == self.base[r] for idx, r in zip(new, rows_l)):
            # every row fills its cache's slots 0..T-1: a prompt (or a window)
            out = self._step(toks, feats, pos, slots, None, rows, causal=True)
        else:
            key = torch.arange(S)
            visible = (key[None, None, :] <= slots[:, :, None])  # causal over committed pairs
            out = self._step(toks, feats, pos, slots, visible, rows)
        last = torch.tensor([max(len(idx) - 1, 0) for idx in new])
        return out[torch.arange(B), last]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Draft for the rows `ctx.want` names (default all; the others get no guesses). Every
        row's new pairs still go into the head's cache (one cheap batched step), so a row left out
        has no backlog to catch up when it drafts again; only the tree's expansions run for the
        drafted rows alone. A tree is cut to the nodes worth verifying (`trim`)."""
        t0 = time.perf_counter()
        B = len(ctx.tokens)
        self._node_p = {}
        sel = [b for b in range(B) if ctx.want is None or ctx.want[b]]
        behind = max(self._behind(ctx.tokens), default=0)
        if max_tokens <= 0 or not sel:
            self.remember(ctx)
            self._timing = (0.0, True)
            return Draft.empty(B)
        h = self._catch_up(ctx)
        sub = None if len(sel) == B else sel
        if sub is not None:
            h = h[sub]
        if self.tree:
            trim = self.trim
            if trim:
                self._trees += 1
                trim = self._trees % PROBE_EVERY != 0  # else a whole tree, so every node's odds stay measured
            d = self._propose_tree(h, min(self.depth, max_tokens), sub,
                                   self._min_logp(ctx.draft_cost, ctx.guess_cost) if trim else None)
            d = self._cut(d, sel, trim, ctx.draft_cost, ctx.guess_cost, max_tokens)
        else:
            d = self._propose_chain(ctx, h, max_tokens, sub)
        self._timing = (time.perf_counter() - t0, steady(behind, self.depth + 2))
        return _scatter(d, sel, B)

    def _cut(self, d: Draft, sel: list[int], trim: bool, cost: float, r: float, budget: int) -> Draft:
        """The tree of each drafted row, cut to the nodes worth verifying when `trim` (`_trim`)
        and to its `budget` most likely nodes (the scheduler's node cap: a probe's small tree
        holds the nodes likeliest to be accepted, not the first ones drafted); remembers each
        row's nodes' path probabilities, whose outcome `commit` learns from."""
        rows = []
        for i, b in enumerate(sel):
            n = int(d.counts[i])
            toks, pars = d.tokens[i, :n].tolist(), d.parents[i, :n].tolist()
            probs = [math.exp(v) for v in self.last_scores[i]] if len(self.last_scores) > i else []
            if len(probs) == n:
                if trim:
                    toks, pars, probs = self._trim(toks, pars, probs, cost, r)
                if len(toks) > budget:
                    toks, pars, probs = tree_mod.best_nodes(toks, pars, probs, budget)
                self._node_p[b] = probs
            rows.append((toks, pars))
        N = max((len(t) for t, _ in rows), default=0)
        tokens = torch.tensor([t + [0] * (N - len(t)) for t, _ in rows], dtype=torch.long).reshape(len(sel), N)
        parents = torch.tensor([p + [0] * (N - len(p)) for _, p in rows], dtype=torch.long).reshape(len(sel), N)
        return Draft(tokens, torch.tensor([len(t) for t, _ in rows], dtype=torch.long), None, parents)

    def _min_logp(self, cost: float, r: float) -> float | None:
        """The path log-probability below which `_trim` would drop a node whatever else the tree
        holds: its odds under r / (1 + c), the least a node must add (None: no such bound). Below
        it the head need not expand."""
        floor = r / (1.0 + cost)
        lows = (0.0,) + self.odds.EDGES
        worth = [lo for i, lo in enumerate(lows) if self.odds.odds_of_bin(i) > floor]
        if not worth:
            return math.inf  # not even a certain guess pays for its verification
        return math.log(worth[0]) if worth[0] > 0 else None

    def _trim(self, toks: list[int], pars: list[int], probs: list[float], cost: float, r: float):
        """The tree cut to the nodes worth verifying: by their learnt odds of being accepted, the
        best first, as many as maximise committed tokens per unit of step time given the head's
        cost c (already spent) and r per verified node (policy.best_prefix). A node's path
        probability never exceeds its parent's, so every cut keeps parents. Returns (tokens,
        parents, probs)."""
        order = sorted(range(len(toks)), key=lambda j: (-probs[j], j))
        return tree_mod.best_nodes(toks, pars, probs, best_prefix([self.odds(probs[j]) for j in order], cost, r))

    def commit(self, num_accepted, paths=None) -> None:
        """The head's cache keeps committed pairs only (speculative slots are overwritten next
        time); the last tree's nodes teach their odds, held or not, by path probability."""
        if paths is not None:
            for b, probs in self._node_p.items():
                held = set(paths[b])
                for j, p in enumerate(probs, start=1):
                    self.odds.observe(p, j in held)
        self._node_p = {}

    def skip(self) -> None:
        self._node_p = {}  # its features wait in the rows for the next proposal

    def lags(self, tokens: list[list[int]]) -> list[int]:
        """Per row, the committed (feature, token) pairs the head has not read: what its next
        proposal first feeds (a whole prompt on a row's first one), priced by the cost model."""
        return self._behind(tokens)

    @torch.inference_mode()
    def time_alone(self) -> tuple[float, float]:
        """(seconds per proposal, per pair read in a catch-up), on a scratch one-row cache: a
        warm-up, then a catch-up on 32 pairs and whole proposals with nothing new to read. The
        rows' state is left as it was."""
        saved = (self._ks, self._vs, self.k, self.v, self.n, self.base, self.feat, self.last_h, self.last_scores,
                 self._trees)
        L = 32
        trim, self.trim = self.trim, False  # whole trees: what a proposal costs before any cut
        try:
            times = []
            for _ in range(2):  # the first round pays one-off costs (buffers, the weights' pages)
                self.begin([[0]], None, L + self.nodes + 2)
                ctx = DraftContext([[1 + i % 7 for i in range(L + 1)]], SamplingParams(), None,
                                   [torch.zeros(L, self.dim, dtype=self.dtype)])
                round_times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    self.propose(ctx, self.depth)
                    round_times.append(time.perf_counter() - t0)
                    ctx.hidden = None
                times = round_times
            per_draft = min(times[1:])
            return per_draft, max(times[0] - per_draft, 0.0) / L
        finally:
            (self._ks, self._vs, self.k, self.v, self.n, self.base, self.feat, self.last_h, self.last_scores,
             self._trees) = saved
            self.trim = trim

    def learned(self) -> dict:
        """The node odds the trees' cuts read, for a later run (learned.py)."""
        return {"odds": self.odds.learned()} if self.trim else None

    def relearn(self, state: dict) -> None:
        if state.get("odds"):
            self.odds.relearn(state["odds"])

    def _propose_chain(self, ctx, h, k, sel=None):

        B = h.shape[0]
        rows = None if sel is None else torch.tensor(sel)
        toks, probs = [], []
        rows_l = range(B) if sel is None else sel
        n0 = torch.tensor([self.n[b] for b in rows_l])  # the first speculative pair's position
        s0 = n0 - torch.tensor([self.base[b] for b in rows_l])  # and its cache slot
        for i in range(k):
            tok, q = draw(self._logits(h), ctx.params, ctx.generator, self.subset, self.vocab_size)
            if q is not None:
                probs.append(q)
            toks.append(tok)
            if i + 1 < k:
                slot = (s0 + i)[:, None]  # speculative pairs after the committed ones
                S = int(slot.max()) + 1
                visible = torch.arange(S)[None, None, :] <= slot[:, :, None]
                h = self._step(tok[:, None], h[:, None].to(self.dtype), (n0 + i)[:, None], slot, visible, rows)[:, 0]
        return Draft(torch.stack(toks, 1), torch.full((B,), k, dtype=torch.long),
                     torch.stack(probs, 1) if probs else None)

    def _propose_tree(self, h, depth, sel=None, min_logp=None):
        """EAGLE-2: expand the best `width` nodes per depth, keep the best `nodes` overall
        (for cache rows `sel`, default all); with min_logp, stop at the depth where every
        frontier node's path log-probability is below it."""
        B, D = h.shape
        W, N = self.width, self.nodes
        rows_t = None if sel is None else torch.tensor(sel)
        rows_l = range(B) if sel is None else sel
        pos0 = torch.tensor([self.n[b] for b in rows_l])  # the first speculative pair's position
        n0_l = [self.n[b] - self.base[b] for b in rows_l]  # and its cache slot (the committed pairs' count)
        n0 = torch.tensor(n0_l)
        M = W * max(depth - 1, 0)  # speculative slots written after the committed pairs
        span = torch.arange(max(n0_l) + M + 1)
        # anc[b, s, u]: speculative slot u is slot s or one of its ancestors
        anc = torch.zeros(B, M, M, dtype=torch.bool)
        # root: the head's distribution after the pending token
        lp = torch.log_softmax(self._logits(h), -1)  # [B, S]
        top = lp.topk(W, dim=-1)
        front_tok = self._ids(top.indices)  # [B, W]
        front_score = top.values  # [B, W]
        front_node = torch.arange(1, W + 1)[None].expand(B, W)  # node ids (1-based) of the frontier
        tokens = [front_tok]
        parents = [torch.zeros(B, W, dtype=torch.long)]
        scores = [front_score]
        front_h = h[:, None].expand(B, W, D)  # the feature each frontier node is paired with
        front_parent = None  # speculative slot of each frontier node's parent (None: the root)
        next_id = W + 1
        for d in range(1, depth):
            if min_logp is not None and float(front_score.max()) < min_logp:
                break  # every deeper node would be less likely still
            # run the head on the frontier: pair (feature of the parent's prediction, token)
            base = (d - 1) * W  # speculative slots base .. base + W - 1 hold this frontier
            slots = n0[:, None] + span[base : base + W][None]  # [B, W] cache slots
            pos = (pos0 + (d - 1))[:, None].expand(B, W)  # all frontier nodes sit at the same depth
            new = torch.arange(base, base + W)
            if front_parent is not None:
                anc[:, base : base + W] = anc.gather(1, front_parent[:, :, None].expand(B, W, M))
            anc[:, new, new] = True
            # visibility: the committed pairs, then each node's ancestors among the speculative slots and itself
            S = max(n0_l) + base + W
            vis = (span[None, None, :S] < n0[:, None, None]).expand(B, W, S).clone()
            cols = (n0[:, None] + span[: base + W][None])[:, None].expand(B, W, base + W)  # [B, W, base + W]
            vis.scatter_(2, cols, anc[:, base : base + W, : base + W])
            out = self._step(front_tok, front_h.to(self.dtype), pos, slots, vis, rows_t)  # [B, W, D]
            # expand: each frontier node's top W children, keep the W best by cumulative score
            lp = torch.log_softmax(self._logits(out), -1)  # [B, W, S]
            top = lp.topk(W, dim=-1)
            cand_score = (front_score[:, :, None] + top.values).reshape(B, W * W)
            cand_tok = self._ids(top.indices).reshape(B, W * W)
            tokens.append(cand_tok)
            parents.append(front_node[:, :, None].expand(B, W, W).reshape(B, W * W))
            scores.append(cand_score)
            # the W best of the W * W candidates; ties (a saturated head gives log-probabilities of
            # exactly 0) go to the earlier candidate
            best = torch.sort(-cand_score, dim=-1, stable=True).indices[:, :W]
            par = best // W  # which frontier node each survivor hangs under
            front_tok = cand_tok.gather(1, best)
            front_score = cand_score.gather(1, best)
            front_node = next_id + best
            front_parent = base + par
            front_h = out.gather(1, par[:, :, None].expand(B, W, D))
            next_id += W * W
        # choose the N best nodes overall (ancestor-closed: a child never outscores its parent)
        tok_all = torch.cat(tokens, 1).tolist()
        par_all = torch.cat(parents, 1).tolist()  # parent node ids (0 = root); node id = column + 1
        sc_all = torch.cat(scores, 1)
        n_keep = min(N, sc_all.shape[1])
        # the n_keep best, ties to the lower id (a parent's id is lower than its children's, and a
        # child can tie its parent when the head is saturated), then in id order = topological order
        keep = torch.sort(-sc_all, dim=-1, stable=True).indices[:, :n_keep].sort(dim=-1).values.tolist()
        sc_list = sc_all.tolist()
        out_tok = [[0] * n_keep for _ in range(B)]
        out_par = [[0] * n_keep for _ in range(B)]
        self.last_scores = [[] for _ in range(B)]  # per row and kept node: its path's log-probability
        counts = []
        for b in range(B):
            index: dict[int, int] = {}  # node id -> position in the proposal (1-based)
            for i in keep[b]:
                p = par_all[b][i]
                if p != 0 and p not in index:
                    continue  # an orphan (a tie in scores kept a child without its parent)
                n = len(index)
                out_tok[b][n] = tok_all[b][i]
                out_par[b][n] = 0 if p == 0 else index[p]
                self.last_scores[b].append(sc_list[b][i])
                index[i + 1] = n + 1
            counts.append(len(index))
        return Draft(torch.tensor(out_tok, dtype=torch.long).view(B, n_keep),
                     torch.tensor(counts, dtype=torch.long), None,
                     torch.tensor(out_par, dtype=torch.long).view(B, n_keep))

    def add_row(self, max_len: int, prompt: list[int] | None = None) -> None:
        """Append an empty row (a request joining a running batch); `begin` must have run, with
        the same max_len (an empty batch is fine). Its features arrive with its first proposal."""
        size = max_len + max(self.nodes, self.depth) + 2
        if self.k.shape[2] != size:
            raise ValueError(f"add_row: the cache holds {self.k.shape[2]} slots, a row of max_len {max_len} needs {size}")
        B = self.k.shape[0]
        # room kept for joining rows (concatenating the whole cache on every join and leave cost
        # ~50 MB of copies a request at 32 rows)
        self._ks, self._vs = with_room([self._ks, self._vs], B, 1)
        self._ks[B].zero_()
        self._vs[B].zero_()
        self.k, self.v = self._ks[: B + 1], self._vs[: B + 1]
        self.n.append(0)
        self.base.append(0)
        self.feat.append([])
        if self.last_h is not None:
            self.last_h = torch.cat([self.last_h, self.last_h.new_zeros(1, self.last_h.shape[1])])

    def keep_rows(self, rows) -> None:
        rows = [int(r) for r in rows]
        idx = torch.as_tensor(rows, dtype=torch.long)
        if not keep_in_place([self._ks, self._vs], rows):  # (gathered into the stores: their room stays)
            self._ks[: len(rows)], self._vs[: len(rows)] = self.k[idx], self.v[idx]
        self.k, self.v = self._ks[: len(rows)], self._vs[: len(rows)]
        self.n = [self.n[r] for r in rows]
        self.base = [self.base[r] for r in rows]
        self.feat = [self.feat[r] for r in rows]
        if self.last_h is not None:
            self.last_h = self.last_h[idx]


def _scatter(d: Draft, sel: list[int], B: int) -> Draft:
    """A draft of the rows `sel` as one of all B rows (the others with no guesses)."""
    if len(sel) == B:
        return d
    N = d.tokens.shape[1]
    tokens, counts = torch.zeros(B, N, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    idx = torch.tensor(sel, dtype=torch.long)
    tokens[idx], counts[idx] = d.tokens, d.counts
    probs = parents = None
    if d.probs is not None:
        probs = torch.zeros(B, N, d.probs.shape[-1])
        probs[idx] = d.probs
    if d.parents is not None:
        parents = torch.zeros(B, N, dtype=torch.long)
        parents[idx] = d.parents
    return Draft(tokens, counts, probs, parents)
