"""Fallback for architectures the native model does not cover: wraps transformers'
`AutoModelForCausalLM` behind the same forward contract as the native model.

Limits (stated, not hidden): one row per cache (the engine runs such models row by row),
chains only (no tree masks, no `compact`), and it is slower than the native model. The
adapter knows nothing about files; the loader builds it.
"""

from __future__ import annotations

import torch

from ..types import SpecdecError


def crop(cache, remove: int) -> None:
    """Drop the last `remove` entries of a transformers DynamicCache (5.x takes a negative count)."""
    import inspect

    first = next(iter(inspect.signature(cache.crop).parameters))
    cache.crop(-remove if first == "tokens_to_remove" else cache.get_seq_length() - remove)


def _cache_kwarg(hf_model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; use whichever forward takes."""
    import inspect

    params = inspect.signature(hf_model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


ONE_ROW = "this model runs through the transformers adapter, which decodes one row at a time"


class HFCache:
    """A one-row cache over transformers' DynamicCache with the KVCache interface."""

    def __init__(self, max_len: int) -> None:
        from transformers import DynamicCache

        self.inner = DynamicCache()
        self.lengths = torch.zeros(1, dtype=torch.long)
        self.max_len = max_len
        self.batch_size = 1

    def truncate(self, lengths) -> None:
        n = int(torch.as_tensor(lengths).reshape(-1)[0])
        if n > int(self.lengths[0]) or n < 0:
            raise ValueError(f"truncate can only shorten rows: have {int(self.lengths[0])}, asked {n}")
        remove = int(self.lengths[0]) - n
        if remove:
            crop(self.inner, remove)
        self.lengths = torch.tensor([n])

    def first_rows(self, rows: int) -> "HFCache":
        """The scheduler's view of its running rows: the one row there is."""
        if rows != 1:
            raise SpecdecError(ONE_ROW)
        return self

    def move_row(self, src: int, dst: int) -> None:
        """The row leaves (the one row: nothing moves into its slot); the cache is empty after."""
        if src != dst:
            raise SpecdecError(ONE_ROW)
        self.truncate([0])

    def compact(self, *args, **kwargs) -> None:
        raise SpecdecError("this model runs through the transformers adapter, which verifies chains only (no trees)")


class HFAdapter(torch.nn.Module):
    supports_tree = False
    native = False

    def __init__(self, hf_model) -> None:
        super().__init__()
        self.hf = hf_model.eval()
        cfg = hf_model.config
        self._vocab = int(hf_model.get_output_embeddings().weight.shape[0])
        self._cache_kw = _cache_kwarg(hf_model)
        self._ctx = int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context(self) -> int:
        return self._ctx

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    def new_cache(self, batch_size: int, max_len: int | None = None) -> HFCache:
        if batch_size != 1:
            raise SpecdecError("the transformers adapter runs one row per cache")
        return HFCache(min(max_len or self.max_context, self.max_context))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.hf.parameters())

    def weight_bytes_per_token(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.hf.parameters())

    @torch.inference_mode()
    def forward(self, tokens, positions, cache: HFCache, attn_mask=None, logits_at=None):
        if attn_mask is not None:
            raise SpecdecError("the transformers adapter cannot verify trees (attention masks); use a chain method")
        B, T = tokens.shape
        end = int(cache.lengths[0]) + T
        if end > cache.max_len:
            raise SpecdecError(f"the context holds {cache.max_len} tokens but this step needs {end}")
        out = self.hf(
            input_ids=tokens,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kw: cache.inner},
        )
        cache.lengths = cache.lengths + T
        logits, hidden = out.logits.float(), out.hidden_states[-1]
        if logits_at is not None:
            idx = logits_at.to(torch.long)
            logits = torch.gather(logits, 1, idx[:, :, None].expand(-1, -1, logits.shape[-1]))
        return logits, hidden
