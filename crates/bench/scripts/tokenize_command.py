#!/usr/bin/env python3
"""`gpufeed tokenize` beside single-process Python doing the same work, on the same JSON lines.

    python crates/bench/scripts/tokenize_command.py DATA GPUFEED [COPIES] [ROUNDS] [WORKERS]

DATA is what python/run-tests.sh (or tokenize.sh) made: DATA/fixtures/{gpt2,llama3-style} and
DATA/corpus/corpus.jsonl; its documents, COPIES times over (default 10), become one JSON lines
file. GPUFEED is the command (a release build). For each fixture and round, interleaved:

  gpufeed            gpufeed tokenize FILE --tokenizer DIR -o PREFIX --workers WORKERS (default 2)
  tokenizers         one Python process: per line json.loads, Python `tokenizers` encode(text)
                     (rayon held to one thread), the EOS appended, np.array(ids, uint16 or int32)
                     written to a .bin: Megatron's preprocess_data.py work per document, with its
                     pool of one worker and without its imports (megatron-core needs torch)
  transformers       the same with transformers' AutoTokenizer: tokenizer(text).input_ids, the
                     call Megatron's HuggingFaceTokenizer makes

Round 0 checks that gpufeed's .bin holds the same tokens as the Python ones. Times are wall
clock of the whole run (the command's includes loading the tokenizer and indexing the file).
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
from tokenizers import Tokenizer


def python_run(path, directory, out, kind):
    if kind == "transformers":
        from transformers import AutoTokenizer
        t = AutoTokenizer.from_pretrained(directory)
        encode = lambda text: t(text).input_ids  # noqa: E731
        eos, size = t.eos_token_id, len(t)
    else:
        t = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        encode = lambda text: t.encode(text).ids  # noqa: E731
        config = json.load(open(os.path.join(directory, "tokenizer_config.json")))
        eos, size = t.token_to_id(config["eos_token"]), t.get_vocab_size()
    dtype = np.uint16 if size < 65500 else np.int32
    tokens = 0
    with open(path, encoding="utf-8") as f, open(out, "wb") as o:
        for line in f:
            ids = encode(json.loads(line)["text"])
            if ids:
                ids.append(eos)
            o.write(np.array(ids, dtype=dtype).tobytes())
            tokens += len(ids)
    return tokens


def main():
    data, gpufeed = sys.argv[1], sys.argv[2]
    copies = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    workers = sys.argv[5] if len(sys.argv) > 5 else "2"
    with open(os.path.join(data, "corpus", "corpus.jsonl"), encoding="utf-8") as f:
        next(f)
        docs = [json.loads(line)["text"] for line in f]
    work = os.path.join(data, "command")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, f"corpus-x{copies}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            for d in docs:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    nbytes = sum(len(d.encode()) for d in docs) * copies
    print(f"# {len(docs) * copies} documents, {nbytes / 1e6:.1f} MB of text, gpufeed with "
          f"{workers} threads, Python on one", flush=True)
    for name in ["gpt2", "llama3-style"]:
        directory = os.path.join(data, "fixtures", name)
        for r in range(rounds):
            for kind in ["gpufeed", "tokenizers", "transformers"]:
                out = os.path.join(work, f"{name}-{kind}")
                t = time.perf_counter()
                if kind == "gpufeed":
                    done = subprocess.run(
                        [gpufeed, "tokenize", path, "--tokenizer", directory, "-o", out,
                         "--workers", workers, "--force", "--format", "nanogpt"],
                        capture_output=True, text=True, check=True)
                    tokens = int(done.stdout.split(" into ")[1].split()[0])
                else:
                    tokens = python_run(path, directory, out + ".bin", kind)
                s = time.perf_counter() - t
                same = ""
                if r == 0 and kind != "gpufeed":
                    # gpufeed's nanoGPT file holds uint32 above 65,536 tokens, Python's int32.
                    a = np.fromfile(os.path.join(work, f"{name}-gpufeed.bin"),
                                    dtype=np.uint16 if name == "gpt2" else np.uint32)
                    b = np.fromfile(out + ".bin", dtype=np.uint16 if name == "gpt2" else np.int32)
                    same = "same tokens as gpufeed" if np.array_equal(a, b) else "TOKENS DIFFER"
                print(f"round {r} {name:12} {kind:12} {tokens:>10} tokens {s:7.2f} s "
                      f"{tokens / s / 1e6:6.2f} M tokens/s {nbytes / s / 1e6:6.2f} MB/s {same}",
                      flush=True)


if __name__ == "__main__":
    main()
