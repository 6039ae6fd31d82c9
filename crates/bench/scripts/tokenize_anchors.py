#!/usr/bin/env python3
"""The Python anchors of benches/tokenize.rs, on one core, on the same documents and fixtures.

    RAYON_NUM_THREADS=1 python crates/bench/scripts/tokenize_anchors.py DATA [ROUNDS]

DATA is what python/run-tests.sh (or tokenize.sh) made: DATA/fixtures/{gpt2,llama3-style} and
DATA/corpus/corpus.jsonl. For each fixture and round, every engine over every document, one
thread, interleaved, in M tokens/s (and MB/s of text):

  tokenizers-encode   Python `tokenizers`: encode(text) per document
  tokenizers-batch    encode_batch(docs), its rayon pool held to one thread
  tiktoken            tiktoken.Encoding with the same ranks and regex: encode_ordinary per document
  gigatoken-batch     gigatoken.Tokenizer(tokenizer.json).encode_batch(docs, parallel=False)
  gigatoken-jsonl     gigatoken's encode_files over the same documents as JSONL, parallel=False
  (gigatoken only if it imports: `pip install gigatoken`)

Round 0 checks every engine's ids against tokenizers-encode (tiktoken's and gigatoken's without
the BOS the Llama-3-style template adds, which they do not). Each timed pass builds its engine
anew (untimed), so no pass profits from an earlier one's cache.
"""

import base64
import json
import os
import sys
import time

import tiktoken
from tokenizers import Tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "python", "tests"))
from tokenizer_fixtures.make_fixtures import (  # noqa: E402
    GPT2_PATTERN_TIKTOKEN, LLAMA3_PATTERN, parse_tiktoken)

try:
    import gigatoken
except ImportError:
    gigatoken = None


def tiktoken_of(name, cache):
    """(tiktoken.Encoding of the fixture, the ids its template puts first)."""
    if name == "gpt2":
        ranks = parse_tiktoken(open(os.path.join(cache, "gpt2.tiktoken"), "rb").read())
        return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN_TIKTOKEN, mergeable_ranks=ranks,
                                 special_tokens={}), []
    tk = json.load(open(os.path.join(cache, "tekken_240911.json")))
    n = tk["config"]["default_vocab_size"] - tk["config"]["default_num_special_tokens"]
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in tk["vocab"][:n]}
    return tiktoken.Encoding("llama3-style", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                             special_tokens={}), [n]


def main():
    data, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with open(os.path.join(data, "corpus", "corpus.jsonl"), encoding="utf-8") as f:
        next(f)
        docs = [json.loads(line)["text"] for line in f]
    nbytes = sum(len(d.encode()) for d in docs)
    # The same documents as plain JSONL, for gigatoken's file reader.
    jsonl = os.path.join(data, "corpus", "bench.jsonl")
    if not os.path.exists(jsonl):
        with open(jsonl, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    cache = os.path.join(data, "fixtures", "_cache")
    for name in ["gpt2", "llama3-style"]:
        path = os.path.join(data, "fixtures", name, "tokenizer.json")
        enc, bos = tiktoken_of(name, cache)
        fresh = {}

        def giga(kind):
            t = fresh.pop(kind)
            if kind == "batch":
                return t.encode_batch(docs, parallel=False)
            return t.encode_files(gigatoken.JsonlFileSource([jsonl]), parallel=False)

        engines = {
            "tokenizers-encode": lambda: [tok.encode(d).ids for d in docs],
            "tokenizers-batch": lambda: [e.ids for e in tok.encode_batch(docs)],
            "tiktoken": lambda: [bos + enc.encode_ordinary(d) for d in docs],
        }
        if gigatoken is not None:
            engines["gigatoken-batch"] = lambda: giga("batch")
            engines["gigatoken-jsonl"] = lambda: giga("jsonl")
        print(f"# {name}: {len(docs)} documents, {nbytes / 1e6:.2f} MB, one thread", flush=True)
        reference = None
        for r in range(rounds):
            for engine, run in engines.items():
                tok = Tokenizer.from_file(path)
                if engine.startswith("gigatoken"):
                    fresh[engine.split("-")[1]] = gigatoken.Tokenizer(path)
                t, c = time.perf_counter(), time.process_time()
                out = run()
                s, cpu = time.perf_counter() - t, time.process_time() - c
                if hasattr(out, "to_list"):  # gigatoken's awkward arrays
                    out = out.to_list()
                out = [list(map(int, x)) for x in out] if r == 0 else out
                ntok = sum(map(len, out))
                same = ""
                if r == 0:
                    if reference is None:
                        reference, same = out, "reference"
                    else:
                        bad = sum(a != b for a, b in zip(reference, out))
                        if bad and bos and engine.startswith("gigatoken"):
                            bad = sum(a[len(bos):] != b for a, b in zip(reference, out))
                            same = "(without the BOS) "
                        same += "same ids" if bad == 0 else f"{bad} documents DIFFER"
                print(f"round {r} {name} {engine:18} {ntok:>9} tokens {s:7.3f} s "
                      f"{ntok / s / 1e6:7.3f} M tokens/s {nbytes / s / 1e6:6.2f} MB/s "
                      f"cpu/wall {cpu / s:4.2f} {same}", flush=True)


if __name__ == "__main__":
    main()
