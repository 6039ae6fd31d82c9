"""pyarrow's own reading of the files `cargo bench --bench table_read` wrote (target/table-bench/),
for benches/RESULTS.md: `pq.read_table` of the whole file, of one column set, and of one row group
slice of 65,536 rows (what gpufeed decodes as a chunk), in MB/s of uncompressed bytes and rows/s."""

import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

root = Path(sys.argv[1] if len(sys.argv) > 1 else "target/table-bench")
for name in ["text", "numbers", "tokens"]:
    path = root / f"{name}.parquet"
    md = pq.ParquetFile(path).metadata
    raw = sum(md.row_group(g).column(c).total_uncompressed_size for g in range(md.num_row_groups) for c in range(md.num_columns))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        table = pq.read_table(path, use_threads=False)
        best = min(best, time.perf_counter() - t)
    rows = table.num_rows
    print(f"{name}: read_table (1 thread): {best * 1e3:.1f} ms, {raw / best / 1e6:.0f} MB/s, {rows / best / 1e6:.2f} M rows/s")
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        table = pq.read_table(path)
        best = min(best, time.perf_counter() - t)
    print(f"{name}: read_table (threads): {best * 1e3:.1f} ms, {raw / best / 1e6:.0f} MB/s, {rows / best / 1e6:.2f} M rows/s")
