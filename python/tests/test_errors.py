"""Errors cross as gpufeed.Error subclasses with gpufeed's message, never a crash; the loader
goes on after a bad batch."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from conftest import N, read_offset_table, rows


@pytest.mark.parametrize(
    "kwargs, argument, words",
    [
        (dict(batch_size=0), "batch_size", "at least 1"),
        (dict(shard=(2, 2)), "shard", "rank 2 is not below the world size 2"),
        (dict(shard="all"), "shard", "'env' or (rank, world_size)"),
        (dict(workers=0), "workers", "at least 1"),
        (dict(prefetch=0), "prefetch", "at least 1"),
        (dict(batch_parts=0), "batch_parts", "at least 1"),
        (dict(evaluation=True, drop_last=True), "evaluation", "drop_last"),
        (dict(output="pandas"), "output", "'torch', 'numpy', 'cupy', 'jax', 'dlpack'"),
        (dict(device="cuda:x"), "device", "'cuda' (the local rank's GPU) or 'cuda:N'"),
        (dict(device="gpu"), "device", "'cuda:N'"),
        (dict(device=-1), "device", "at least 0"),
        # Checked before any GPU is looked for: the same on every machine.
        (dict(device="cuda:0"), "output", "numpy cannot hold GPU memory"),
        (dict(fields=["nope"]), "fields", "no field `nope`"),
        (dict(images={"size": 0}), "images['size']", "at least 1"),
        (dict(images={"colour": 1}), "images['colour']", "not an image option"),
        (dict(images={"dtype": "int32"}), "images['dtype']", "not one of"),
        (dict(images={"normalize": (1, 2)}), "images['normalize']", "imagenet"),
        (dict(images={"scale": (0.9, 0.1)}), "images['scale']", "ordered range"),
        (dict(images={"flip": 2.0}), "images['flip']", "not a probability"),
        (dict(images={}, fields=["data"]), "fields", "image pipeline"),
        (dict(images={"decode": "fpga"}), "images['decode']", "not 'cpu', 'gpu' or 'auto'"),
        (dict(images={}, decode="fpga"), "decode", "not 'cpu', 'gpu' or 'auto'"),
        (dict(decode="gpu"), "decode", "give images= too"),
        (dict(drop_last=True, batch_size=5000), "drop_last", "fewer than one batch"),
        (dict(pool_budget=100), "pool_budget", "cannot hold one batch"),
    ],
)
def test_a_bad_argument_is_a_config_error_naming_it(packed, kwargs, argument, words):
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(packed, **{"output": "numpy", **kwargs})
    err = e.value
    assert isinstance(err, ValueError) and isinstance(err, gpufeed.Error)
    assert err.argument == argument and err.kind == "invalid_config"
    assert f"invalid argument {argument}:" in str(err) and words in str(err), str(err)


def test_a_bad_type_is_a_type_error(packed):
    for kwargs in (dict(batch_size="8"), dict(shuffle=1.5), dict(images=3), dict(epoch=None)):
        with pytest.raises(TypeError):
            gpufeed.Loader(packed, output="numpy", **kwargs)


def test_bytes_fields_need_the_image_pipeline(folder, tmp_path):
    packed = tmp_path / "images.gfd"
    gpufeed.pack(folder, packed)
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(packed, output="numpy")
    assert e.value.argument == "images" and "`image`" in str(e.value)
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(folder, output="numpy")
    assert e.value.argument == "images" and "ImageFolder" in str(e.value)
    # Picking tensor fields only works without it.
    labels = gpufeed.Loader(packed, fields=["label"], batch_size=12, output="numpy")
    assert next(iter(labels))["label"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(packed, images={"label_field": "class"}, output="numpy")
    assert e.value.argument == "images['label_field']"


def test_a_missing_file_is_file_not_found_naming_it(tmp_path):
    path = tmp_path / "nope.gfd"
    with pytest.raises(FileNotFoundError) as e:
        gpufeed.Loader(path, output="numpy")
    err = e.value
    assert isinstance(err, gpufeed.FileError) and isinstance(err, OSError)
    assert err.errno == errno.ENOENT and err.filename == str(path) and err.kind == "io"
    assert str(path) in str(err) and "open" in str(err)
    with pytest.raises(gpufeed.FileNotFound):
        gpufeed.inspect(path)
    with pytest.raises(gpufeed.FileNotFound):
        gpufeed.pack(tmp_path / "none.npy", tmp_path / "out.gfd")


def test_a_truncated_file_is_a_data_error_naming_it(packed):
    data = packed.read_bytes()
    packed.write_bytes(data[: len(data) - 100])
    with pytest.raises(gpufeed.DataError) as e:
        gpufeed.Loader(packed, output="numpy")
    assert e.value.kind == "malformed" and e.value.path == str(packed)
    assert str(packed) in str(e.value) and isinstance(e.value, ValueError)


def test_a_corrupt_record_fails_its_batch_names_the_sample_and_the_loader_goes_on(packed):
    table = read_offset_table(packed)
    b = bytearray(packed.read_bytes())
    struct.pack_into("<Q", b, table + 8 * 130, 2**64 - 8)  # records 129 and 130 are bad
    packed.write_bytes(bytes(b))
    loader = gpufeed.Loader(packed, batch_size=64, workers=2, output="numpy")
    good, failures = [], []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except gpufeed.DataError as e:
            failures.append(e)
            continue
        good.extend(batch["label"].tolist())
    assert len(failures) == 1, failures
    err = failures[0]
    assert err.kind == "bad_record" and err.path == str(packed)
    assert err.sample == 129 and err.record == 129 and err.batch == 2
    assert str(packed) in str(err) and "sample 129 (batch 2)" in str(err)
    # Every other batch came, in order.
    assert good == [i for i in range(N) if not 128 <= i < 192]


def test_verify_finds_a_bad_checksum(packed):
    b = bytearray(packed.read_bytes())
    data_offset = struct.unpack_from("<Q", b, 16)[0]
    b[data_offset + 6 * 32 + 3] ^= 0xFF  # record 6 (32 bytes each) no longer matches its checksum
    packed.write_bytes(bytes(b))
    assert gpufeed.inspect(packed)["records"] == N  # without verify: no record is read
    with pytest.raises(gpufeed.DataError) as e:
        gpufeed.inspect(packed, verify=True)
    assert e.value.kind == "checksum" and e.value.record == 6 and e.value.path == str(packed)


def test_a_corrupt_image_fails_its_batch_or_is_skipped(folder):
    bad = folder / "dog" / "2.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    loader = gpufeed.Loader(folder, batch_size=4, images={"size": 8}, output="numpy")
    results = []
    it = iter(loader)
    for _ in range(len(loader)):
        try:
            results.append(next(it)["label"].tolist())
        except gpufeed.DataError as e:
            results.append(e)
    err = results[1]
    assert isinstance(err, gpufeed.DataError) and err.kind == "image"
    # The image is named by its path in the folder.
    assert err.sample == 6 and err.batch == 1 and "dog/2.png" in str(err)
    assert results[0] == [0] * 4 and results[2] == [2] * 4
    skip = gpufeed.Loader(
        folder, batch_size=4, images={"size": 8, "skip_bad_images": True}, output="numpy"
    )
    labels = [b["label"].tolist() for b in skip]
    assert labels[1] == [1, 1, -1, 1]
    stats = skip.stats()["images"]
    # At least once: the loader may have started the next epoch, which decodes it again.
    assert stats["skipped"] >= 1 and "dog/2.png" in stats["last_skipped"]


def test_bad_npy_and_pack_arguments(tmp_path):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00" + b"\x10\x00" + b"{'descr': 'zz'}" + b" " * 20)
    with pytest.raises(gpufeed.DataError) as e:
        gpufeed.Loader(bad, output="numpy")
    assert e.value.path == str(bad)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"x" * 100)
    with pytest.raises(gpufeed.DataError) as e:
        gpufeed.pack(raw, tmp_path / "o.gfd", record_bytes=64)
    assert "not a multiple" in str(e.value)
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.pack(raw, tmp_path / "o.gfd", kind="raw")
    assert e.value.argument == "record_bytes"
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.pack(raw, tmp_path / "o.gfd", kind="tar")
    assert e.value.argument == "kind"
    np.save(tmp_path / "a.npy", rows(10))
    np.save(tmp_path / "l.npy", np.arange(9))
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.pack(tmp_path / "a.npy", tmp_path / "o.gfd", labels=tmp_path / "l.npy")
    assert e.value.argument == "labels" and "9 rows" in str(e.value)
    assert not (tmp_path / "o.gfd").exists()


@pytest.mark.parametrize("kind", ["npy", "raw", "imagefolder"])
def test_pack_replaces_an_existing_file_only_when_forced(tmp_path, arrays, folder, kind):
    raw = tmp_path / "records.bin"
    raw.write_bytes(bytes(range(64)) * 10)
    inputs, kwargs = {
        "npy": (arrays[0], dict(labels=arrays[1])),
        "raw": (raw, dict(record_bytes=64)),
        "imagefolder": (folder, {}),
    }[kind]
    out = tmp_path / "out.gfd"
    gpufeed.pack(raw, out, record_bytes=32)
    older = out.read_bytes()
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(gpufeed.FileExists) as e:
        gpufeed.pack(inputs, out, **kwargs)
    err = e.value
    assert isinstance(err, FileExistsError) and isinstance(err, gpufeed.FileError)
    assert err.errno == errno.EEXIST and err.filename == str(out) and err.argument == "output"
    assert f"output {out} exists" in str(err) and "force=True" in str(err), str(err)
    assert out.read_bytes() == older
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a temporary file was left"
    summary = gpufeed.pack(inputs, out, force=True, **kwargs)
    assert gpufeed.inspect(out)["records"] == summary["records"] == {"npy": N, "raw": 10}.get(
        kind, 12
    )


@pytest.mark.parametrize("force", [False, True])
def test_pack_never_replaces_a_file_gpufeed_did_not_write(tmp_path, arrays, force):
    """force=True replaces a packed file, not whatever the output names: a user's file or a
    .npy array that is not an input is refused, saying what it is (it was overwritten)."""
    data, _ = arrays
    precious = tmp_path / "out.gfd"
    precious.write_text("precious")
    other = tmp_path / "other.npy"
    np.save(other, np.arange(7))
    for out, what in ((precious, "a file of 8 bytes"), (other, "a .npy array")):
        before = out.read_bytes()
        with pytest.raises(gpufeed.ConfigError) as e:
            gpufeed.pack(data, out, force=force)
        assert e.value.argument == "output" and what in str(e.value), str(e.value)
        assert "not a packed record file" in str(e.value) and "remove it yourself" in str(e.value)
        assert out.read_bytes() == before
    # An empty file holds nothing to lose: replaced when forced.
    empty = tmp_path / "empty.gfd"
    empty.write_bytes(b"")
    if force:
        assert gpufeed.pack(data, empty, force=True)["records"] == N
    else:
        with pytest.raises(gpufeed.FileExists):
            gpufeed.pack(data, empty)


def test_pack_never_writes_over_its_input(tmp_path, arrays):
    data, labels = arrays
    before = data.read_bytes()
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.pack(data, data, force=True)
    assert e.value.argument == "output" and "would destroy it" in str(e.value), str(e.value)
    link = tmp_path / "labels-link.gfd"
    link.symlink_to(labels)
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.pack(data, link, labels=labels, force=True)
    assert f"the input {labels}" in str(e.value), str(e.value)
    assert data.read_bytes() == before and np.load(labels).tolist() == list(range(N))
    # Nor over anything but a regular file, forced or not.
    other = tmp_path / "other.gfd"
    other.write_text("precious")
    link.unlink()
    link.symlink_to(other)
    for out, words in ((tmp_path, "is a directory"), (link, "not a regular file")):
        with pytest.raises(gpufeed.ConfigError) as e:
            gpufeed.pack(data, out, force=True)
        assert e.value.argument == "output" and words in str(e.value), str(e.value)
    assert other.read_text() == "precious" and link.is_symlink()


def test_holding_every_batch_is_an_error_naming_the_budget_and_loses_nothing(packed):
    loader = gpufeed.Loader(packed, batch_size=10, workers=1, prefetch=2, output="numpy")
    held = []
    it = iter(loader)
    with pytest.raises(gpufeed.ConfigError) as e:
        while True:
            held.append(next(it))
    assert e.value.argument == "pool_budget" and len(held) == 4  # prefetch + 2
    assert "you hold 4 batches" in str(e.value)
    del held[:2]
    rest = [b["label"].tolist() for b in it]
    assert rest[0] == list(range(40, 50)), "a batch was lost"


def test_a_closed_loader_says_so(packed):
    with gpufeed.Loader(packed, output="numpy") as loader:
        next(iter(loader))
    with pytest.raises(RuntimeError, match="closed"):
        len(loader)
    with pytest.raises(TypeError, match="pickled"):
        import pickle

        pickle.dumps(gpufeed.Loader(packed, output="numpy"))


def test_a_gpu_that_is_not_there_is_a_gpu_error(packed, monkeypatch):
    # Without a driver (this machine, CI) or with one (no machine has 4,000 GPUs): the same class.
    with pytest.raises(gpufeed.GpuError) as e:
        gpufeed.Loader(packed, batch_size=10, device="cuda:4000", output="dlpack")
    assert isinstance(e.value, RuntimeError) and e.value.kind == "no_gpu"
    assert "4000" in str(e.value) or "libcuda" in str(e.value)
    # "cuda" is the local rank's GPU: a launcher's variable that is no ordinal is named.
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(gpufeed.ConfigError, match="LOCAL_RANK='first'") as e:
        gpufeed.Loader(packed, batch_size=10, device="cuda", output="dlpack")
    assert e.value.argument == "device"
    monkeypatch.setenv("LOCAL_RANK", "4001")
    with pytest.raises(gpufeed.GpuError):
        gpufeed.Loader(packed, batch_size=10, device="cuda", output="dlpack")


def write_mds(root: Path, names, rows: int = 10) -> Path:
    """A one-shard MDS data set (mosaicml-streaming's format) of int32 columns `names`;
    column k of sample i holds i * (k + 1)."""
    root.mkdir()
    width = 4 * len(names)
    start = 4 + 4 * (rows + 1)
    offsets = [start + width * i for i in range(rows + 1)]
    row = struct.Struct(f"<{len(names)}i")
    data = b"".join(row.pack(*(i * (k + 1) for k in range(len(names)))) for i in range(rows))
    blob = struct.pack("<I", rows) + struct.pack(f"<{rows + 1}I", *offsets) + data
    (root / "shard.00000.mds").write_bytes(blob)
    shard = {
        "column_encodings": ["int32"] * len(names),
        "column_names": list(names),
        "column_sizes": [4] * len(names),
        "compression": None,
        "format": "mds",
        "hashes": [],
        "raw_data": {"basename": "shard.00000.mds", "bytes": len(blob), "hashes": {}},
        "samples": rows,
        "size_limit": 1 << 20,
        "version": 2,
        "zip_data": None,
    }
    (root / "index.json").write_text(json.dumps({"version": 2, "shards": [shard]}))
    return root


def sparse_npy(path: Path, rows: int, row_bytes: int) -> Path:
    """A .npy of `rows` rows of `row_bytes` uint8, as a sparse file (no disk, no memory)."""
    np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(rows, row_bytes)).flush()
    return path


def lacking(tmp_path, folder, arrays, case):
    """The call of `case`, which leaves out an argument it needs: (path, kwargs)."""
    if case == "folder without images":
        return folder, {}
    if case == "packed images without images":
        packed_images = tmp_path / "images.gfd"
        gpufeed.pack(folder, packed_images)
        return packed_images, {}
    if case == "no field image (the default image_field)":
        plain = tmp_path / "plain.gfd"
        gpufeed.pack(arrays[0], plain, labels=arrays[1])
        return plain, dict(images={"size": 8})
    if case == "no field label (the default label_field)":
        unlabelled = tmp_path / "unlabelled.gfd"
        gpufeed.pack(arrays[0], unlabelled)
        return unlabelled, dict(images={"size": 8, "image_field": "data"})
    if case == "a data field named __index__":
        return write_mds(tmp_path / "mds", ["__index__", "x"]), {}
    if case == "the default prefetch's buffers exceed the memory":
        # Batches of 1 GiB rows, each a third of the memory (under half: else batch_size is at
        # fault), four of them an epoch; prefetch (at least 3) + 2 of them exceed the memory:
        # gpufeed's default prefetch does not fit.
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        batch = -(-memory // 3 // (1 << 30))
        return sparse_npy(tmp_path / "huge.npy", 4 * batch, 1 << 30), dict(batch_size=batch)
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, argument, words",
    [
        ("folder without images", "images", "images= was not given: pass images={...}"),
        ("packed images without images", "images", "images= was not given: pass images={...}"),
        ("no field image (the default image_field)", "images", "`image` (image_field's default)"),
        ("no field label (the default label_field)", "images", "`label` (label_field's default)"),
        ("a data field named __index__", "fields", "the data set has a field `__index__`"),
        ("the default prefetch's buffers exceed the memory", "prefetch", "prefetch= was not given"),
    ],
)
def test_an_error_names_no_argument_the_call_did_not_pass(
    tmp_path, folder, arrays, case, argument, words
):
    path, kwargs = lacking(tmp_path, folder, arrays, case)
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(path, output="numpy", **kwargs)
    message = str(e.value)
    assert e.value.argument == argument and words in message, message
    assert "invalid argument" not in message, message


def test_an_error_of_an_argument_given_still_names_it(tmp_path, arrays):
    # The same faults, with the argument given: it is the invalid argument.
    plain = tmp_path / "plain.gfd"
    gpufeed.pack(arrays[0], plain, labels=arrays[1])
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(plain, output="numpy", images={"image_field": "jpeg"})
    assert "invalid argument images['image_field']: no field `jpeg`" in str(e.value)
    mds = write_mds(tmp_path / "mds", ["__index__", "x"])
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(mds, output="numpy", fields=["__index__"])
    assert "invalid argument fields: `__index__` is a key gpufeed reserves" in str(e.value)
    picked = gpufeed.Loader(mds, fields=["x"], batch_size=10, output="numpy")
    assert [b["x"].tolist() for b in picked] == [[2 * i for i in range(10)]]
    # A pattern of shards is the path argument, as the user typed it.
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(str(tmp_path / "shard-{000..001.tar"), output="numpy")
    assert e.value.argument == "path_or_paths" and "unbalanced braces" in str(e.value)
    assert "invalid argument path_or_paths:" in str(e.value)


@pytest.mark.parametrize("given", [False, True])
def test_holding_every_batch_says_what_the_caller_did(packed, given):
    budget = dict(pool_budget=3 * 4096) if given else {}
    loader = gpufeed.Loader(packed, batch_size=10, workers=1, prefetch=1, output="numpy", **budget)
    with pytest.raises(gpufeed.ConfigError) as e:
        list(loader)
    message = str(e.value)
    assert e.value.argument == "pool_budget" and "invalid argument" not in message, message
    assert "you hold 3 batches, all that the pool's budget allows" in message, message
    assert ("pool_budget= was not given" in message) is not given, message
    assert "raise pool_budget=" in message, message


def test_without_torch_or_numpy_the_output_error_says_none_was_given(packed, monkeypatch):
    from gpufeed import _loader

    # As if neither were installed.
    monkeypatch.setattr(_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(packed)
    message = str(e.value)
    assert e.value.argument == "output" and "output= was not given" in message, message
    assert "invalid argument" not in message, message


def test_bfloat16_images_without_torch_say_numpy_was_the_default(folder):
    if importlib_find("torch"):
        pytest.skip("with torch installed the default output is torch, which has bfloat16")
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(folder, images={"size": 8, "dtype": "bfloat16"})
    message = str(e.value)
    assert e.value.argument == "output" and "output= was not given" in message, message
    assert "invalid argument" not in message, message
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(folder, images={"size": 8, "dtype": "bfloat16"}, output="numpy")
    assert "invalid argument output: numpy has no bfloat16" in str(e.value)


def importlib_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_gpu_decode_on_a_host_loader_is_a_config_error(folder):
    # decode='gpu' decodes on a GPU: without device= it is refused, naming the argument;
    # 'auto' decodes on the CPU there.
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(folder, images={"size": 16}, decode="gpu", output="numpy")
    assert e.value.argument == "decode" and "device=" in str(e.value), str(e.value)
    batch = next(iter(gpufeed.Loader(folder, images={"size": 16}, decode="auto", output="numpy")))
    assert batch["image"].shape[1:] == (3, 16, 16)
