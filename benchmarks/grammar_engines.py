"""Grammar engines for structured output, side by side: xgrammar, llguidance, outlines-core.

For each engine and each vocabulary (the default model's SmolLM2, 49k tokens; Qwen2.5's, 152k,
from the bench pair's GGUF when it is in specdec's cache), it measures
- the tokenizer set-up (once per vocabulary),
- the compile time of each schema (the JSON-schema extraction dev set's schemas, and any JSON),
- the time of one token mask along a valid answer (the schema's example, tokenised as the model
  would write it): the mask at each position, then the token consumed; median and p95 per token,
- and a rollback of the whole answer (what a rejected speculative guess costs).
Engines run interleaved, one schema at a time, each from its own folder of `--engines-dir`
(`pip install --no-deps --target DIR/NAME`), so that an engine missing from the environment can
still be measured; an engine that fails a schema is reported as such.

    python benchmarks/grammar_engines.py --engines-dir /tmp/gw   # t-xgrammar, t-llguidance, t-outlines-core

Prints a table and, as the last line, one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

QWEN = Path.home() / ".cache/specdec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def tokenizers() -> dict:
    from specdec.models.gguf_file import GGUFFile
    from specdec.models.loader import cache_root, default_model_path
    from specdec.models.tokenizer import gguf_tokenizer

    out = {"smollm2-49k": gguf_tokenizer(GGUFFile(default_model_path()), cache_root() / "tokenizers", quiet=True)}
    if QWEN.is_file():
        out["qwen2.5-152k"] = gguf_tokenizer(GGUFFile(QWEN), cache_root() / "tokenizers", quiet=True)
    return out


def cases(limit: int) -> list[tuple[str, dict | None, object]]:
    """(name, schema or None for any JSON, a valid answer) from the extraction dev set."""
    rows = [json.loads(line) for line in (HERE / "data" / "json_extraction.jsonl").read_text().splitlines() if line]
    out = [("json_object", None, rows[0]["answer"])]
    out += [(r["id"], r["schema"], r["answer"]) for r in rows[:limit]]
    return out


def _bytes_of_token(tok, i: int) -> bytes:
    """A token's bytes as the model writes them (byte-level BPE: GPT-2's byte alphabet)."""
    piece = tok._tk.id_to_token(i)
    if piece is None:
        return b""
    table = _unicode_to_byte()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode("utf-8")


_U2B: dict | None = None


def _unicode_to_byte() -> dict:
    global _U2B
    if _U2B is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _U2B = {chr(c): b for b, c in zip(bs, cs)}
    return _U2B


class LLGuidance:
    name = "llguidance"

    def setup(self, tok, vocab: int, eos: int):
        import llguidance
        import numpy as np

        self.mod = llguidance
        self.tok = llguidance.LLTokenizer(tok._tk.to_str(), n_vocab=vocab, eos_token=eos)
        self.mask = np.zeros((vocab + 31) // 32, dtype=np.int32)  # (llguidance.torch costs a torch.compile)

    def compile(self, schema):
        g = self.mod.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                        defaults={"whitespace_flexible": False, "item_separator": ", ",
                                                                  "key_separator": ": "})
        m = self.mod.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def step(self, m, token: int) -> float:
        t = time.perf_counter()
        m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        dt = time.perf_counter() - t
        if not m.consume_token(token):
            raise RuntimeError(m.get_error())
        return dt

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


class XGrammar:
    name = "xgrammar"

    def setup(self, tok, vocab: int, eos: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tok._tk, eos_token=tok.eos_token)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        if schema is None:
            c = self.compiler.compile_builtin_json_grammar()
        else:
            c = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        return self.xgr.GrammarMatcher(c, max_rollback_tokens=200)

    def step(self, m, token: int) -> float:
        t = time.perf_counter()
        m.fill_next_token_bitmask(self.mask)
        dt = time.perf_counter() - t
        if not m.accept_token(token):
            raise RuntimeError("token refused")
        return dt

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


class OutlinesCore:
    name = "outlines-core"

    def setup(self, tok, vocab: int, eos: int):
        import outlines_core as oc
        import torch

        self.oc = oc
        words: dict[bytes, list[int]] = {}
        special = {t.content for t in tok._tk.get_added_tokens_decoder().values() if t.special}
        for i in range(len(tok)):
            piece = tok._tk.id_to_token(i)
            if i == eos or piece is None or piece in special:
                continue
            words.setdefault(_bytes_of_token(tok, i), []).append(i)
        self.vocab = oc.Vocabulary(eos, words)
        self.mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema if schema is not None else {"type": "object"}))
        return self.oc.Guide(self.oc.Index(regex, self.vocab), max_rollback=200)

    def step(self, m, token: int) -> float:
        t = time.perf_counter()
        m.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)
        dt = time.perf_counter() - t
        m.advance(token, return_tokens=False)
        return dt

    def rollback(self, m, n: int) -> None:
        m.rollback_state(n)


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def install_size(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines-dir", default=None, help="DIR with t-xgrammar, t-llguidance, t-outlines-core "
                                                         "(pip install --no-deps --target); default: the environment")
    ap.add_argument("--schemas", type=int, default=8, help="dev-set schemas to compile (default 8)")
    ap.add_argument("--engines", default="xgrammar,llguidance,outlines-core")
    args = ap.parse_args()
    names = args.engines.split(",")
    if args.engines_dir:
        for n in names:
            sys.path.insert(0, str(Path(args.engines_dir) / f"t-{n}"))
    report: dict = {"cpu": _cpu(), "load": os.getloadavg()[0], "engines": {}}
    for n in names:
        t = time.perf_counter()
        __import__({"outlines-core": "outlines_core"}.get(n, n))
        info = {"import_s": time.perf_counter() - t}
        if args.engines_dir:
            info["install_mib"] = install_size(Path(args.engines_dir) / f"t-{n}")
        report["engines"][n] = info
    rows = []
    for vname, tok in tokenizers().items():
        vocab, eos = len(tok), tok.eos_token_id
        engines = {}
        for n in names:
            e = ENGINES[n]()
            t = time.perf_counter()
            e.setup(tok, vocab, eos)
            engines[n] = e
            report["engines"][n][f"setup_s[{vname}]"] = time.perf_counter() - t
        for cname, schema, answer in cases(args.schemas):
            ids = tok.encode(json.dumps(answer, ensure_ascii=False), add_special_tokens=False) + [eos]
            for n, e in engines.items():
                row = {"vocab": vname, "case": cname, "engine": n, "tokens": len(ids)}
                try:
                    t = time.perf_counter()
                    m = e.compile(schema)
                    row["compile_ms"] = 1e3 * (time.perf_counter() - t)
                    times = [e.step(m, i) for i in ids[:-1]]
                    row["mask_us_median"] = 1e6 * statistics.median(times)
                    row["mask_us_p95"] = 1e6 * sorted(times)[int(0.95 * (len(times) - 1))]
                    t = time.perf_counter()
                    e.rollback(m, len(ids) - 1)
                    row["rollback_us"] = 1e6 * (time.perf_counter() - t)
                except Exception as err:  # noqa: BLE001 - an engine that cannot do a schema is a result
                    row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
                rows.append(row)
    report["rows"] = rows
    print(f"{'vocab':13} {'case':18} {'engine':14} {'compile ms':>10} {'mask us med':>11} {'p95':>8} {'rollback us':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['vocab']:13} {r['case']:18} {r['engine']:14} error: {r['error']}")
            continue
        print(f"{r['vocab']:13} {r['case']:18} {r['engine']:14} {r['compile_ms']:10.1f} {r['mask_us_median']:11.1f} "
              f"{r['mask_us_p95']:8.1f} {r['rollback_us']:11.1f}")
    for n, info in report["engines"].items():
        print(n, " ".join(f"{k} {v:.2f}" for k, v in info.items()))
    print(json.dumps(report))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
