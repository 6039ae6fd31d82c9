"""Text to packed rows of tokens, one core each: gpufeed's token loader tokenizing on the fly
(`gpufeed bench --tokens FILE --tokenizer ... --workers 1`) against what a `datasets` user
writes: `load_dataset("parquet")`, `.map(tokenize, batched=True)` with the same tokenizer.json
as a `PreTrainedTokenizerFast` (the EOS appended to every document, as gpufeed does), then
`.map(group_texts, batched=True)` cutting the ids into rows of SEQ_LEN + 1 as transformers'
`run_clm.py` does. One core each: `--workers 1` for gpufeed, `num_proc=1` and
`TOKENIZERS_PARALLELISM=false` / `RAYON_NUM_THREADS=1` for `datasets`; its cache is disabled
so that every round tokenizes. Tokens/s = the corpus's tokens over the wall time from the
open to the last row (gpufeed: the bench's whole first epoch, start-up included).

Usage: python text_vs_datasets_map.py GPUFEED_BIN CORPUS.parquet TOKENIZER_DIR [ROUNDS]
"""

import json
import os
import re
import subprocess
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

import datasets  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

SEQ_LEN = 2048
binary, corpus, tokenizer_dir = sys.argv[1], sys.argv[2], sys.argv[3]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
datasets.disable_caching()


def gpufeed_round() -> dict:
    cmd = [binary, "bench", "--tokens", corpus, "--tokenizer", tokenizer_dir, "--text-field", "text",
           "--workers", "1", "--batch-size", "8", "--seq-len", str(SEQ_LEN), "--epochs", "1",
           "--no-shuffle"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    out = p.stdout + p.stderr
    tokens = int(re.search(r"rows, (\d+) tokens in", out).group(1))
    first = float(re.search(r"first batch:\s+([\d.]+) ms", out).group(1))
    return {"tokens": tokens, "wall_s": wall, "first_batch_ms": first, "tokens_per_s": tokens / wall}


def datasets_round() -> dict:
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokenizer_dir, "tokenizer.json"))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    t0 = time.perf_counter()
    ds = datasets.load_dataset("parquet", data_files=corpus, split="train")

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tok(batch["text"])["input_ids"]]}

    def group_texts(batch):
        ids = [t for doc in batch["input_ids"] for t in doc]
        n = len(ids) // (SEQ_LEN + 1) * (SEQ_LEN + 1)
        return {"input_ids": [ids[i : i + SEQ_LEN + 1] for i in range(0, n, SEQ_LEN + 1)]}

    ids = ds.map(tokenize, batched=True, num_proc=1, remove_columns=ds.column_names)
    tokens = sum(len(x) for x in ids["input_ids"])
    rows = ids.map(group_texts, batched=True, batch_size=1000, num_proc=1)
    rows.with_format("numpy")[: len(rows)]
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "rows": len(rows), "wall_s": wall, "tokens_per_s": tokens / wall}


results = []
for r in range(rounds):
    g = gpufeed_round()
    d = datasets_round()
    results.append({"round": r, "gpufeed": g, "datasets_map": d, "ratio": g["tokens_per_s"] / d["tokens_per_s"]})
    print(json.dumps(results[-1]), flush=True)
