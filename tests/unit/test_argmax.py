"""The kernels' argmax (argmax_last, sampling.argmax) against torch.argmax(-1): the first index of
each row's maximum, ties, signed zeros, infinities and NaN included."""

from __future__ import annotations

import pytest
import torch

from model_helpers import need_kernels


def cases():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 49152), (3, 9, 4099), (2, 5, 7), (4, 8), (1, 1), (2, 3, 151936), (17,)]:
        x = torch.randn(*shape, generator=g)
        yield "random", x
        tail = x.clone()
        tail[..., -1] = tail.max() + 1
        yield "maximum in the tail", tail
        yield "ties", torch.round(x * 2) / 2
        yield "all equal", torch.full(shape, 0.5)
        nan = x.clone()
        nan.view(-1)[:: max(1, nan.numel() // 5)] = float("nan")
        yield "NaN", nan
        yield "all -inf", torch.full(shape, float("-inf"))
        zeros = torch.zeros(shape)
        zeros.view(-1)[::2] = -0.0
        yield "signed zeros", zeros
        inf = x.clone()
        inf[..., 0] = inf[..., -1] = float("inf")
        yield "inf twice", inf


@pytest.mark.parametrize("name,x", list(cases()))
def test_argmax_last_is_torchs_argmax(name, x):
    ops = need_kernels()
    assert torch.equal(ops.argmax_last(x), x.argmax(-1)), name


def test_sampling_argmax_takes_the_kernel_where_a_model_loaded_it(monkeypatch):
    """sampling.argmax runs argmax_last on float32 CPU tensors once the kernels are loaded, torch's
    argmax otherwise; the tie rule is what a wrong kernel breaks (the last maximum instead of the
    first: the ties case then differs)."""
    from specdec import sampling

    ops = need_kernels()
    x = torch.tensor([[0.5, 2.0, 2.0, 1.0], [3.0, -1.0, 3.0, 3.0]])
    calls = []
    real = ops.argmax_last

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def argmax_last(self, t):
            calls.append(t.shape)
            return real(t)

    monkeypatch.setattr(sampling, "loaded_rowstable_ops", lambda: Spy())
    assert sampling.argmax(x).tolist() == [1, 0] and calls == [x.shape]
    assert sampling.argmax(x.double()).tolist() == [1, 0] and len(calls) == 1  # float64: torch's

    def last_maximum(t):
        flipped = t.flip(-1).argmax(-1)
        return t.shape[-1] - 1 - flipped

    class Wrong(Spy):
        def argmax_last(self, t):
            return last_maximum(t)

    monkeypatch.setattr(sampling, "loaded_rowstable_ops", lambda: Wrong())
    assert not torch.equal(sampling.argmax(x), x.argmax(-1))
