"""Preallocated key/value cache with per-row lengths.

Layout: for each layer one key and one value tensor `[B, H_kv, S_max, Dh]`. Row b's
committed entries live in slots `0 .. lengths[b]-1`, in order. A forward over T new
tokens writes them to slots `lengths[b] .. lengths[b]+T-1` and advances `lengths` by T
(see `reserve`). Rolling back a rejected chain is lowering `lengths` (`truncate`);
accepting one path of a verified tree moves that path's entries to the slots right
after the committed prefix (`compact`). Nothing is reallocated while the rows stay the same;
rows that join (`append_rows`) go into room kept for them (doubled when full), rows that leave
(`reorder_rows`) are compacted in place where the order allows.

The cache knows nothing about models, tokens or positions: positions are the caller's
business (for a tree, slot and position differ; see tree verification).
"""

from __future__ import annotations

import torch

from .types import SpecdecError


def with_room(stores: list[torch.Tensor], rows: int, more: int) -> list[torch.Tensor]:
    """Row stores ([capacity, ...] each) whose first `rows` rows are kept, with room for `more`
    rows after them: the same tensors if they have it, else copies with twice the rows needed,
    so that rows joining one at a time copy the batch only now and then. The extra rows are not
    initialised (a joining row is written or zeroed whole before it is read): only the kept rows'
    pages are written, not the whole new store's."""
    if rows + more <= stores[0].shape[0]:
        return stores
    cap = max(4, 2 * (rows + more))
    grown = []
    for t in stores:
        g = t.new_empty(cap, *t.shape[1:])
        g[:rows] = t[:rows]
        grown.append(g)
    return grown


def keep_in_place(stores: list[torch.Tensor], order: list[int], lengths: list[int] | None = None) -> bool:
    """Make row j of every store row order[j], in place, where the order allows it: when every
    order[j] >= j, row j's source was no earlier row's destination (rows that leave in order, or
    the last row moved into a freed slot), so only moved rows copy, and of them only the first
    lengths[r] slots (dim 2) when given. False (nothing moved) when the order needs a gather."""
    if not all(r >= j for j, r in enumerate(order)):
        return False
    for j, r in enumerate(order):
        if r != j:
            for t in stores:
                if lengths is None:
                    t[j] = t[r]
                else:
                    t[j, :, : lengths[r]] = t[r, :, : lengths[r]]
    return True


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.batch_size = batch_size
        # the tensors that hold the rows, with room for more once rows join (`append_rows`):
        # self.k / self.v are views of their first batch_size rows
        self._ks, self._vs = list(self.k), list(self.v)

    # -- bookkeeping used by the model's forward -------------------------------------
    def reserve(self, num_tokens: int) -> tuple[torch.Tensor, int | None]:
        """Claim `num_tokens` slots after every row's prefix; return (start [B], uniform_start).

        uniform_start is the common start when all rows have the same length (the fast
        path: writes and reads become plain slices), else None.
        """
        start = self.lengths.clone()
        end = int(start.max()) + num_tokens
        if end > self.max_len:
            raise SpecdecError(
                f"the KV cache holds {self.max_len} tokens but this step needs {end}; "
                "raise the cache size (max context) or shorten the prompt / max-new-tokens"
            )
        self.lengths += num_tokens
        lo = int(start.min())
        uniform = lo if lo == end - num_tokens else None
        return start, uniform

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, uniform: int | None) -> None:
        """Store new entries `k, v: [B, H_kv, T, Dh]` at slots start[b] + t (converted to the
        cache's dtype, which may be wider than the model's; see models.llama)."""
        T = k.shape[2]
        if uniform is not None:
            self.k[layer][:, :, uniform : uniform + T] = k
            self.v[layer][:, :, uniform : uniform + T] = v
            return
        B = k.shape[0]
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)
        slots = start[:, None] + torch.arange(T, device=k.device)  # [B, T]
        rows = torch.arange(B, device=k.device)[:, None].expand(B, T)  # [B, T]
        # advanced indices on dims 0 and 2 put (B, T) first: value must be [B, T, H, Dh]
        self.k[layer][rows, :, slots] = k.transpose(1, 2)
        self.v[layer][rows, :, slots] = v.transpose(1, 2)

    # -- rollback -------------------------------------------------------------------
    def truncate(self, lengths: torch.Tensor | list[int] | int) -> None:
        """Keep only the first `lengths[b]` entries of each row (a chain rollback)."""
        new = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).expand_as(self.lengths)
        if bool((new > self.lengths).any()) or bool((new < 0).any()):
            raise ValueError(f"truncate can only shorten rows: have {self.lengths.tolist()}, asked {new.tolist()}")
        self.lengths = new.clone()

    def compact(self, base: torch.Tensor, paths: torch.Tensor, path_lens: torch.Tensor) -> None:
        """Keep one tree path per row.

        base [B]: committed length before the tree was written; paths [B, P]: node indices
        (slot offsets from base) of the accepted path, root first; path_lens [B]: how many
        of them are real. Example: base 5, nodes written at slots 5..9, accepted path
        nodes [0, 2, 3] -> slots 5, 7, 8 move to 5, 6, 7 and the row's length becomes 8.
        """
        base = torch.as_tensor(base, dtype=torch.long, device=self.lengths.device)
        paths = torch.as_tensor(paths, dtype=torch.long, device=self.lengths.device)
        path_lens = torch.as_tensor(path_lens, dtype=torch.long, device=self.lengths.device)
        B, P = paths.shape
        if P > 0:
            # entries before a row's first skipped node already sit in their slots: move only
            # from there on (a fully accepted chain-shaped path moves nothing)
            plist, lens = paths.tolist(), path_lens.tolist()
            first = [next((i for i in range(n) if p[i] != i), n) for p, n in zip(plist, lens)]
            if B == 1 and first[0] < lens[0]:
                lo, hi, b0 = first[0], lens[0], int(base[0])
                src = b0 + paths[0, lo:hi]
                for cache in (self.k, self.v):
                    for t in cache:  # index_select copies before the slice is overwritten
                        t[:, :, b0 + lo : b0 + hi] = t.index_select(2, src)
            elif B > 1 and any(f < n for f, n in zip(first, lens)):
                src = base[:, None] + paths  # [B, P]
                dst = base[:, None] + torch.arange(P, device=paths.device)  # [B, P]
                valid = torch.arange(P, device=paths.device)[None, :] < path_lens[:, None]
                rows = torch.arange(B, device=paths.device)[:, None].expand(B, P)
                src = torch.where(valid, src, dst)  # padding entries copy onto themselves
                for cache in (self.k, self.v):
                    for t in cache:  # the gather on the right copies before the scatter
                        t[rows, :, dst] = t[rows, :, src]
        self.lengths = base + path_lens

    def keep_paths(self, base: torch.Tensor, paths: list[list[int]]) -> None:
        """After a tree step: keep each row's root (slot base, the pending token) and its
        accepted nodes `paths[b]` (1-based node indices, root excluded), dropping the rest."""
        keep = torch.zeros(len(paths), 1 + max((len(p) for p in paths), default=0), dtype=torch.long)
        for b, p in enumerate(paths):
            keep[b, 1 : 1 + len(p)] = torch.tensor(p, dtype=torch.long)
        self.compact(base, keep, torch.tensor([1 + len(p) for p in paths], dtype=torch.long))

    def append_rows(self, other: "KVCache") -> None:
        """Append `other`'s rows (same layers, heads, slots and dtype), e.g. a request that
        joins a running batch with its prompt already written."""
        if other.max_len != self.max_len or len(other.k) != len(self.k):
            raise ValueError(f"append_rows: caches of {other.max_len} and {self.max_len} slots, "
                             f"{len(other.k)} and {len(self.k)} layers")
        B, n = self.batch_size, other.batch_size
        self._ks, self._vs = with_room(self._ks, B, n), with_room(self._vs, B, n)
        for stores, rows in ((self._ks, other.k), (self._vs, other.v)):
            for t, o in zip(stores, rows):
                t[B : B + n] = o
        self._view(B + n)
        self.lengths = torch.cat([self.lengths, other.lengths])

    def fill_row(self, row: int, one: "KVCache", src: int = 0) -> None:
        """Row `row` takes the committed entries of row `src` of `one` (a prompt prefilled alone in a
        cache of its own, or another row of this cache)."""
        n = int(one.lengths[src])
        for layer in range(len(self.k)):
            self.k[layer][row, :, :n] = one.k[layer][src, :, :n]
            self.v[layer][row, :, :n] = one.v[layer][src, :, :n]
        self.lengths[row] = n

    def move_row(self, src: int, dst: int) -> None:
        """Row `dst` takes row `src`'s committed entries (a row leaving the batch gives its slot to the
        last one); `src` is left empty."""
        if src != dst:
            self.fill_row(dst, self, src)
        self.lengths[src] = 0

    def first_rows(self, rows: int) -> "KVCache":
        """The first `rows` rows as a cache for one forward (storage shared; `RowsView.sync` writes
        their lengths back), or this cache when that is all of it."""
        return self if rows == self.batch_size else RowsView(self, rows)

    def reorder_rows(self, rows: torch.Tensor) -> None:
        """Keep/permute batch rows (used when finished rows leave a batch)."""
        order = [int(r) for r in torch.as_tensor(rows).tolist()]
        idx = torch.as_tensor(order, dtype=torch.long, device=self.lengths.device)
        # moved rows carry their committed entries only (slots past a row's length are never read)
        if not keep_in_place(self._ks + self._vs, order, self.lengths.tolist()):
            self._ks = [k[idx] for k in self.k]
            self._vs = [v[idx] for v in self.v]
        self._view(len(order))
        self.lengths = self.lengths[idx]

    def _view(self, rows: int) -> None:
        self.k = [t[:rows] for t in self._ks]
        self.v = [t[:rows] for t in self._vs]
        self.batch_size = rows


class RowsView:
    """The first A rows of a KVCache as a cache object for one forward (storage shared);
    `sync()` writes the row lengths back to the full cache."""

    def __init__(self, cache: KVCache, rows: int) -> None:
        self.base, self.A = cache, rows
        self.k = [k[:rows] for k in cache.k]
        self.v = [v[:rows] for v in cache.v]
        self.lengths = cache.lengths[:rows].clone()
        self.max_len = cache.max_len
        self.batch_size = rows

    def __getattr__(self, name):  # reserve, write, truncate, keep_paths: the KVCache methods on this view
        return getattr(KVCache, name).__get__(self)

    def sync(self) -> None:
        self.base.lengths[: self.A] = self.lengths
