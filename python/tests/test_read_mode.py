"""``read_mode=`` and ``verify=``: a file truncated under a loader that reads at offsets
(``read_mode="pread"``) is an error naming it, never a SIGBUS; ``verify=True`` turns bytes
changed in place into an error naming the record; sources not read through either refuse them.

The files are truncated after the loader opened them and before it reads what was cut off: a
loader of one worker, one batch ahead, and small batches, so most of the file is read after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from conftest import N, rows


def small_batches(path, **kw) -> gpufeed.Loader:
    return gpufeed.Loader(path, batch_size=10, workers=1, prefetch=1, output="numpy", **kw)


def cut_in_half(path: Path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def raises_file_changed(loader, path: Path) -> gpufeed.DataError:
    with pytest.raises(gpufeed.DataError) as e:
        for _ in loader:
            pass
    assert e.value.kind == "file_changed", e.value
    assert e.value.path == str(path), e.value
    assert str(path) in str(e.value), e.value
    return e.value


def test_a_npy_truncated_under_a_pread_loader_is_an_error_naming_it(arrays):
    data, _ = arrays
    loader = small_batches(data, read_mode="pread")
    cut_in_half(data)
    raises_file_changed(loader, data)


def test_a_packed_file_truncated_under_a_pread_loader_is_an_error_naming_it(packed):
    loader = small_batches(packed, read_mode="pread", indices=True)
    cut_in_half(packed)
    raises_file_changed(loader, packed)


def test_a_token_file_truncated_under_a_pread_loader_is_an_error_naming_it(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(20_000, dtype=np.uint16).tofile(path)
    loader = gpufeed.TokenLoader(
        path, seq_len=16, batch_size=4, token_dtype="uint16", workers=1, prefetch=1,
        read_mode="pread", output="numpy",
    )
    cut_in_half(path)
    raises_file_changed(loader, path)


def test_both_modes_read_the_same_batches(packed, arrays):
    for path in (packed, arrays[0]):
        mapped = [b["__index__"].tolist() for b in small_batches(path, shuffle=3, indices=True)]
        first = {k: v.copy() for k, v in next(iter(small_batches(path, shuffle=3))).items()}
        read = small_batches(path, shuffle=3, indices=True, read_mode="pread")
        assert [b["__index__"].tolist() for b in read] == mapped
        again = next(iter(small_batches(path, shuffle=3, read_mode="pread")))
        assert all(np.array_equal(again[k], first[k]) for k in first)


def truncate_under_the_default(path: str) -> None:
    loader = gpufeed.Loader(path, batch_size=10, workers=1, prefetch=1, output="numpy")
    os.truncate(path, os.path.getsize(path) // 2)
    for _ in loader:
        pass


def test_the_default_mapping_still_dies_of_sigbus_which_is_why_pread_exists(arrays):
    # In a child: SIGBUS ends the process that maps the file.
    data, _ = arrays
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import test_read_mode as m; m.truncate_under_the_default({str(data)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=here),
        timeout=120,
    )
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr)


def test_verify_turns_a_record_changed_in_place_into_an_error(packed):
    # Sample 500's `data` is 5000..5005 as float32: change one of its bytes in place.
    needle = rows()[500].tobytes()
    blob = packed.read_bytes()
    at = blob.index(needle)
    assert blob.count(needle) == 1
    loader = gpufeed.Loader(packed, batch_size=100, verify=True, output="numpy")
    with open(packed, "r+b") as f:
        f.seek(at + 3)
        f.write(bytes([blob[at + 3] ^ 0xFF]))
    with pytest.raises(gpufeed.DataError) as e:
        for _ in loader:
            pass
    assert e.value.kind == "checksum" and e.value.path == str(packed), e.value
    assert e.value.record == 500 and e.value.sample == 500, e.value
    # Without verify=, the changed bytes are read as data.
    plain = gpufeed.Loader(packed, batch_size=100, output="numpy")
    data = np.concatenate([b["data"].copy() for b in plain])
    assert not np.array_equal(data[500], rows()[500])
    assert np.array_equal(np.delete(data, 500, 0), np.delete(rows(), 500, 0))


def test_sources_not_read_through_them_refuse_read_mode_and_verify(folder, packed):
    # An image folder's files are read whole and a sharded data set's shards are mapped by
    # its store: pread is refused, naming the argument; the mapping is what they do.
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(folder, images={"size": 8}, read_mode="pread")
    assert e.value.argument == "read_mode" and "ImageFolder" in str(e.value), e.value
    assert sum(1 for _ in gpufeed.Loader(folder, images={"size": 8}, read_mode="mmap")) > 0
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(folder, images={"size": 8}, verify=True)
    assert e.value.argument == "verify" and "no checksums" in str(e.value), e.value
    shards = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "streaming" / "mds"
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(shards, read_mode="pread")
    assert e.value.argument == "read_mode" and "sharded data set" in str(e.value), e.value
    # verify= checks each shard against its index's hashes when it is opened.
    loader = gpufeed.Loader(shards, verify=True, indices=True, fields=["id"], output="numpy")
    assert sum(len(b["__index__"]) for b in loader) == 7
    for bad in ("fast", 1):
        with pytest.raises(gpufeed.ConfigError) as e:
            gpufeed.Loader(packed, read_mode=bad)
        assert e.value.argument == "read_mode"
        with pytest.raises(gpufeed.ConfigError) as e:
            gpufeed.TokenLoader(packed, seq_len=4, batch_size=1, read_mode=bad)
        assert e.value.argument == "read_mode"
    assert len(list(gpufeed.Loader(packed, batch_size=N, read_mode="mmap", verify=True))) == 1
