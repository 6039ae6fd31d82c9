"""Ctrl-C while waiting for a batch raises KeyboardInterrupt promptly; other Python threads run
meanwhile (the GIL is released); the process and the loader stay usable.

The slow batch is deterministic: its image is a named pipe, which the worker's read blocks on
until the test writes the image into it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import gpufeed
from conftest import write_png


@pytest.fixture
def pipe_folder(tmp_path):
    """An ImageFolder whose first image (0.png) is a named pipe, and its PNG bytes."""
    root = tmp_path / "folder"
    (root / "only").mkdir(parents=True)
    img = np.full((20, 20, 3), 77, np.uint8)
    write_png(root / "only" / "1.png", img)
    os.mkfifo(root / "only" / "0.png")
    return root, (root / "only" / "1.png").read_bytes()


def feed(path, data: bytes) -> threading.Thread:
    """Writes `data` into the named pipe `path` (opening blocks until the reader opens)."""

    def write():
        with open(path, "wb") as f:
            f.write(data)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def test_ctrl_c_while_waiting_raises_keyboard_interrupt_promptly(pipe_folder):
    root, png = pipe_folder
    loader = gpufeed.Loader(
        root, batch_size=1, workers=1, prefetch=1, images={"size": 8}, output="numpy"
    )
    sent = []
    ticks = [0]
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.01)

    def interrupt():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    timer = threading.Timer(0.5, interrupt)
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
    finally:
        stop.set()
    raised = time.monotonic()
    timer.join()
    ticker.join()
    assert sent, "the interrupt was not sent"
    assert raised - sent[0] < 1.0, f"KeyboardInterrupt came {raised - sent[0]:.2f} s after SIGINT"
    # The ticker ran while the main thread waited: the wait does not hold the GIL.
    assert ticks[0] >= 10, f"only {ticks[0]} ticks of 10 ms in {sent[0] - t0:.2f} s"
    # Nothing was delivered or lost: once the image comes, the first batch does.
    assert loader.position == 0
    writer = feed(root / "only" / "0.png", png)
    batch = next(iter(loader))
    writer.join()
    assert batch["label"].tolist() == [0] and (batch["image"] == 77).all()
    assert loader.position == 1
    # The process is healthy: the loader drops (its next batch in flight), another one works.
    del loader, batch
    plain = root.parent / "plain"
    (plain / "only").mkdir(parents=True)
    write_png(plain / "only" / "a.png", np.full((20, 20, 3), 5, np.uint8))
    other = gpufeed.Loader(plain, batch_size=1, images={"size": 8}, output="numpy")
    assert [b["label"].tolist() for b in other] == [[0]]
