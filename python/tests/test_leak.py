"""Many loaders: nothing is left behind (batches, threads, memory)."""

from __future__ import annotations

import gc
import os

import gpufeed
from conftest import live


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run_loaders(packed, n: int) -> None:
    for i in range(n):
        loader = gpufeed.Loader(
            packed, batch_size=128, shuffle=i, workers=2, evaluation=i % 2 == 1, output="numpy"
        )
        it = iter(loader)
        kept = next(it)["data"]
        for _ in range(3):
            next(it)
        loader.load_state_dict(loader.state_dict())
        del it, loader  # mid-epoch, with batches in flight
        assert kept.shape == (128, 2, 3)


def test_200_loaders_leave_nothing_behind(packed):
    gc.collect()
    base_threads = threads()
    run_loaders(packed, 20)  # warm up the allocator
    gc.collect()
    before = rss_bytes()
    run_loaders(packed, 200)
    gc.collect()
    after = rss_bytes()
    assert live() == (0, 0), "batches still held"
    assert threads() == base_threads, "worker threads left running"
    # Each loader maps the file and allocates a pool of about 200 KiB: 200 leaked loaders would
    # be tens of MiB.
    assert after - before < 8 << 20, f"RSS grew by {(after - before) >> 10} KiB over 200 loaders"
