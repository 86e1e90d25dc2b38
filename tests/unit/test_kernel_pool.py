"""The kernels' own thread pool (rowstable.cpp, KernelPool): a caller that never waits for a thread
the OS has not run. Oracle: the same products and attention on OpenMP regions (the pool off) and
on one thread, bit for bit; every output is computed by one task alone, so which thread takes a
task must change nothing. Also: calls from two Python threads at once, a forked child (none of
the parent's threads exist there), and the thread governor's switch."""

from __future__ import annotations

import multiprocessing
import os
import threading

import numpy as np
import pytest
import torch

from gguf_random import Q4_K, Q6_K, random_blocks
from model_helpers import need_kernels
from specdec import threads
from specdec.models import gguf_blocks as gb


def products(ops):
    """A K-quant product of 1 and 9 rows on the 8-bit-activation path (kq_linear_q8, several parts),
    a block-by-block one (gguf_linear_q8), the attention of a 5-token step and silu_mul beside
    torch's silu and product: each a fixed input."""
    rng = np.random.default_rng(5)
    k = 512
    parts = [(Q4_K, 320, random_blocks(Q4_K, 320, k, rng)), (Q6_K, 96, random_blocks(Q6_K, 96, k, rng))]
    packed = [gb.pack_k_i8(raw, t) for t, _, raw in parts]
    types, ns = [t for t, _, _ in parts], [n for _, n, _ in parts]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, k, generator=g)
    raw = torch.from_numpy(parts[0][2].reshape(-1))
    q = torch.randn(2, 6, 5, 64, generator=g)
    kc, vc = torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g)
    gu = torch.randn(9, 8192, generator=g)  # (9 x 4096 gated values: silu_mul's rows on the pool)
    return [ops.kq_linear_q8(x, packed, types, ns, k), ops.kq_linear_q8(x[4:5], packed, types, ns, k),
            ops.gguf_linear_q8(x, raw, Q4_K, 320, k), ops.attend(q, kc, vc, 290, None), ops.silu_mul(gu),
            torch.nn.functional.silu(gu[:, :4096]) * gu[:, 4096:]]


def test_silu_mul_on_the_pool_is_torchs_silu_and_product():
    """The Python path's numbers (F.silu(gate) * up), in inference mode too (the pool's threads
    take the caller's thread-local state)."""
    ops = need_kernels()
    before = torch.get_num_threads()
    try:
        ops.set_kernel_pool(1, -2, 3)
        with torch.inference_mode():
            got = products(ops)
        assert torch.equal(got[4], got[5])
    finally:
        ops.set_kernel_pool(0, -2, 0)
        torch.set_num_threads(before)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_pool_openmp_and_one_thread_give_the_same_numbers():
    """1, 2, 3 and 7 threads (more than this machine's cores: workers that join late or never), the
    workers spinning or sleeping between calls (spin 0: every call wakes them), calls in a row."""
    ops = need_kernels()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = products(ops)
        for pool, spin in ((0, 20), (1, 20), (1, 0), (1, 1000), (1, -2)):  # (-2: spin as the core is shared or not)
            ops.set_kernel_pool(pool, spin, 0)
            for nt in (2, 3, 7):
                torch.set_num_threads(nt)
                for _ in range(3):
                    assert same(products(ops), one), (pool, spin, nt)
            ops.set_kernel_pool(pool, spin, 4)  # the pool's own count, torch's at 1
            torch.set_num_threads(1)
            assert same(products(ops), one), (pool, spin, "own count")
    finally:
        ops.set_kernel_pool(0, -2, 0)
        torch.set_num_threads(before)


def test_two_python_threads_calling_at_once_each_get_their_numbers():
    """One caller takes the pool, a call that finds it busy runs on its own thread alone."""
    ops = need_kernels()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ops.set_kernel_pool(1, -2, 0)
    try:
        want = products(ops)
        wrong = []

        def caller():
            for _ in range(10):
                if not same(products(ops), want):
                    wrong.append(1)

        workers = [threading.Thread(target=caller) for _ in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        assert not any(w.is_alive() for w in workers), "a call never returned"
        assert not wrong
    finally:
        ops.set_kernel_pool(0, -2, 0)
        torch.set_num_threads(before)


def _child(queue, want):
    torch.set_num_threads(1)  # (an OpenMP region in a child forked after the parent's ran hangs: libgomp)
    ops = need_kernels()
    ops.set_kernel_pool(1, -2, 2)  # the pool's 2 threads
    queue.put(same(products(ops), want))


def test_a_forked_child_makes_its_own_pool():
    """A child forked after the parent's pool ran has none of its threads: its calls must neither
    wait for them nor fail (the pool is made anew there; a caller never waits for a worker that has
    not joined, so even the parent's pool would not hang it)."""
    ops = need_kernels()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ops.set_kernel_pool(1, -2, 0)
    try:
        want = products(ops)  # the parent's pool is up
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(queue, want))
        child.start()
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
            pytest.fail("the forked child's kernel call hung")
        assert child.exitcode == 0 and queue.get(timeout=5) is True
    finally:
        ops.set_kernel_pool(0, -2, 0)
        torch.set_num_threads(before)


def test_the_kernels_register_their_pool_with_the_thread_governor():
    """What threads.use_kernel_pool receives switches the pool: on / off and its thread count, seen
    in which thread count a product takes (the same numbers either way)."""
    if os.environ.get("SPECDEC_KERNEL_POOL") in ("0", "1"):
        pytest.skip("SPECDEC_KERNEL_POOL fixes the pool: the kernels register no switch")
    ops = need_kernels()
    switch = threads._kernel_pool
    assert switch is not None, "the kernels loaded without registering their pool"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = products(ops)
        switch(True, 3)  # the pool on 3 threads while torch's count is 1
        assert same(products(ops), want)
        switch(False, 3)
        assert same(products(ops), want)
    finally:
        ops.set_kernel_pool(0, -2, 0)
        torch.set_num_threads(before)
