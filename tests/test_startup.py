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
