"""What a start skips on a warm cache, and that skipping changes nothing: the decode-step layout
of a GGUF model read back from the cache equals a fresh repack byte for byte, and the file checks
run on a file's first load only, again when the file changes."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tiny_gguf import write_tiny_gguf


@pytest.mark.default_model
def test_saved_decode_layout_equals_a_fresh_repack():
    from specdec.models import gguf_model
    from specdec.models.loader import default_model_path, load_model, repacked_dir

    load_model(None, quiet=True)  # (writes the layout if this cache has none yet)
    saved = repacked_dir(default_model_path())
    assert len(list(saved.glob("*.npy"))) > 0
    lm = load_model(None, quiet=True)  # reads it back
    m = lm.model
    lins = [getattr(blk, a) for blk in m.layers for a in ("wqkv", "wo", "w_gate_up", "w_down")] + [m.head]
    repacked = [lin for lin in lins if lin.rs_blocks is not None]
    assert len(repacked) == len(lins)
    for lin in repacked:
        fresh = copy.copy(lin)
        fresh.rs_blocks = None
        assert gguf_model.repack_for_steps(fresh, m.rowstable, m.gguf, saved=None)
        assert fresh.rs_blocks[0] is lin.rs_blocks[0] and fresh.rs_blocks[2] == lin.rs_blocks[2]
        assert torch.equal(fresh.rs_blocks[1], lin.rs_blocks[1])


def test_file_checks_run_on_the_first_load_and_after_a_change(tmp_path, monkeypatch):
    from specdec.models import gguf_model
    from specdec.models.loader import load_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", 8)
    calls = []
    real = gguf_model.check_sampled_rows
    monkeypatch.setattr(gguf_model, "check_sampled_rows", lambda model: calls.append(1) or real(model))
    load_model(str(path), quiet=True, with_tokenizer=False)
    load_model(str(path), quiet=True, with_tokenizer=False)
    assert len(calls) == 1
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the file changed (or was replaced)
    load_model(str(path), quiet=True, with_tokenizer=False)
    assert len(calls) == 2


def test_repacked_layouts_that_no_load_can_read_again_are_removed(tmp_path, monkeypatch):
    """Each repacked layout is about its model's size, and its key changes with the file and with
    specdec's code: claiming one removes the others no load can read again once they are a day
    unused (another version of the same file, a file that is gone, an unmarked one of an older
    specdec), and keeps the current layouts of other files and anything used within the day; the
    sweep runs at most once every REPACKED_SWEEP_EVERY seconds."""
    import time

    from specdec.models.loader import REPACKED_SWEEP_EVERY, REPACKED_UNUSED, claim_repacked, repacked_dir

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    model, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"x" * 64)
    other.write_bytes(b"y" * 64)
    root = tmp_path / "cache" / "repacked"

    def entry(name, source=None):
        d = root / name
        d.mkdir(parents=True)
        (d / "blocks.npy").write_bytes(b"0" * 32)
        if source is not None:
            (d / "source").write_text(str(source))
        return d

    stale_version = entry("aaaa", model.resolve())  # the same file, as older code keyed it
    gone = entry("bbbb", tmp_path / "deleted.gguf")
    unmarked = entry("cccc")
    current_other = claim_repacked(other)  # another file's layout, as this code keys it
    later = time.time() + REPACKED_UNUSED + 60
    here = claim_repacked(model, now=time.time())  # nothing is a day unused yet: all kept
    assert all(d.is_dir() for d in (stale_version, gone, unmarked, current_other, here))
    assert claim_repacked(model, now=later) == here == repacked_dir(model)
    assert not stale_version.exists() and not gone.exists() and not unmarked.exists()
    assert current_other.is_dir() and (here / "source").read_text() == str(model.resolve())
    # the sweep stats every entry: it runs at most once every REPACKED_SWEEP_EVERY seconds
    again = entry("dddd", tmp_path / "deleted.gguf")
    claim_repacked(model, now=later + 60)
    assert again.is_dir()
    claim_repacked(model, now=later + REPACKED_SWEEP_EVERY + 60)
    assert not again.exists()


@pytest.mark.parametrize("array", [torch.arange(24, dtype=torch.uint8).reshape(4, 6), torch.arange(7, dtype=torch.int32),
                                   torch.ones(2, 3, 5), torch.zeros(0, 4, dtype=torch.uint8)])
def test_a_saved_layout_reads_back_as_numpy_loads_it(tmp_path, array):
    """_read_saved's own .npy reading (no literal_eval, no np.memmap) against np.load: the same
    dtype, shape and bytes; writes to it stay in memory (copy on write); a file cut short is no
    layout (the load repacks) rather than an error."""
    import numpy as np

    from specdec.models.gguf_model import _read_saved, _write_saved

    path = tmp_path / "blk.0.wqkv.npy"
    _write_saved(path, array)
    got = _read_saved(path)
    want = np.load(path)
    assert got.numpy().dtype == want.dtype and tuple(got.shape) == want.shape and (got.numpy() == want).all()
    if got.numel():
        got.zero_()
        assert (np.load(path) == array.numpy()).all()
    path.write_bytes(path.read_bytes()[: 128 + array.numel() * array.element_size() // 2])
    if array.numel() > 1:
        assert _read_saved(path) is None
