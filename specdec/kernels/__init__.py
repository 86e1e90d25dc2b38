"""Native kernels, built on first use: the row-stable float32 kernels of a decoding step.

`rowstable.cpp`, for x86 CPUs with AVX2, FMA and F16C, holds float32 products (over fp32 weights,
over Q4_1 / Q8_0 blocks in gguf_blocks' K-major layout with the same numbers, or straight over a
GGUF tensor's own bytes of any type in GGUF_TYPES: gguf_linear, gguf_linear_cat for several tensors
side by side, gguf_rows for embedding rows, and their 8-bit-activation forms gguf_linear_q8 /
gguf_linear_cat_q8, and q4_1_linear_q8 / q8_0_linear_q8 over Q4_0 / Q4_1 / Q8_0 blocks repacked
in groups of 16 outputs), RMS norm, rotation + cache write + attention and attention, each output
computed the same way however many rows share the call, so that a verified token gets bit for bit
the numbers of decoding it alone. `rowstable_ops()` compiles it once per machine with the system's
C++ compiler against the installed torch (OpenMP threads: the library links libgomp.so.1 by name,
which resolves to the copy torch has already loaded, so both share one thread pool), caches the
build under a folder the caller names (the loader uses ~/.cache/specdec/kernels) and loads it as
`torch.ops.specdec_rs` (its parallel calls on OpenMP's team, or on the kernels' own thread pool
while specdec.threads finds cores shared with other processes); it returns None, and
`rowstable_unavailable()` says why, where the kernels
cannot run (no AVX2 / FMA / F16C, no compiler, a failed build, SPECDEC_ROWSTABLE=0). Where the CPU
has AVX-512 VNNI, VL and BW it is built with those too, and its 8-bit-activation integer dot
products run on VNNI, and its products of several rows (verification steps) on 512-bit registers
two weight rows at a time, with the AVX2 build's numbers bit for bit (`rowstable_isa()` says which
build; SPECDEC_ROWSTABLE=avx2 forces the AVX2 one).

`GGUF_TYPES`, `row_bytes()` and `check_gguf_tensor()` describe and check the tensors gguf_linear
and gguf_rows read, raising SpecdecError for a type they do not read or a size that does not fit;
`gguf_act8()`, `act8_slices()` and `act8_error_bound()` describe the 8-bit-activation path.

This module knows nothing about models or files other than its own source and build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specdec import threads
from specdec.types import SpecdecError

_lock = threading.Lock()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_flags(torch_dir: Path, isa: list[str]) -> list[str]:
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    # -ffp-contract=off: a product and a sum written as two operations stay two roundings (GCC would
    # fuse them into one FMA, and the rotation would no longer give the Python path's numbers)
    return ["-O3", "-std=gnu++17", "-shared", "-fPIC", "-fopenmp", "-w", "-ffp-contract=off", *isa,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]


def _build(cache_dir: Path, quiet: bool, source: Path, isa: list[str], what: str = "the kernels") -> Path:
    """The compiled library of `source` (built now if this machine has none for this source and torch)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    torch_dir = Path(torch.__file__).resolve().parent
    flags = _build_flags(torch_dir, isa)
    key = hashlib.sha256(source.read_bytes() + " ".join([cxx, torch.__version__, sys.version, *flags]).encode())
    out_dir = cache_dir / key.hexdigest()[:16]
    lib = out_dir / f"{source.stem}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"[specdec] building {what} once (~10 s) ...", file=sys.stderr, flush=True)
    tmp = out_dir / f"{source.stem}.{os.getpid()}.so"
    res = subprocess.run([cxx, str(source), "-o", str(tmp), *flags], capture_output=True, text=True)
    if res.returncode != 0 or not tmp.is_file():
        lines = (res.stderr or res.stdout).strip().splitlines()
        errors = [ln for ln in lines if "error" in ln] or lines[-3:]
        raise RuntimeError(f"{Path(cxx).name} failed: {' / '.join(errors[:3])[:300]}")
    os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


def _load_once(state: dict, switch: str, flags: set[str], lacks: str, build, namespace: str, what: str):
    """Load a kernel library once per process: state holds "ops" (the torch.ops namespace) or
    "why" (the reason there is none: the switch environment variable set to 0, CPU flags missing,
    or a build or load that failed); build() returns the library's path."""
    with _lock:
        if "ops" in state or "why" in state:
            return state.get("ops")
        why = None
        if os.environ.get(switch, "1") == "0":
            why = f"{switch}=0"
        elif platform.machine() not in ("x86_64", "AMD64") or not flags <= _cpu_flags():
            why = lacks
        if why is None:
            try:
                torch.ops.load_library(str(build()))
                state["ops"] = getattr(torch.ops, namespace)
                return state["ops"]
            except (RuntimeError, OSError) as e:
                why = f"{what} could not be built or loaded ({e})"
        state["why"] = why
        return None


ROWSTABLE_SOURCE = Path(__file__).with_name("rowstable.cpp")
ROWSTABLE_FLAGS = {"avx2", "fma", "f16c"}
ROWSTABLE_VNNI_FLAGS = ROWSTABLE_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
# compiler flags of the two builds of rowstable.cpp, by rowstable_isa()
ROWSTABLE_ISA = {"avx2": ["-mavx2", "-mfma", "-mf16c"],
                 "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]}
_rs_state: dict = {}


def rowstable_isa() -> str:
    """Which build of rowstable.cpp rowstable_ops() loads here: "avx512vnni" where the CPU has
    AVX-512 VNNI, VL and BW (the 8-bit-activation integer dot products on _mm256_dpbusd_epi32), else
    "avx2" (_mm256_maddubs_epi16 + _mm256_madd_epi16); the two give the same numbers bit for bit.
    SPECDEC_ROWSTABLE=avx2 takes the AVX2 build on any CPU (for comparisons and tests)."""
    if os.environ.get("SPECDEC_ROWSTABLE", "1") != "avx2" and ROWSTABLE_VNNI_FLAGS <= _cpu_flags():
        return "avx512vnni"
    return "avx2"


def rowstable_ops(cache_dir: Path, quiet: bool = True):
    """torch.ops.specdec_rs (linear, gguf_linear, gguf_linear_cat, gguf_rows, rms_norm, attend,
    rope_attend, silu_mul: float32 kernels whose every output number is computed the same way
    however many rows share the call; see rowstable.cpp), for x86 CPUs with AVX2, FMA and F16C
    (AVX-512 CPUs included; the build rowstable_isa() names); None where these cannot run
    (`rowstable_unavailable()` says why: no AVX2/FMA/F16C, no compiler, a failed build,
    SPECDEC_ROWSTABLE=0). Built once into cache_dir (each build under its own key)."""
    ops = _load_once(_rs_state, "SPECDEC_ROWSTABLE", ROWSTABLE_FLAGS,
                     "this CPU lacks AVX2, FMA and F16C (the row-stable kernels need all three)",
                     lambda: _build(Path(cache_dir), quiet, ROWSTABLE_SOURCE, ROWSTABLE_ISA[rowstable_isa()],
                                    "the row-stable float32 kernels"),
                     "specdec_rs", "the row-stable kernels")
    if ops is not None and not _rs_state.get("pool"):
        # their own thread pool, which the thread governor switches on where cores are shared: its
        # workers then spin 20 us, the best spin beside busy processes
        _rs_state["pool"] = True
        threads.use_kernel_pool(lambda on, n: ops.set_kernel_pool(int(on), 20, n))
    return ops


def loaded_rowstable_ops():
    """torch.ops.specdec_rs where rowstable_ops() has loaded it in this process, else None (never
    builds: for helpers such as argmax that take the kernels only where a model already did)."""
    return _rs_state.get("ops")


def rowstable_unavailable() -> str | None:
    """Why rowstable_ops() returned None (None if not called or loaded)."""
    return _rs_state.get("why")


class GgufType(NamedTuple):
    """A ggml tensor type the row-stable kernels read: its id in GGUF files, weights and bytes a block."""

    id: int
    block_size: int
    block_bytes: int


# ggml type ids (gguf.GGMLQuantizationType's values) of the types gguf_linear / gguf_rows read
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
GGUF_TYPES: dict[str, GgufType] = {
    "F32": GgufType(F32, 1, 4), "F16": GgufType(F16, 1, 2), "BF16": GgufType(BF16, 1, 2),
    "Q4_0": GgufType(Q4_0, 32, 18), "Q4_1": GgufType(Q4_1, 32, 20), "Q5_0": GgufType(Q5_0, 32, 22),
    "Q5_1": GgufType(Q5_1, 32, 24), "Q8_0": GgufType(Q8_0, 32, 34), "Q4_K": GgufType(Q4_K, 256, 144),
    "Q5_K": GgufType(Q5_K, 256, 176), "Q6_K": GgufType(Q6_K, 256, 210),
}
_BY_ID = {t.id: (name, t) for name, t in GGUF_TYPES.items()}


def gguf_act8() -> bool:
    """Whether GGUF models multiply their quantised matrices with 8-bit activations and integer dot
    products (gguf_linear_q8 / gguf_linear_cat_q8, and q4_1_linear_q8 / q8_0_linear_q8 over the
    repacked blocks of Q4_0 / Q4_1 / Q8_0 projections, the default model's; as llama.cpp does): the
    default, 2-2.5x faster a K-quant product on one thread than the float path, a step of several
    tokens ~2x cheaper on the default model, and still row-stable, so greedy speculation
    stays exact. SPECDEC_GGUF_ACT8=0 keeps the float path (gguf_linear: bit for bit the float product
    over gguf's dequantised weights). F32 / F16 / BF16 compute the same on both."""
    return os.environ.get("SPECDEC_GGUF_ACT8", "1") != "0"


# the activations' slice width on gguf_linear_q8's integer path, by ggml type (others: float path)
ACT8_SLICE = {Q4_K: 256, Q5_K: 256, Q6_K: 256, Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32}


def act8_slices(x: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(x rounded as gguf_linear_q8 rounds it, the rounding step of each element), float64 [M, K]:
    each `width`-wide slice of a row scaled by d = max|x| / 127 (float32, as the kernel computes it),
    rounded to the nearest integer (ties to even) and scaled back. An independent statement of the
    kernel's rounding, for the tests and check_sampled_rows."""
    x32 = np.asarray(x, dtype=np.float32)
    m, k = x32.shape
    s = x32.reshape(m, k // width, width)
    amax = np.abs(s).max(axis=2, keepdims=True)
    d = amax / np.float32(127.0)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(s * inv)
    xq = (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)
    return xq, np.broadcast_to(d.astype(np.float64), s.shape).reshape(m, k)


def act8_error_bound(x: np.ndarray, w: np.ndarray, ggml_type: int) -> np.ndarray:
    """[M, N] bound of |gguf_linear_q8(x, W) - x @ W.T| for W of a type in ACT8_SLICE (w: its
    dequantised float64 rows): the activations' rounding, |x - x8| <= d / 2 each, times |w|, plus
    float32 rounding of the block sums (1e-4 of sum |x8| |w|: the integer sums are exact, a few float
    operations a block)."""
    xq, d = act8_slices(x, ACT8_SLICE[ggml_type])
    aw = np.abs(w)
    return 0.5 * (d @ aw.T) * (1 + 1e-6) + 1e-4 * (np.abs(xq) @ aw.T) + 1e-30


def gguf_type_name(ggml_type: int) -> str:
    """The name of ggml type id `ggml_type` ("Q4_K"; gguf's name, or "type N", for one not in GGUF_TYPES)."""
    if ggml_type in _BY_ID:
        return _BY_ID[ggml_type][0]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type {ggml_type}"


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one k-weight row of type `ggml_type` in a GGUF file; SpecdecError for a type the
    kernels do not read or a k that is not whole blocks."""
    if ggml_type not in _BY_ID:
        raise SpecdecError(
            f"GGUF tensors of type {gguf_type_name(ggml_type)} are not supported (supported: "
            f"{', '.join(GGUF_TYPES)}); convert the model to one of these, e.g. with llama.cpp's llama-quantize")
    name, t = _BY_ID[ggml_type]
    if k <= 0 or k % t.block_size:
        raise SpecdecError(f"a {name} row holds whole blocks of {t.block_size} weights; a row of {k} does not")
    return k // t.block_size * t.block_bytes


def check_gguf_tensor(raw: torch.Tensor, ggml_type: int, n: int, k: int, what: str = "tensor") -> None:
    """SpecdecError unless `raw` holds exactly the bytes of an [n, k] tensor of type `ggml_type` as
    uint8 (what gguf_linear(x, raw, ggml_type, n, k) and gguf_rows read); `what` names it."""
    need = n * row_bytes(ggml_type, k)
    if raw.dtype != torch.uint8 or raw.numel() != need:
        raise SpecdecError(
            f"{what}: a {gguf_type_name(ggml_type)} [{n}, {k}] tensor takes {need} bytes, but the file gives "
            f"{raw.numel()} {raw.dtype} elements; the GGUF file is truncated or corrupt")
