"""Buffer lifetime: an array outlives its batch dict and its loader, unchanged, while the loader
reuses its other buffers; the buffer returns to the pool when the last view goes."""

from __future__ import annotations

import ctypes
import gc
import time

import numpy as np

import gpufeed
from conftest import Producer, live, rows


def scribble(a: np.ndarray) -> None:
    """Overwrites `a`'s memory, even where numpy made the view read-only."""
    ctypes.memset(a.ctypes.data, 0x55, a.nbytes)


def test_a_kept_array_stays_valid_and_unchanged_after_the_loader_is_gone(packed):
    assert live() == (0, 0)
    loader = gpufeed.Loader(packed, batch_size=64, workers=2, output="numpy")
    it = iter(loader)
    first = next(it)
    kept = first["data"]
    expected = rows()[:64]
    del first
    # Ten more batches cycle through the pool's other buffers.
    for _ in range(10):
        batch = next(it)
        scribble(batch["data"])  # over every buffer handed out since
    del batch
    assert np.array_equal(kept, expected), "the kept array's buffer was reused"
    assert loader.stats()["pool"]["reuses"] > 0, "the pool never reused a buffer"
    assert live() == (1, 0)
    del it, loader
    gc.collect()
    assert np.array_equal(kept, expected)
    assert live() == (1, 0)
    del kept
    gc.collect()
    assert live() == (0, 0)


def settled_allocation(loader, timeout=5.0):
    """The pool's allocated bytes once they stop changing (the workers have filled the
    pipeline up to its prefetch and wait)."""
    last = loader.stats()["pool"]["allocated_bytes"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = loader.stats()["pool"]["allocated_bytes"]
        if now == last:
            return now
        last = now
    return last


def test_one_field_keeps_the_whole_batch_and_the_last_view_releases_it(packed):
    loader = gpufeed.Loader(packed, batch_size=64, output="dlpack")
    batch = next(iter(loader))
    label = np.from_dlpack(batch["label"])
    capsule = batch["data"].__dlpack__()  # exported, never consumed
    del batch
    assert live() == (1, 0)
    # The workers fill the rest of the pipeline meanwhile (their buffers count as allocated):
    # measure once they are done, so that the drop below is the batch's own buffer going back.
    held = settled_allocation(loader)
    assert held > 0
    del capsule
    assert live() == (1, 0)
    del label
    assert live() == (0, 0)
    assert loader.stats()["pool"]["allocated_bytes"] < held


def test_masks_indices_and_copies_are_freed_too(packed):
    loader = gpufeed.Loader(packed, batch_size=64, evaluation=True, indices=True, output="numpy")
    b = next(iter(loader))
    other = next(iter(gpufeed.Loader(packed, output="dlpack")))
    copy = np.from_dlpack(Producer(other["data"], copy=True))
    del other
    assert live()[1] >= 2
    del b, copy
    gc.collect()
    assert live() == (0, 0)


def test_arrays_from_a_loader_closed_mid_epoch_stay_valid(packed):
    loader = gpufeed.Loader(packed, batch_size=100, workers=2, output="numpy")
    it = iter(loader)
    kept = [next(it)["label"] for _ in range(3)]
    loader.close()
    assert [k.tolist() for k in kept] == [list(range(i, i + 100)) for i in (0, 100, 200)]
