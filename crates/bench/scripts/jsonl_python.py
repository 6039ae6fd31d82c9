#!/usr/bin/env python3
"""Python's json.loads per line over the files `cargo bench --bench jsonl` writes
(target/jsonl-bench/), taking the same fields as the bench's `get` passes: `text` as UTF-8
bytes for the text files, every field for numbers.jsonl (ints and floats packed little-endian,
the list of floats as f64 values), the way a Python data set's __getitem__ would before a
collate.

    python3 crates/bench/scripts/jsonl_python.py [DIR]   (default: target/jsonl-bench)

Each file is read into memory once (its lines split), then 5 passes, the median printed.
"""

import json
import os
import struct
import sys
import time

DIR = sys.argv[1] if len(sys.argv) > 1 else "target/jsonl-bench"


def text_pass(lines):
    n = 0
    for line in lines:
        n += len(json.loads(line)["text"].encode("utf-8"))
    return n


def numbers_pass(lines):
    n = 0
    for line in lines:
        d = json.loads(line)
        b = struct.pack("<qqdd", d["id"], d["label"], d["x"], d["y"])
        v = struct.pack(f"<{len(d['v'])}d", *d["v"])
        n += len(b) + len(v)
    return n


def main():
    print(f"{'file':<16} {'lines':>9} {'MB':>6} {'lines/s':>11} {'MB/s':>8}")
    for name in ["text", "text_escaped", "numbers"]:
        path = os.path.join(DIR, f"{name}.jsonl")
        data = open(path, "rb").read()
        lines = [l for l in data.split(b"\n") if l]
        run = numbers_pass if name == "numbers" else text_pass
        times = []
        for _ in range(5):
            t = time.perf_counter()
            run(lines)
            times.append(time.perf_counter() - t)
        t = sorted(times)[len(times) // 2]
        mb = len(data) / 1e6
        print(f"{name:<16} {len(lines):>9} {mb:>6.1f} {len(lines) / t:>11.0f} {mb / t:>8.1f}")


if __name__ == "__main__":
    main()
