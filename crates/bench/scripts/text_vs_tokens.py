"""Tokens per second of gpufeed.TokenLoader over text tokenized on the fly (tokenizer=, JSON
lines) against the same corpus pre-tokenized (a Megatron uint16 dataset written from the same
ids), concatenated rows, shuffled, one epoch of the pre-tokenized rows each.

The corpus is the tokenizer tests' (python/tests/tokenizer_fixtures/make_corpus.py: Debian man
pages in ten languages) repeated REPEAT times; the tokenizer is their GPT-2 fixture.
Usage: python text_vs_tokens.py CACHE_DIR [REPEAT] [WORKERS]   (CACHE_DIR: target/tokenizer-tests)
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

import gpufeed

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "python" / "tests"))
from tokenizer_fixtures import make_corpus, make_fixtures  # noqa: E402

cache = Path(sys.argv[1])
repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 8
workers = int(sys.argv[3]) if len(sys.argv) > 3 else 2
gpt2 = Path(make_fixtures.make(str(cache / "fixtures"))) / "gpt2"
docs = make_corpus.documents(make_corpus.make(str(cache / "corpus"))) * repeat
out = cache / "text-vs-tokens"
out.mkdir(exist_ok=True)
jsonl = out / "corpus.jsonl"
with open(jsonl, "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
tok = gpufeed.Tokenizer(gpt2)
ids = [tok.encode(d) for d in docs]
lengths = np.array([len(i) for i in ids], dtype=np.int32)
np.concatenate([np.array(i, dtype=np.uint16) for i in ids]).tofile(out / "corpus.bin")
with open(out / "corpus.idx", "wb") as f:
    n = len(ids)
    f.write(b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + bytes([8]))
    f.write(np.uint64(n).tobytes() + np.uint64(n + 1).tobytes())
    f.write(lengths.tobytes())
    f.write((np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * 2).astype(np.int64).tobytes())
    f.write(np.arange(n + 1, dtype=np.int64).tobytes())
tokens = int(lengths.sum())
seq_len, batch = 1024, 16
rows = -(-tokens // seq_len)
print(f"corpus: {len(docs)} documents, {jsonl.stat().st_size / 1e6:.1f} MB of JSON lines, "
      f"{tokens} tokens (GPT-2), {rows} rows of {seq_len}; {workers} workers; engine: {tok.engine}")
for name, source, extra in [
    ("pre-tokenized (Megatron uint16)", out / "corpus.idx", {}),
    ("text (JSON lines, tokenized on the fly)", jsonl, {"tokenizer": gpt2}),
]:
    t0 = time.perf_counter()
    loader = gpufeed.TokenLoader(source, seq_len=seq_len, batch_size=batch, shuffle=0,
                                 samples_per_epoch=rows, workers=workers, output="numpy", **extra)
    built = time.perf_counter() - t0
    first = None
    got = 0
    for b in loader:
        if first is None:
            first = time.perf_counter() - t0
        got += int((np.asarray(b["document_ids"]) != -1).sum())
    s = time.perf_counter() - t0
    print(f"{name}: built in {built * 1e3:.0f} ms, first batch {first * 1e3:.0f} ms, "
          f"{got} tokens in {s:.2f} s: {got / s / 1e6:.2f} M tokens/s")
