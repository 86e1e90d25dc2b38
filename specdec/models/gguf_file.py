"""A GGUF file read in place: its metadata, its tensors as views of a memory map, and checks.

`GGUFFile(path)` parses the header (metadata and tensor table) with a small reader of its own
(the `gguf` package's reader decodes every token string of the vocabulary into Python objects,
seconds for a 150k-token vocabulary; here the string arrays stay undecoded until the tokenizer
needs them) and maps the file copy-on-write, so each tensor is a zero-copy uint8 view of the
file's bytes (`raw(name)`: [rows, bytes a row]) that the page cache backs: nothing is dequantised
or copied. `model_config()` turns the metadata into the attributes the native model reads
(llama, which Mistral files also carry, mistral3 and qwen2; RoPE scaling linear, YaRN with
llama.cpp's log multiplier and attention factor, or Llama 3's frequency factors; the context cut
to where the model computes exactly: a sliding window, attention temperature scaling),
`check_tensor_names()` refuses a tensor the model would not read (a variant it does not compute),
`check_tensor()` checks that every block scale (and every value of a float tensor) is finite, and
`unsupported()` names tensors of a type the kernels do not read.

Errors are one line each (SpecdecError): not a GGUF file, a truncated file, an unsupported
architecture or tensor type, a corrupt block.

This module knows nothing about models, kernels or tokenizers beyond the metadata keys.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..types import SpecdecError

GGUF_MAGIC = b"GGUF"
# what the native model runs; llama.cpp writes Llama 2 / 3 and Mistral models as "llama" (q and k rows
# interleaved per head, Llama 3.1's rope_freqs), Ministral 3 as "mistral3" (llama's layers, YaRN,
# attention temperature scaling), Qwen2 / Qwen2.5 as "qwen2" (q/k/v bias, untied head)
ARCHITECTURES = ("llama", "mistral3", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# architectures whose files hold q and k rows interleaved per head (llama.cpp's rotary pairs neighbours)
INTERLEAVED_QK = ("llama", "mistral3")
# the transformers model type each architecture computes as (mistral3's text model is Mistral's layers)
MODEL_TYPES = {"llama": "llama", "mistral3": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3": "gemma3_text", "phi3": "phi3"}
# architectures whose sliding-window attention the model computes (models/families.py) rather than
# cutting the context at the window
WINDOWED = ("gemma2", "gemma3", "phi3")
# llama.cpp's Gemma settings the files do not carry: which layers slide (every layer whose index
# modulo the period is not period - 1), the sliding layers' RoPE base, the default window and caps
GEMMA = {"gemma2": dict(period=2, window=4096, attn_softcap=50.0, final_softcap=30.0, big_layers=46),
         "gemma3": dict(period=6, window=0, attn_softcap=0.0, final_softcap=0.0, big_layers=62, local_theta=10000.0)}
# llama.cpp's YaRN settings that this model computes as llama.cpp's defaults do (other values: refused)
YARN_DEFAULTS = {".rope.scaling.yarn_ext_factor": (1.0, -1.0), ".rope.scaling.yarn_attn_factor": (1.0,)}

# ggml type id -> (name, weights a block, bytes a block); the types the kernels read (kernels.GGUF_TYPES)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
SUPPORTED_TYPES = tuple(v[0] for v in GGML_TYPES.values())
# the layer tensors (blk.N.{name}.weight) an architecture has beyond llama's
LAYER_EXTRAS = {"qwen3": ["attn_q_norm", "attn_k_norm"], "gemma2": ["post_attention_norm", "post_ffw_norm"],
                "gemma3": ["attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"]}
# byte offsets of each block's float16 scales (d, and dmin / m where the type has one)
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

# metadata value types (GGUF spec): id -> struct format (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass
class StringArray:
    """A metadata array of strings left undecoded: `count` strings from byte `offset`."""

    buf: object
    offset: int
    count: int

    def decode(self) -> list[str]:
        out, off, buf = [], self.offset, self.buf
        for _ in range(self.count):
            (n,) = struct.unpack_from("<Q", buf, off)
            out.append(bytes(buf[off + 8: off + 8 + n]).decode("utf-8", errors="replace"))
            off += 8 + n
        return out


@dataclass
class TensorInfo:
    name: str
    type_name: str  # "Q4_K", ... or "type 23" for one this reader does not know
    type_id: int
    shape: tuple  # ggml order: shape[0] is the row length (K), shape[1] the rows (N)
    offset: int  # from the file's start
    n_bytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_length(self) -> int:
        return int(self.shape[0])


def _type_name(type_id: int) -> str:
    """ggml's name of a type this module does not read (for the error that says so)."""
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"ggml type {type_id}"


def _tensor_bytes(type_id: int, shape: tuple) -> int | None:
    t = GGML_TYPES.get(type_id)
    if t is None:
        return None
    n = int(np.prod(shape, dtype=np.int64))
    return n // t[1] * t[2]


class GGUFFile:
    """The file's metadata (`meta`: key -> value; string arrays as StringArray), its tensor table
    (`tensors`: name -> TensorInfo) and a copy-on-write memory map of its bytes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                if f.read(4) != GGUF_MAGIC:
                    raise SpecdecError(f"{self.path} is not a GGUF file (it does not start with the GGUF magic bytes)")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise SpecdecError(f"cannot read {self.path}: {e}") from None
        self.size = len(self._mm)
        self.bytes = np.frombuffer(self._mm, dtype=np.uint8)  # writable (copy on write): torch takes views of it
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            raise SpecdecError(f"{self.path} is truncated or its GGUF header is corrupt ({type(e).__name__}: {e}); "
                               "download the file again") from None
        self._check_extent()

    # -- header ----------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = memoryview(self._mm)
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise SpecdecError(f"{self.path}: GGUF version {version} is too old (2 or newer is read)")
        off = 24
        self.meta: dict = {}
        self.meta_spans: dict[str, tuple[int, int]] = {}  # key -> its entry's bytes (start, end)
        for _ in range(n_kv):
            start = off
            key, off = self._string(buf, off)
            (vtype,), off = struct.unpack_from("<I", buf, off), off + 4
            self.meta[key], off = self._value(buf, off, vtype)
            self.meta_spans[key] = (start, off)
        self.tensors: dict[str, TensorInfo] = {}
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(buf, off)
            (nd,), off = struct.unpack_from("<I", buf, off), off + 4
            shape = struct.unpack_from(f"<{nd}Q", buf, off)
            off += 8 * nd
            ttype, rel = struct.unpack_from("<IQ", buf, off)
            off += 12
            infos.append((name, shape, ttype, rel))
        align = int(self.meta.get("general.alignment", 32))
        self.data_offset = (off + align - 1) // align * align
        for name, shape, ttype, rel in infos:
            t = GGML_TYPES.get(ttype)
            nbytes = _tensor_bytes(ttype, shape)
            self.tensors[name] = TensorInfo(name, t[0] if t else _type_name(ttype), ttype, tuple(int(s) for s in shape),
                                            self.data_offset + rel, nbytes if nbytes is not None else 0)

    @staticmethod
    def _string(buf, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, off)
        if off + 8 + n > len(buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(buf[off + 8: off + 8 + n]).decode("utf-8"), off + 8 + n

    def _value(self, buf, off: int, vtype: int):
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
        if vtype == 8:
            return self._string(buf, off)
        if vtype != 9:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype])
            end = off + count * dt.itemsize
            if end > len(buf):
                raise ValueError("an array runs past the end of the file")
            return np.frombuffer(self._mm, dtype=dt, count=count, offset=off), end
        if etype == 8:
            start = off
            for _ in range(count):  # skip, decode later (StringArray.decode)
                (n,) = struct.unpack_from("<Q", buf, off)
                off += 8 + n
            if off > len(buf):
                raise ValueError("a string array runs past the end of the file")
            return StringArray(self._mm, start, count), off
        values = []
        for _ in range(count):
            v, off = self._value(buf, off, etype)
            values.append(v)
        return values, off

    def _check_extent(self) -> None:
        for t in self.tensors.values():
            if t.offset + t.n_bytes > self.size:
                raise SpecdecError(f"{self.path} is truncated: tensor {t.name} needs bytes up to {t.offset + t.n_bytes:,} "
                                   f"but the file has {self.size:,}; download it again")

    # -- metadata ----------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def get(self, key: str, default=None):
        """meta[key] with `{arch}.` put in front of a key that starts with a dot."""
        return self.meta.get(self.architecture + key if key.startswith(".") else key, default)

    def tokenizer_digest(self) -> str:
        """sha256 of the tokenizer.* metadata entries' bytes: files that share a tokenizer share it."""
        import hashlib

        h = hashlib.sha256()
        for key in sorted(k for k in self.meta_spans if k.startswith("tokenizer.")):
            a, b = self.meta_spans[key]
            h.update(memoryview(self._mm)[a:b])
        return h.hexdigest()

    def strings(self, key: str) -> list[str] | None:
        v = self.meta.get(key)
        return v.decode() if isinstance(v, StringArray) else v

    # -- tensors -----------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as they lie in the file, [rows, bytes a row] (a view, no copy)."""
        t = self.tensors[name]
        return self.bytes[t.offset: t.offset + t.n_bytes].reshape(t.rows, -1)

    def release(self, view) -> None:
        """Give the pages under `view` (a slice of this file's bytes) back to the page cache
        (MADV_DONTNEED on the whole pages inside it); reading them again maps them back in."""
        a = view.numpy() if hasattr(view, "numpy") else view
        start = a.ctypes.data - self.bytes.ctypes.data
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
        if hi > lo and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def floats(self, name: str) -> np.ndarray:
        """A small float tensor (norm weights, biases) as float32 [n] (a copy)."""
        t = self.tensors[name]
        raw = self.bytes[t.offset: t.offset + t.n_bytes]
        if t.type_name == "F32":
            return raw.view(np.float32).copy()
        if t.type_name == "F16":
            return raw.view(np.float16).astype(np.float32)
        if t.type_name == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        raise SpecdecError(f"{self.path.name}: tensor {name} is {t.type_name}; a norm weight or bias must be F32, F16 "
                           "or BF16")

    def unsupported(self) -> list[TensorInfo]:
        """Tensors of a type the kernels do not read."""
        return [t for t in self.tensors.values() if t.type_id not in GGML_TYPES]

    def check_tensor(self, t: TensorInfo) -> None:
        """Raise if a block scale (or a value of a float tensor) of `t` is not finite. Vectorised:
        the scales are read as a strided column of the tensor's blocks."""
        raw = self.bytes[t.offset: t.offset + t.n_bytes]
        kind = t.type_name
        if kind == "F32":
            bad = ~np.isfinite(raw.view(np.float32))
        elif kind in ("F16", "BF16"):
            mask = 0x7C00 if kind == "F16" else 0x7F80
            bad = (raw.view(np.uint16) & mask) == mask
        else:
            blocks = raw.reshape(-1, GGML_TYPES[t.type_id][2])
            bad = np.zeros(blocks.shape[0], dtype=bool)
            for o in SCALE_OFFSETS[kind]:
                scale = np.ascontiguousarray(blocks[:, o: o + 2]).view(np.uint16)[:, 0]
                bad |= (scale & 0x7C00) == 0x7C00
        if bad.any():
            i = int(np.argmax(bad))
            what = "value" if kind in ("F32", "F16", "BF16") else "block"
            raise SpecdecError(f"{self.path.name} is corrupt: tensor {t.name} ({kind}) has a non-finite scale in "
                               f"{what} {i} ({int(bad.sum())} in all); download the file again")

    def check_architecture(self) -> str:
        """The architecture, or one line naming it if the native model does not run it."""
        arch = self.architecture
        if arch not in ARCHITECTURES:
            raise SpecdecError(f"{self.path.name}: architecture {arch!r} is not supported (supported: "
                               f"{', '.join(ARCHITECTURES)}; llama.cpp writes Mistral and Llama 3 models as llama, "
                               "Ministral 3 as mistral3, Phi-3 and Phi-4-mini as phi3)")
        return arch

    def model_config(self) -> SimpleNamespace:
        """The hyper-parameters as the attributes models.llama.LlamaConfig.from_hf reads."""
        arch = self.check_architecture()
        need = (".block_count", ".embedding_length", ".feed_forward_length", ".attention.head_count")
        missing = [arch + k for k in need if self.get(k) is None]
        if missing:
            raise SpecdecError(f"{self.path.name}: metadata lacks {', '.join(missing)}")
        D, H = int(self.get(".embedding_length")), int(self.get(".attention.head_count"))
        Hkv = self.get(".attention.head_count_kv", H)
        Hkv = int(Hkv if np.ndim(Hkv) == 0 else Hkv[0])
        head_dim = int(self.get(".attention.key_length", D // H))
        rot = int(self.get(".rope.dimension_count", head_dim))
        if rot != head_dim and arch != "phi3":
            raise SpecdecError(f"{self.path.name}: rotary embeddings over {rot} of {head_dim} dimensions a head "
                               f"(partial rotation) are not supported in {arch} files")
        family = self.family_config(arch, D, H, head_dim, rot)
        self.check_unread_settings(head_dim, family.get("query_pre_attn_scalar", head_dim))
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise SpecdecError(f"{self.path.name} has no token_embd.weight tensor")
        vocab = int(self.get(".vocab_size", embd.rows))
        theta = float(self.get(".rope.freq_base", 10000.0))
        rope = family.pop("rope_parameters", None) or self.rope_parameters(theta)
        self.check_tensor_names(int(self.get(".block_count")))
        context = int(self.get(".context_length", 2048))
        limit = self.exact_context()
        if limit is not None and limit[0] >= context:
            limit = None
        return SimpleNamespace(**{**dict(
            model_type=MODEL_TYPES[arch], vocab_size=vocab, hidden_size=D,
            intermediate_size=int(self.get(".feed_forward_length")),
            num_hidden_layers=int(self.get(".block_count")), num_attention_heads=H, num_key_value_heads=Hkv,
            head_dim=head_dim, rms_norm_eps=float(self.get(".attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta, rope_parameters=rope, hidden_act="silu",
            tie_word_embeddings="output.weight" not in self.tensors,
            max_position_embeddings=context if limit is None else limit[0], context_limit=limit,
            sliding_window=None,
            attention_bias=False, mlp_bias=False, use_sliding_window=False,
            bos_token_id=self.meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.meta.get("tokenizer.ggml.padding_token_id")), **family})

    def family_config(self, arch: str, D: int, H: int, head_dim: int, rot: int) -> dict:
        """The transformers config attributes of a Gemma or Phi-3 file that llama's do not have
        (models/families.config_from_hf reads them), as llama.cpp computes these files: Gemma's
        sliding layers (every one whose index modulo the period is not period - 1, or
        `attention.sliding_window_pattern`), its window, the sliding layers' RoPE base (10000),
        the scores' scale (1 / sqrt(head size), of hidden / heads for the 27B models), the caps
        (`attn_logit_softcapping`, `final_logit_softcapping`); Phi-3's partial rotation and LongRoPE
        (the short factors of rope_factors_short.weight, `rope.scaling.attn_factor`, the original
        context), its window. {} for the others."""
        out: dict = {}
        n_layers = int(self.get(".block_count"))
        if arch in GEMMA:
            g = GEMMA[arch]
            window = int(self.get(".attention.sliding_window", g["window"]) or 0)
            period = self.get(".attention.sliding_window_pattern", g["period"])
            if np.ndim(period):  # (one flag a layer: true where it slides)
                types = ["sliding_attention" if bool(f) else "full_attention" for f in np.asarray(period)]
            else:
                types = ["sliding_attention" if (i + 1) % int(period) else "full_attention" for i in range(n_layers)]
            out.update(hidden_activation="gelu_pytorch_tanh", sliding_window=window or None, layer_types=types,
                       query_pre_attn_scalar=D // H if n_layers == g["big_layers"] else head_dim,
                       attn_logit_softcapping=float(self.get(".attn_logit_softcapping", g["attn_softcap"])) or None,
                       final_logit_softcapping=float(self.get(".final_logit_softcapping", g["final_softcap"])) or None)
            if "local_theta" in g:
                theta = float(self.get(".rope.freq_base", 10000.0))
                out["rope_parameters"] = {"full_attention": self.rope_parameters(theta),
                                          "sliding_attention": {"rope_type": "default", "rope_theta": g["local_theta"]}}
        elif arch == "phi3":
            out.update(partial_rotary_factor=rot / head_dim, sliding_window=self.get(".attention.sliding_window"))
            if "rope_factors_short.weight" in self.tensors:
                theta = float(self.get(".rope.freq_base", 10000.0))
                orig = self.get(".rope.scaling.original_context_length")
                if orig is None:
                    raise SpecdecError(f"{self.path.name}: LongRoPE factors without "
                                       "phi3.rope.scaling.original_context_length")
                rope = {"rope_type": "longrope", "rope_theta": theta, "partial_rotary_factor": rot / head_dim,
                        "short_factor": self.floats("rope_factors_short.weight").tolist(),
                        "original_max_position_embeddings": int(orig),
                        "factor": int(self.get(".context_length", orig)) / int(orig)}
                if self.get(".rope.scaling.attn_factor") is not None:
                    rope["attention_factor"] = float(self.get(".rope.scaling.attn_factor"))
                out["rope_parameters"] = rope
        return out

    def rope_parameters(self, theta: float) -> dict:
        """transformers' rope_parameters for the file's `{arch}.rope.scaling.*` keys, computing what
        llama.cpp computes: none; linear (positions divided by the factor; also a factor without a
        type, and the older `{arch}.rope.scale_linear`); YaRN (factor, original
        context, beta_fast / beta_slow, and the cos/sin scale llama.cpp's context sets up: 1 + 0.1
        ln(factor), or with `yarn_log_multiplier` L that over 1 + 0.1 L ln(factor), as transformers'
        mscale = 1 / mscale_all_dim = L; times `attn_factor`). Llama 3's scaling is a tensor
        (rope_freqs.weight, gguf_model). Any other type, or a setting the model would not compute as
        llama.cpp does: one line."""
        rope = {"rope_type": "default", "rope_theta": theta}
        # as llama.cpp reads them: a factor without a type is linear, `rope.scale_linear` the older key
        stype = str(self.get(".rope.scaling.type", "linear"))
        factor = float(self.get(".rope.scaling.factor", self.get(".rope.scale_linear", 1.0)) or 1.0)
        attn_factor = float(self.get(".rope.scaling.attn_factor", 1.0))
        key = self.architecture + ".rope.scaling.type"
        if stype not in ("none", "linear", "yarn"):
            raise SpecdecError(f"{self.path.name}: RoPE scaling {stype!r} ({key}) is not supported; supported: "
                               "none, linear, yarn, and Llama 3's frequency factors (rope_freqs.weight)")
        if stype != "yarn" and attn_factor != 1.0:
            raise SpecdecError(f"{self.path.name}: {self.architecture}.rope.scaling.attn_factor = {attn_factor:g} "
                               f"with RoPE scaling {stype!r} is not supported (only with yarn)")
        if stype == "none" or factor == 1.0:
            if attn_factor != 1.0:
                raise SpecdecError(f"{self.path.name}: {self.architecture}.rope.scaling.attn_factor = "
                                   f"{attn_factor:g} with a YaRN factor of 1 is not supported")
            return rope
        rope.update(rope_type=stype, factor=factor)
        if stype == "yarn":
            orig = self.get(".rope.scaling.original_context_length")
            if orig is None:
                raise SpecdecError(f"{self.path.name}: YaRN RoPE scaling without "
                                   f"{self.architecture}.rope.scaling.original_context_length")
            rope["original_max_position_embeddings"] = int(orig)
            for k, name in ((".rope.scaling.yarn_beta_fast", "beta_fast"), (".rope.scaling.yarn_beta_slow", "beta_slow")):
                if self.get(k) is not None:
                    rope[name] = float(self.get(k))
            for k, allowed in YARN_DEFAULTS.items():
                v = self.get(k)
                if v is not None and float(v) not in allowed:
                    raise SpecdecError(f"{self.path.name}: YaRN with {self.architecture}{k} = {float(v):g} is not "
                                       f"supported (only {allowed[0]:g})")
            log_mul = float(self.get(".rope.scaling.yarn_log_multiplier", 0.0))
            if log_mul < 0:
                raise SpecdecError(f"{self.path.name}: YaRN with {self.architecture}.rope.scaling.yarn_log_multiplier "
                                   f"= {log_mul:g} is not supported (0 or more)")
            if log_mul != 0.0:  # (llama.cpp: mscale 1 over mscale_all_dim = the multiplier)
                rope.update(mscale=1.0, mscale_all_dim=log_mul)
            if attn_factor != 1.0:
                scale = 1.0 + 0.1 * math.log(factor)
                rope["attention_factor"] = attn_factor * (scale / (1.0 + 0.1 * log_mul * math.log(factor))
                                                          if log_mul != 0.0 else scale)
        return rope

    def exact_context(self) -> tuple[int, str] | None:
        """(tokens, why) where the native model's full causal attention stops computing the model the
        metadata describes, or None: a sliding window (`{arch}.attention.sliding_window`: keys past
        it would be masked; inside it full attention is the same), attention temperature scaling
        (`{arch}.attention.temperature_scale`, Llama 4 / Ministral 3: queries scaled by 1 + beta
        ln(1 + floor(position / floor_scale)), 1 below floor_scale, floor_scale llama.cpp's
        temperature_length or else the YaRN original context). model_config caps the context there,
        so a longer prompt or generation gets the context-length error instead of other numbers."""
        limits = []
        window = self.get(".attention.sliding_window")
        if window is not None and int(window) > 0 and self.architecture not in WINDOWED:
            limits.append((int(window), f"its sliding window ({self.architecture}.attention.sliding_window); "
                                        "specdec attends over the whole context"))
        temp = float(self.get(".attention.temperature_scale", 0.0) or 0.0)
        if "rope_factors_short.weight" in self.tensors and self.get(".rope.scaling.original_context_length"):
            limits.append((int(self.get(".rope.scaling.original_context_length")),
                           "LongRoPE's long factors take over past it (rope_factors_long.weight); specdec computes "
                           "the short ones"))
        if temp != 0.0:
            floor = self.get(".attention.temperature_length", self.get(".rope.scaling.original_context_length"))
            if floor is None or int(floor) <= 0:
                raise SpecdecError(f"{self.path.name}: attention temperature scaling "
                                   f"({self.architecture}.attention.temperature_scale = {temp:g}) without a "
                                   "temperature length or YaRN original context is not supported")
            limits.append((int(floor), f"attention temperature scaling ({self.architecture}.attention."
                                       f"temperature_scale) starts there; specdec does not compute it"))
        return min(limits) if limits else None

    def check_unread_settings(self, head_dim: int, scale_size: int) -> None:
        """Raise, naming the key, on metadata llama.cpp computes with for these architectures that
        the native model does not: experts (`expert_count`, Mixtral written as llama) and an
        attention scale other than 1 / sqrt(scale_size) (`attention.scale`; scale_size is the head
        size but in Gemma's 27B models)."""
        experts = int(self.get(".expert_count", 0) or 0)
        if experts > 0:
            raise SpecdecError(f"{self.path.name}: a mixture of experts ({self.architecture}.expert_count = {experts}) "
                               "is not supported")
        scale = self.get(".attention.scale")
        if scale is not None and float(scale) != 0.0 and not math.isclose(float(scale), scale_size ** -0.5,
                                                                          rel_tol=1e-6):
            raise SpecdecError(f"{self.path.name}: an attention scale of {float(scale):g} "
                               f"({self.architecture}.attention.scale; 1 / sqrt({scale_size}) = "
                               f"{scale_size ** -0.5:g} is what specdec computes) is not supported")

    def check_tensor_names(self, n_layers: int) -> None:
        """Raise, naming it, on a tensor the native model would not read (a bias or norm of an
        architecture variant it does not compute): ignoring it would give other numbers."""
        arch = self.architecture
        known = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
        layer = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
        layer += LAYER_EXTRAS.get(arch, [])
        if arch == "phi3":  # (q/k/v and gate/up fused; the LongRoPE factors)
            layer = [n for n in layer if n != "ffn_gate"] + ["attn_qkv"]
            known.update({"rope_factors_long.weight", "rope_factors_short.weight"})
        for i in range(n_layers):
            known.update(f"blk.{i}.{n}.weight" for n in layer)
            if arch == "qwen2":
                known.update(f"blk.{i}.attn_{n}.bias" for n in "qkv")
        extra = [n for n in self.tensors if n not in known]
        if extra:
            raise SpecdecError(f"{self.path.name}: tensor {extra[0]} ({len(extra)} such) is not part of the "
                               f"{arch} model specdec computes (a variant it does not support)")

    def eos_ids(self) -> list[int]:
        """End-of-text ids the metadata names (eos, end of turn, end of message)."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return sorted({int(self.meta[k]) for k in keys if k in self.meta})
