"""Shared data for gpufeed's Python tests: small packed files, .npy arrays, PNG folders."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import List

import numpy as np
import pytest

import gpufeed

N = 1000


def live() -> tuple:
    """(batches, own blocks) that gpufeed arrays still hold."""
    return gpufeed._gpufeed._live()


def rows(n: int = N) -> np.ndarray:
    """Sample i's `data`: i * 10 + [0..6), as float32 [2, 3] (exact in float32)."""
    return (np.arange(n, dtype=np.float32)[:, None] * 10 + np.arange(6, dtype=np.float32)).reshape(
        n, 2, 3
    )


@pytest.fixture
def arrays(tmp_path: Path):
    """(data.npy, labels.npy) of N samples: data as `rows`, label i."""
    x, y = tmp_path / "data.npy", tmp_path / "labels.npy"
    np.save(x, rows())
    np.save(y, np.arange(N, dtype=np.int64))
    return x, y


@pytest.fixture
def packed(tmp_path: Path, arrays) -> Path:
    """A packed file of N samples: `data` float32 [2, 3] (as `rows`) and `label` int64 = i."""
    out = tmp_path / "train.gfd"
    gpufeed.pack(arrays[0], out, labels=arrays[1])
    return out


def write_png(path: Path, rgb: np.ndarray) -> None:
    """Writes an RGB8 PNG (no dependency but zlib)."""
    h, w, _ = rgb.shape
    scanlines = np.hstack([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)]).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(tag + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(scanlines, 1))
        + chunk(b"IEND", b"")
    )
    path.write_bytes(png)


CLASSES = ["cat", "dog", "emu"]


def class_color(k: int) -> tuple:
    return (40 * k + 10, 200 - 50 * k, 90 + 30 * k)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """An ImageFolder: 3 classes x 4 solid-colour PNGs of 30x40 (class k has `class_color(k)`)."""
    root = tmp_path / "folder"
    for k, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        img = np.empty((30, 40, 3), np.uint8)
        img[...] = class_color(k)
        for i in range(4):
            write_png(root / name / f"{i}.png", img)
    return root


def read_offset_table(path: Path) -> int:
    """The offset table's position in a packed file (from its footer, docs/FORMAT.md)."""
    b = path.read_bytes()
    footer = len(b) - 64
    return struct.unpack_from("<Q", b, footer + 40)[0]


#: numpy >= 2.1 reads versioned DLPack capsules, which say the memory is writable; older numpy
#: reads legacy ones and marks every such array read-only.
NUMPY_WRITES = tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 1)


class Producer:
    """A DLPack producer that exports `array` with extra `__dlpack__` arguments (`copy=True`),
    or without `max_version` (a producer of the protocol before 1.0): any numpy can read it."""

    def __init__(self, array, **kwargs):
        self.array = array
        self.kwargs = kwargs

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__(stream=stream, **self.kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def require_gpu_tools() -> bool:
    """True when GPUFEED_REQUIRE_GPU=1: tests that need torch must fail, not skip, without it."""
    return os.environ.get("GPUFEED_REQUIRE_GPU") == "1"


def run_isolated(function, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``function(*args)`` (a module-level function of a test module; plain arguments) in
    a fresh interpreter and returns the finished process (``stdout``, ``stderr``: text); fails
    the test if it fails, or if it has not ended after ``timeout`` seconds (a hang fails
    instead of stopping the suite).

    There, SIGINT raises KeyboardInterrupt even where this process ignores it (under
    ``nohup``, whose SIG_IGN a child inherits and Python then keeps)."""
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"import {function.__module__} as m\n"
        f"m.{function.__name__}(*{args!r})\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, PYTHONPATH=path),
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"{function.__name__} did not end within {timeout} s (killed); "
            f"its output: {e.stdout!r} {e.stderr!r}"
        )
    if done.returncode != 0:
        pytest.fail(
            f"{function.__name__} failed (exit status {done.returncode}):\n"
            f"{done.stdout}\n{done.stderr}"
        )
    return done


#: The repository's root.
ROOT = Path(__file__).resolve().parents[2]


def gpufeed_command() -> Path:
    """The `gpufeed` command: GPUFEED_BIN, else the workspace's debug build, brought up to date
    here (cargo does nothing when it is)."""
    if os.environ.get("GPUFEED_BIN"):
        return Path(os.environ["GPUFEED_BIN"])
    try:
        subprocess.run(["cargo", "build", "-p", "gpufeed-cli", "--bin", "gpufeed"], cwd=ROOT,
                       check=True)
    except FileNotFoundError:
        pytest.skip("no cargo to build the gpufeed command (set GPUFEED_BIN)")
    return ROOT / "target" / "debug" / "gpufeed"


#: Megatron's dtype codes (megatron.core.datasets.indexed_dataset.DType).
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix: Path, docs: List[np.ndarray], dtype=np.uint16) -> None:
    """`prefix.bin` and `prefix.idx` as Megatron's IndexedDatasetBuilder writes them, one
    sequence per document: the magic, version 1, the dtype code, the counts, then the sequence
    lengths (i32), their byte offsets in the .bin (i64) and the document index (i64)."""
    item = np.dtype(dtype).itemsize
    lengths = np.array([len(d) for d in docs], dtype="<i4")
    pointers = np.zeros(len(docs), dtype="<i8")
    pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * item)
    header = b"MMIDIDX\x00\x00" + struct.pack(
        "<QBQQ", 1, MEGATRON_CODES[dtype], len(docs), len(docs) + 1
    )
    index = header + lengths.tobytes() + pointers.tobytes()
    index += np.arange(len(docs) + 1, dtype="<i8").tobytes()
    Path(f"{prefix}.idx").write_bytes(index)
    np.concatenate(docs).astype(dtype).tofile(f"{prefix}.bin")


def documents(count: int = 60, longest: int = 40, seed: int = 5) -> List[np.ndarray]:
    """Documents of 1 to `longest` tokens whose tokens are the numbers 1, 2, 3, ... in file
    order: a token names its document and place, and the next token of a document is token + 1."""
    lengths = np.random.default_rng(seed).integers(1, longest + 1, size=count)
    ends = np.cumsum(lengths)
    return [np.arange(end - n + 1, end + 1) for n, end in zip(lengths, ends)]
