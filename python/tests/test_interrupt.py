"""Ctrl-C while waiting for a batch raises KeyboardInterrupt promptly; other Python threads run
meanwhile (the GIL is released); the process and the loader stay usable. Dropping a loader
whose worker is stuck in a read returns (with the GIL released) and says so.

The slow batch is deterministic: its image is a named pipe, which the worker's read blocks on
until the test writes the image into it (or forever). Each scenario runs in a child interpreter
(`run_isolated`): a hang fails the test after its timeout instead of stopping the suite, and
SIGINT raises KeyboardInterrupt there even when this process ignores it (under nohup).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from conftest import run_isolated, write_png


@pytest.fixture
def pipe_folder(tmp_path):
    """An ImageFolder whose first image (only/0.png) is a named pipe; its second a PNG."""
    root = tmp_path / "folder"
    (root / "only").mkdir(parents=True)
    write_png(root / "only" / "1.png", np.full((20, 20, 3), 77, np.uint8))
    os.mkfifo(root / "only" / "0.png")
    return root


def feed(path, data: bytes) -> threading.Thread:
    """Writes `data` into the named pipe `path` (opening blocks until the reader opens)."""

    def write():
        with open(path, "wb") as f:
            f.write(data)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


class Ticker:
    """A thread that counts 10 ms ticks: it only ticks while the GIL is free."""

    def __init__(self):
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.ticks += 1
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.ticks


def ctrl_c_while_waiting(root: str) -> None:
    root = Path(root)
    png = (root / "only" / "1.png").read_bytes()
    loader = gpufeed.Loader(
        root, batch_size=1, workers=1, prefetch=1, images={"size": 8}, output="numpy"
    )
    sent = []

    def interrupt():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    ticker = Ticker()
    timer = threading.Timer(0.5, interrupt)
    timer.start()
    # Should the interrupt never raise, the image comes after a while and the loop ends:
    # a failure below, not a hang.
    rescue = threading.Timer(30, lambda: feed(root / "only" / "0.png", png))
    rescue.daemon = True
    rescue.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
    finally:
        ticks = ticker.stop()
    raised = time.monotonic()
    rescue.cancel()
    timer.join()
    assert sent, "the interrupt was not sent"
    assert raised - sent[0] < 1.0, f"KeyboardInterrupt came {raised - sent[0]:.2f} s after SIGINT"
    # The ticker ran while the main thread waited: the wait does not hold the GIL.
    assert ticks >= 10, f"only {ticks} ticks of 10 ms in {sent[0] - t0:.2f} s"
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


def test_ctrl_c_while_waiting_raises_keyboard_interrupt_promptly(pipe_folder):
    run_isolated(ctrl_c_while_waiting, str(pipe_folder))


def open_writer_once_read(path: Path, timeout: float = 30) -> int:
    """Opens the named pipe `path` for writing as soon as a reader has it open (the worker),
    without writing: the reader then waits in `read`. Returns the descriptor."""
    t0 = time.monotonic()
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() - t0 > timeout:
                raise
            time.sleep(0.005)


def drop_while_a_worker_is_stuck(root: str) -> None:
    import warnings

    root = Path(root)
    loader = gpufeed.Loader(
        root, batch_size=1, workers=1, prefetch=1, images={"size": 8}, output="numpy"
    )
    # The worker is reading the pipe, and nothing will come until the writer closes.
    writer = open_writer_once_read(root / "only" / "0.png")
    ticker = Ticker()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        del loader
        took = time.monotonic() - t0
    ticks = ticker.stop()
    os.close(writer)  # the stuck read returns (end of file) and the detached worker ends
    print(
        json.dumps(
            {
                "took": took,
                "ticks": ticks,
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            }
        )
    )


def test_dropping_a_loader_whose_worker_is_stuck_returns_with_the_gil_released(pipe_folder):
    # Before the fix, `del loader` waited forever for the worker, with the GIL held.
    done = run_isolated(drop_while_a_worker_is_stuck, str(pipe_folder), timeout=60)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # The drop waited for the worker (SHUTDOWN_WAIT, 2 s), without the GIL, then gave up.
    assert report["ticks"] >= 10, report
    [warning] = report["warnings"]
    assert warning.startswith("RuntimeWarning: gpufeed: 1 worker thread(s)"), warning
    assert "did not stop within 2 s" in warning and "named pipe" in warning, warning
