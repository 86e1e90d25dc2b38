"""A GGUF file's first load (an empty specdec cache): the tokenizer converted from its metadata.

The oracle is transformers' own AutoTokenizer on the same file (which also reads the model's
configuration to pick the tokenizer class): the class specdec names directly for an architecture
(tokenizer._GGUF_TOKENIZER_CLASSES) must give the same tokenizer files, and a wrong class is shown
to give other files. The conversion runs in a child process, so the loading process never imports
transformers for it; a tokenizer transformers cannot read is one line naming the file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.types import SpecdecError
from tiny_gguf import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]


def _saved(tok, out: Path) -> dict[str, str]:
    tok.save_pretrained(str(out))
    return {f.name: f.read_text(encoding="utf-8") for f in sorted(out.iterdir())}


def _auto(path: Path, out: Path) -> dict[str, str]:
    from transformers import AutoTokenizer

    return _saved(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), out)


@pytest.mark.parametrize("arch, tokenizer", [("qwen2", "gpt2"), ("llama", "gpt2"), ("llama", "llama")])
def test_the_named_tokenizer_class_gives_autotokenizers_files(tmp_path, arch, tokenizer):
    from transformers import AutoTokenizer

    from specdec.models.gguf_file import GGUFFile
    from specdec.models.tokenizer import _gguf_tokenizer_class

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, 8, tokenizer=tokenizer)
    cls = _gguf_tokenizer_class(GGUFFile(path), AutoTokenizer)
    assert cls is not AutoTokenizer  # (the fast path is taken)
    named = _saved(cls.from_pretrained(str(path.parent), gguf_file=path.name), tmp_path / "named")
    assert named == _auto(path, tmp_path / "auto")


def test_a_wrong_tokenizer_class_gives_other_files(tmp_path):
    """The comparison above can fail: Qwen2's class on a Llama file's SentencePiece vocabulary."""
    import transformers

    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", 8, tokenizer="llama")
    wrong = _saved(transformers.Qwen2Tokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
                   tmp_path / "wrong")
    assert wrong != _auto(path, tmp_path / "auto")


def test_mistral_named_and_unknown_architectures_go_to_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    from specdec.models.gguf_file import GGUFFile
    from specdec.models.tokenizer import _gguf_tokenizer_class

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", 8, name="Mistral-7B-Instruct-v0.3", tokenizer="llama")
    assert _gguf_tokenizer_class(GGUFFile(path), AutoTokenizer) is AutoTokenizer


def test_a_first_load_converts_the_tokenizer_outside_the_process(tmp_path):
    """An empty cache: the tokenizer comes back right (the child's conversion, then the cached
    folder) and transformers was never imported into the loading process."""
    import os

    path = write_tiny_gguf(tmp_path / "q.gguf", "qwen2", 8)
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from specdec.models.gguf_file import GGUFFile\n"
            "from specdec.models.tokenizer import gguf_tokenizer\n"
            f"tok = gguf_tokenizer(GGUFFile(Path({str(path)!r})), Path({str(tmp_path / 'cache')!r}), quiet=True)\n"
            "print(tok.encode('the theater'), 'transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ids, imported = done.stdout.rsplit(" ", 1)
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).encode("the theater")
    assert ids == str(want) and imported.strip() == "False"
    assert [f.name for f in (tmp_path / "cache").iterdir() if ".tmp" in f.name] == []


def test_a_tokenizer_transformers_cannot_read_is_one_line(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    from specdec.models.gguf_file import GGUFFile
    from specdec.models.tokenizer import gguf_tokenizer

    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("no-such-model")
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecdecError, match=r"cannot read the tokenizer from odd\.gguf's metadata \(\w+"):
        gguf_tokenizer(GGUFFile(path), tmp_path / "cache", quiet=True)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
