"""Ctrl-C while waiting for a batch raises KeyboardInterrupt promptly; other Python threads run
meanwhile (the GIL is released); the process and the loader stay usable. Dropping a loader
whose worker is stuck in a read returns (with the GIL released) and says so.

The slow batch is deterministic: its image is a named pipe, which the worker's read blocks on
until the test writes the image into it (or forever). Each scenario runs in a child interpreter
(`run_isolated`): a hang fails the test after its timeout instead of stopping the suite, and
SIGINT raises KeyboardInterrupt there even when this process ignores it (under nohup).
"""

from __future__ import annotations

import _thread
import errno
import json
import os
import signal
import sys
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


def interrupting_conversion(plan):
    """Replaces numpy.from_dlpack (which gpufeed calls to convert each array of a batch) by
    Python code, as torch.from_dlpack is, that raises SIGINT at its calls `plan(k)` says (k
    counts from 1): `"before"` the view is made, `"after"` (the view is then in its frame, so
    in the KeyboardInterrupt's traceback), or None. Returns the list of calls interrupted."""
    import numpy

    real = numpy.from_dlpack
    calls, interrupted = [0], []

    def from_dlpack(x):
        calls[0] += 1
        where = plan(calls[0])
        if where == "before":
            interrupted.append(calls[0])
            signal.raise_signal(signal.SIGINT)
        view = real(x)
        if where == "after":
            interrupted.append(calls[0])
            signal.raise_signal(signal.SIGINT)
        return view

    numpy.from_dlpack = from_dlpack
    return interrupted


def indices_through(loader, handed: list, interrupts: list, stop_after=None) -> None:
    """Iterates `loader` to its epoch's end, as a job restarted after each Ctrl-C goes on (a
    new `for` loop), appending each batch's indices to `handed` as soon as it is handed over,
    and counting the KeyboardInterrupts in `interrupts`; stops at the `stop_after`-th."""
    while stop_after is None or len(interrupts) < stop_after:
        try:
            for batch in loader:
                handed.append(batch["__index__"])
            return
        except KeyboardInterrupt:
            interrupts.append(len(handed))


def interrupted_conversions_lose_nothing(path: str) -> None:
    # Every 5th conversion interrupted before the view is made, every 7th after.
    interrupted = interrupting_conversion(
        lambda k: "before" if k % 5 == 0 else "after" if k % 7 == 3 else None
    )
    settings = dict(batch_size=64, shuffle=3, workers=2, indices=True, output="numpy")
    loader = gpufeed.Loader(path, **settings)
    handed, interrupts = [], []
    # A job that ends at its 6th Ctrl-C, writing a checkpoint.
    indices_through(loader, handed, interrupts, stop_after=6)
    state = loader.state_dict()
    assert state["next_batch"] == len(handed), (state, len(handed), interrupts)
    assert loader.position == len(handed)
    del loader
    # It restarts from the checkpoint, is interrupted again, and goes on each time.
    resumed = gpufeed.Loader(path, **settings)
    resumed.load_state_dict(state)
    indices_through(resumed, handed, interrupts)
    assert resumed.state_dict()["next_batch"] == len(resumed) == len(handed)
    samples = sorted(i for batch in handed for i in batch.tolist())
    assert samples == list(range(1000)), f"lost or repeated: {len(samples)} samples"
    assert len(interrupts) > 10 and len(interrupted) == len(interrupts), (interrupts, interrupted)


def test_an_interrupt_while_a_batch_is_converted_leaves_it_to_the_next_call(packed):
    # Before the fix, each interrupted conversion lost its batch: position and state_dict
    # counted it as delivered.
    run_isolated(interrupted_conversions_lose_nothing, str(packed))


def set_epoch_after_an_interrupted_first_batch_keeps_the_position(path: str) -> None:
    settings = dict(batch_size=64, shuffle=3, workers=2, indices=True, output="numpy")
    expected = [b["__index__"].tolist() for b in gpufeed.Loader(path, **settings)]
    calls = interrupting_conversion(lambda k: "after" if k == 1 else None)
    loader = gpufeed.Loader(path, **settings)
    with pytest.raises(KeyboardInterrupt):
        next(iter(loader))
    assert calls == [1] and loader.position == 0
    # The loop's restart: `set_epoch` of the epoch where nothing was delivered yet keeps it.
    loader.set_epoch(0)
    assert [b["__index__"].tolist() for b in loader] == expected
    # The same right after a resume.
    state = loader.state_dict()
    state["next_batch"] = 5
    calls = interrupting_conversion(lambda k: "before" if k == 1 else None)
    resumed = gpufeed.Loader(path, **settings)
    resumed.load_state_dict(state)
    with pytest.raises(KeyboardInterrupt):
        next(iter(resumed))
    assert calls == [1] and resumed.position == 5 and resumed.state_dict()["next_batch"] == 5
    resumed.set_epoch(0)
    assert [b["__index__"].tolist() for b in resumed] == expected[5:]


def test_set_epoch_after_an_interrupted_first_batch_keeps_the_position(packed):
    run_isolated(set_epoch_after_an_interrupted_first_batch_keeps_the_position, str(packed))


def randomly_interrupted_epochs_lose_nothing(path: str) -> None:
    import _thread
    import random

    import numpy

    # Converted by Python code, as with torch.
    real = numpy.from_dlpack

    def from_dlpack(x):
        return real(x)

    numpy.from_dlpack = from_dlpack
    # One interrupt at a time: the handler disarms itself, the loop re-arms it (so that none
    # lands in the test's own bookkeeping). It counts those that land in a conversion.
    armed, landed = [False], [0]

    def handler(signum, frame):
        if armed[0]:
            armed[0] = False
            landed[0] += frame is not None and frame.f_code is from_dlpack.__code__
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    done = threading.Event()
    rng = random.Random(18)

    def interrupter():
        while not done.wait(rng.uniform(0, 0.003)):
            _thread.interrupt_main()

    thread = threading.Thread(target=interrupter, daemon=True)
    thread.start()
    loader = gpufeed.Loader(path, batch_size=16, shuffle=5, workers=2, indices=True, output="numpy")
    interrupts, epochs = 0, 0
    try:
        while landed[0] < 5 and epochs < 200:
            handed = []
            while True:
                try:
                    armed[0] = True
                    for batch in loader:
                        handed.append(batch["__index__"])
                    armed[0] = False
                    break
                except KeyboardInterrupt:
                    interrupts += 1
            samples = sorted(i for b in handed for i in b.tolist())
            assert samples == list(range(1000)), f"epoch {epochs}: {len(samples)} samples"
            assert loader.state_dict()["next_batch"] == len(handed) == len(loader)
            epochs += 1
    finally:
        done.set()
        thread.join()
    assert landed[0] >= 5, f"{interrupts} interrupts, {epochs} epochs, {landed[0]} in a conversion"


def test_random_interrupts_lose_nothing(packed):
    run_isolated(randomly_interrupted_epochs_lose_nothing, str(packed))


class Trip:
    """``Trip()[signal.SIGINT]`` makes SIGINT arrive as the kernel's delivery does
    (``_thread.interrupt_main``: the C handler's flag, no Python handler run yet), through a
    subscript, after which Python does not look for signals (it does after each call). The
    handler then runs at the next check: inside the next call when that call checks, else as
    that call returns. So the next call starts as if the signal had come while it waited."""

    # A builtin function is no descriptor: `Trip()[k]` calls `interrupt_main(k)`.
    __getitem__ = _thread.interrupt_main


def batch_is_made(loader, number: int) -> None:
    """Waits until `loader`, of one worker (which makes its batches in order), has made batch
    `number` of its first epoch: the next call takes it without waiting."""
    while loader.stats()["stages"]["batches_made"] <= number:
        time.sleep(0.001)


def made(kind: str, path: str):
    """A loader of one worker over `path` and what identifies its batches."""
    if kind == "tokens":
        loader = gpufeed.TokenLoader(
            path, seq_len=16, batch_size=4, mode="packed", shuffle=2, workers=1, output="numpy"
        )
        return loader, lambda b: b["input_ids"].tobytes()
    loader = gpufeed.Loader(path, batch_size=64, shuffle=3, workers=1, indices=True, output="numpy")
    return loader, lambda b: b["__index__"].tolist()


def signalled_calls_lose_nothing(kind: str, path: str, form: str) -> None:
    reference, key = made(kind, path)
    expected = [key(b) for b in reference]
    del reference
    loader, key = made(kind, path)
    it = iter(loader)
    handed = []
    while len(handed) < len(loader):
        batch_is_made(loader, len(handed))
        # SIGINT comes as the call takes a batch that is there: the call raises
        # KeyboardInterrupt, and the batch is the next call's.
        try:
            if form == "next":
                Trip()[signal.SIGINT]
                batch = next(it)
            else:
                Trip()[signal.SIGINT]
                batch = it.__next__()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError(f"batch {len(handed)}: the signal raised no KeyboardInterrupt")
        assert loader.position == len(handed), (loader.position, len(handed))
        batch = next(it)
        handed.append(key(batch))
        assert loader.state_dict()["next_batch"] == len(handed)
    with pytest.raises(StopIteration):
        next(it)
    assert handed == expected, f"{len(handed)} batches, not the {len(expected)} of the epoch"


@pytest.mark.parametrize("form", ["next", "__next__"])
def test_a_signal_as_next_takes_a_batch_leaves_it_to_the_next_call(packed, form):
    # Before the fix, `b = next(it)` lost the batch: the handler ran as the call returned, in
    # the caller's frame, and the batch was counted as delivered.
    run_isolated(signalled_calls_lose_nothing, "loader", str(packed), form)


@pytest.mark.parametrize("form", ["next", "__next__"])
def test_a_signal_as_next_takes_a_token_batch_leaves_it_to_the_next_call(tmp_path, form):
    from conftest import documents, write_megatron

    write_megatron(tmp_path / "data", documents())
    run_isolated(signalled_calls_lose_nothing, "tokens", str(tmp_path / "data"), form)


def ctrl_c_while_next_waits(root: str, images: int) -> None:
    root = Path(root)
    png = (root.parent / "image.png").read_bytes()
    loader = gpufeed.Loader(
        root, batch_size=1, workers=1, prefetch=1, images={"size": 8}, indices=True,
        output="numpy",
    )
    main = threading.get_ident()
    it = iter(loader)
    waits_line = []

    def in_next() -> bool:
        frame = sys._current_frames().get(main)
        return frame is not None and frame.f_lineno in waits_line

    def send():
        # For each image: once the worker reads its pipe and the main thread waits in
        # next(it), SIGINT, then the image right away (the batch is made while the main
        # thread still waits, or after its wait saw nothing yet and raised).
        for k in range(images):
            fd = open_writer_once_read(root / "only" / f"{k}.png")
            while not in_next():
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
            os.set_blocking(fd, True)
            os.write(fd, png)
            os.close(fd)

    sender = threading.Thread(target=send, daemon=True)
    handed, interrupts = [], 0
    waits_line.append(sys._getframe().f_lineno + 4)
    sender.start()
    while True:
        try:
            batch = next(it)  # the line `waits_line` names
        except KeyboardInterrupt:
            interrupts += 1
            continue
        except StopIteration:
            break
        handed.append(batch["__index__"].tolist())
        assert loader.state_dict()["next_batch"] == len(handed)
    sender.join()
    assert interrupts == images, interrupts
    assert handed == [[k] for k in range(images)], handed


def test_ctrl_c_while_next_waits_loses_no_batch(tmp_path):
    root = tmp_path / "folder"
    (root / "only").mkdir(parents=True)
    images = 5
    for k in range(images):
        os.mkfifo(root / "only" / f"{k}.png")
    write_png(tmp_path / "image.png", np.full((20, 20, 3), 77, np.uint8))
    run_isolated(ctrl_c_while_next_waits, str(root), images)
