"""Data sets written by the real writers (webdataset's ``ShardWriter``, mosaicml-streaming's
``MDSWriter``, installed from python/requirements-writers.txt) in the test run, read back
by gpufeed and by the packages' own readers, and compared sample by sample, field by field:
every member type webdataset decodes and every column encoding streaming's writer offers
(pkl aside: refused), compressed (zstd, gz) and not, over several shards (and an empty tar
shard).

streaming's own reading is its ``MDSReader`` (the shard reader ``StreamingDataset`` uses;
``StreamingDataset`` itself needs torch, which CI does not install), with compressed shards
decompressed by streaming's ``compression.decompress`` into a copy, as its ``Stream`` does.
"""

from __future__ import annotations

import decimal
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import sys
import tarfile
import types

import numpy as np
import pytest
from PIL import Image

import gpufeed


def _streaming():
    """streaming's MDS writer, reader, encodings and compression, without torch: its package
    __init__ imports torch (for its DataLoader) and its utils torch.distributed, brotli and
    snappy, which the MDS code does not use; empty modules stand in for those."""
    if "streaming.base.format.mds.writer" in sys.modules:
        return sys.modules["_gpufeed_streaming"]
    site = os.path.dirname(importlib.util.find_spec("streaming").origin)
    for name, sub in [("streaming", ""), ("streaming.base", "base")]:
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(site, sub)]
        sys.modules[name] = m

    class Stub(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        ROOTS = ("torch", "brotli", "snappy", "transformers")

        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] in self.ROOTS:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            m = Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    finder = Finder()
    sys.meta_path.insert(0, finder)
    try:
        from streaming.base import compression
        from streaming.base.format.mds import encodings
        from streaming.base.format.mds.reader import MDSReader
        from streaming.base.format.mds.writer import MDSWriter
    finally:
        # The stand-ins served these imports only: the rest of the session imports the real
        # packages, or finds them missing (a stand-in `torch` would pass for torch, and the
        # loaders would hand their batches to it).
        sys.meta_path.remove(finder)
        for name in [n for n, m in sys.modules.items() if isinstance(m, Stub)]:
            del sys.modules[name]

    ns = types.SimpleNamespace(
        MDSReader=MDSReader, MDSWriter=MDSWriter, encodings=encodings, compression=compression
    )
    sys.modules["_gpufeed_streaming"] = ns
    return ns


def image(seed, size=(10, 7)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


# ---- WebDataset ------------------------------------------------------------------------


def write_wds(d):
    import webdataset as wds

    d.mkdir()
    with wds.ShardWriter(str(d / "shard-%06d.tar"), maxcount=3, verbose=0) as sink:
        for i in range(8):
            sink.write(
                {
                    "__key__": f"train/s{i:04d}",
                    "jpg": image(i),
                    "cls": i % 4,
                    "txt": f"caption {i} é",
                    "json": {"i": i, "tags": ["a", "b"][: i % 3]},
                    "npy": np.arange(6, dtype=np.float32).reshape(2, 3) * i,
                    "vec.npy": np.arange(i + 1, dtype=np.int16),
                }
            )
    # An empty shard (a tar with no member), last.
    with tarfile.open(d / "shard-000099.tar", "w"):
        pass
    return sorted(str(p) for p in d.glob("*.tar"))


def test_webdataset_shards_read_as_webdataset_reads_them(tmp_path):
    import webdataset as wds

    d = tmp_path / "wds"
    urls = write_wds(d)
    theirs = list(wds.WebDataset(urls, shardshuffle=False).decode())
    assert len(theirs) == 8
    info = gpufeed.inspect(d)
    assert (info["format"], info["shards"], info["samples"]) == ("webdataset tar", 4, 8)
    kinds = {f["name"]: f for f in info["fields"]}
    assert kinds["cls"]["kind"] == "tensor" and kinds["cls"]["dtype"] == "int64"
    assert kinds["npy"]["shape"] == [2, 3]
    assert kinds["vec.npy"]["codec"] == "npy"
    for i, want in enumerate(theirs):
        got = gpufeed.read_sample(d, i)
        assert set(got) == {k for k in want if not k.startswith("__")}
        assert int(got["cls"]) == want["cls"]
        assert got["txt"].decode() == want["txt"]
        assert json.loads(got["json"]) == want["json"]
        np.testing.assert_array_equal(got["npy"], want["npy"])
        assert got["npy"].dtype == want["npy"].dtype
        vec = np.load(io.BytesIO(got["vec.npy"]))
        np.testing.assert_array_equal(vec, want["vec.npy"])
        assert vec.dtype == want["vec.npy"].dtype
        assert got["jpg"] == want["jpg"], "the JPEG member's bytes"
    # The fixed fields through the loader, in order.
    loader = gpufeed.Loader(d, batch_size=8, fields=["cls", "npy"], output="numpy")
    batch = next(iter(loader))
    assert batch["cls"].tolist() == [w["cls"] for w in theirs]
    np.testing.assert_array_equal(batch["npy"], np.stack([w["npy"] for w in theirs]))
    # And the image pipeline, with webdataset's jpg and cls found by their names.
    loader = gpufeed.Loader(d, batch_size=8, images={"size": 8}, output="numpy")
    batch = next(iter(loader))
    assert batch["image"].shape == (8, 3, 8, 8)
    assert sorted(batch["label"].tolist()) == sorted(w["cls"] for w in theirs)


# ---- MDS -------------------------------------------------------------------------------

COLUMNS = {
    "id": "int",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "f16": "float16",
    "f32": "float32",
    "f64": "float64",
    "name": "str",
    "sint": "str_int",
    "sfloat": "str_float",
    "sdec": "str_decimal",
    "raw": "bytes",
    "meta": "json",
    "img": "jpeg",
    "mask": "png",
    "pil": "pil",
    "fixed": "ndarray:int16:2,3",
    "dyn_t": "ndarray:float32",
    "dyn": "ndarray",
}


def mds_sample(i):
    rng = np.random.default_rng(i)
    return {
        "id": i * 1000 - 3,
        "u8": i,
        "u16": 60000 + i,
        "u32": 4_000_000_000 + i,
        "u64": 2**64 - 1 - i,
        "i8": -i,
        "i16": -30000 + i,
        "i32": -(2**31) + i,
        "i64": -(2**62) + i,
        "f16": 0.5 + i,
        "f32": 1.25 * i,
        "f64": -2.5 * i,
        "name": f"sample {i} é",
        "sint": -(10**15) - i,
        "sfloat": i / 3,
        "sdec": decimal.Decimal(f"{i}.125"),
        "raw": bytes(range(i * 3)),
        "meta": {"i": i, "tags": ["a", "b"][: i % 3]},
        "img": image(200 + i),
        "mask": image(300 + i, (3, 2)),
        "pil": image(400 + i, (4, 3)),
        "fixed": np.arange(6, dtype=np.int16).reshape(2, 3) * (i + 1),
        "dyn_t": rng.random((i % 3 + 1, 2)).astype(np.float32),
        "dyn": np.arange(i + 1, dtype=np.uint8 if i % 2 else np.int64),
    }


def write_mds(d, compression):
    s = _streaming()
    with s.MDSWriter(
        out=str(d), columns=COLUMNS, compression=compression, size_limit=4000, hashes=["sha1", "xxh64"]
    ) as w:
        for i in range(12):
            w.write(mds_sample(i))
    return json.loads((d / "index.json").read_text())


def streaming_reads(d, index):
    """What streaming's reader gives, sample by sample: compressed shards decompressed by
    streaming's own code into a copy of the directory first, as its Stream does."""
    s = _streaming()
    ref = d.parent / (d.name + "-ref")
    shutil.copytree(d, ref)
    out = []
    for shard in index["shards"]:
        if shard["zip_data"]:
            zip_bytes = (ref / shard["zip_data"]["basename"]).read_bytes()
            raw = s.compression.decompress(shard["compression"], zip_bytes)
            (ref / shard["raw_data"]["basename"]).write_bytes(raw)
        reader = s.MDSReader.from_json(str(ref), None, shard)
        out.extend(reader.get_item(j) for j in range(shard["samples"]))
    return out


def same_image(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("compression", [None, "zstd", "zstd:9", "gz"])
def test_mds_shards_read_as_streaming_reads_them(tmp_path, monkeypatch, compression):
    s = _streaming()
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "mds"
    index = write_mds(d, compression)
    assert len(index["shards"]) >= 3, "several shards"
    if compression:
        assert not list(d.glob("*.mds")), "the writer leaves the compressed files only"
    theirs = streaming_reads(d, index)
    assert len(theirs) == 12
    info = gpufeed.inspect(d)
    assert (info["format"], info["samples"], info["compression"]) == ("MDS", 12, compression)
    fields = {f["name"]: f for f in info["fields"]}
    assert fields["sint"]["dtype"] == "int64" and fields["sfloat"]["dtype"] == "float64"
    assert fields["meta"]["codec"] == "json" and fields["name"]["codec"] == "utf8"
    for i, want in enumerate(theirs):
        got = gpufeed.read_sample(d, i)
        assert set(got) == set(COLUMNS)
        for col in ["id", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64", "f16", "f32", "f64"]:
            assert got[col].shape == ()
            assert got[col] == want[col], (i, col)
        assert int(got["sint"]) == want["sint"]
        assert float(got["sfloat"]) == want["sfloat"]
        assert decimal.Decimal(got["sdec"].decode()) == want["sdec"]
        assert got["name"].decode() == want["name"]
        assert got["raw"] == want["raw"]
        assert json.loads(got["meta"]) == want["meta"]
        np.testing.assert_array_equal(got["fixed"], want["fixed"])
        for col in ["dyn_t", "dyn"]:
            mine = s.encodings.mds_decode(COLUMNS[col], got[col])
            np.testing.assert_array_equal(mine, want[col])
            assert mine.dtype == want[col].dtype
        for col in ["img", "mask", "pil"]:
            same_image(s.encodings.mds_decode(COLUMNS[col], got[col]), want[col])
    # Fixed columns through the loader, shuffled: every sample once, as streaming read it.
    loader = gpufeed.Loader(d, batch_size=5, shuffle=3, fields=["id", "sint", "fixed"], output="numpy")
    seen = {}
    for batch in loader:
        for k, i in enumerate(batch["id"].tolist()):
            seen[i] = (int(batch["sint"][k]), batch["fixed"][k])
    assert sorted(seen) == sorted(w["id"] for w in theirs)
    for w in theirs:
        assert seen[w["id"]][0] == w["sint"]
        np.testing.assert_array_equal(seen[w["id"]][1], w["fixed"])
    # Variable-size columns through the loader: ragged fields, (values, offsets) per batch,
    # each sample's bytes exactly what streaming read.
    by_id = {w["id"]: w for w in theirs}
    loader = gpufeed.Loader(d, batch_size=5, shuffle=3, fields=["id", "name", "raw"], output="numpy")
    read = 0
    for batch in loader:
        for k, i in enumerate(batch["id"].tolist()):
            for col, want in (("name", by_id[i]["name"].encode()), ("raw", by_id[i]["raw"])):
                values, offsets = batch[col]
                assert bytes(values[offsets[k] : offsets[k + 1]]) == want, (i, col)
            read += 1
    assert read == len(theirs)
    # The image pipeline on the jpeg column (the one JPEG field), unlabelled.
    loader = gpufeed.Loader(d, batch_size=4, images={"size": 8, "label_field": None}, output="numpy")
    assert next(iter(loader))["image"].shape == (4, 3, 8, 8)


def test_a_corrupt_compressed_mds_shard_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "mds"
    index = write_mds(d, "zstd")
    name = index["shards"][1]["zip_data"]["basename"]
    b = bytearray((d / name).read_bytes())
    b[len(b) // 2] ^= 0xFF
    (d / name).write_bytes(bytes(b))
    first = index["shards"][0]["samples"]
    gpufeed.read_sample(d, 0)
    with pytest.raises(gpufeed.DataError) as e:
        gpufeed.read_sample(d, first)
    assert name in str(e.value), e.value
    assert "xxh64" in str(e.value), e.value


@pytest.mark.parametrize("hashes", [["xxh3_64"], ["xxh64"]])
def test_a_flipped_byte_in_a_local_mds_shard_with_hashes_is_refused(tmp_path, hashes):
    """streaming's MDSWriter with hashes, one byte of a sample flipped inside a shard (its
    size unchanged): the shard is checked against its index's hash when it is opened, so the
    loader raises a DataError naming the shard and the sample instead of delivering the byte
    (it did, before: only inspect(verify=True) looked at the hashes)."""
    s = _streaming()
    d = tmp_path / "mds"
    with s.MDSWriter(out=str(d), columns={"id": "int", "raw": "bytes"}, size_limit=2000, hashes=hashes) as w:
        for i in range(40):
            w.write({"id": i, "raw": bytes([i]) * 100})
    shards = json.loads((d / "index.json").read_text())["shards"]
    assert len(shards) >= 3 and all(sh["raw_data"]["hashes"] for sh in shards)
    first, count = shards[0]["samples"], shards[1]["samples"]
    victim = d / shards[1]["raw_data"]["basename"]
    b = bytearray(victim.read_bytes())
    b[-1] ^= 0x10  # the last sample's last byte of `raw`
    victim.write_bytes(bytes(b))
    # Sample by sample: shard 0 reads, shard 1 is refused naming it.
    assert gpufeed.read_sample(d, 0)["id"] == 0
    with pytest.raises(gpufeed.DataError) as e:
        gpufeed.read_sample(d, first + count - 1)
    assert e.value.path == str(victim) and hashes[0] in str(e.value), e.value
    # Through the loader, in order: every batch of shard 0, then the error, naming the shard
    # and a sample of it; no sample of the flipped shard is delivered.
    loader = gpufeed.Loader(d, batch_size=1, fields=["id", "raw"], output="numpy")
    delivered = []
    with pytest.raises(gpufeed.DataError) as e:
        for batch in loader:
            delivered.append(int(batch["id"][0]))
    assert delivered == list(range(first)), delivered
    assert e.value.path == str(victim), e.value
    assert first <= e.value.sample < first + count, e.value
    assert victim.name in str(e.value) and "the index says" in str(e.value), e.value


def test_a_pickle_column_is_refused_saying_why(tmp_path):
    s = _streaming()
    d = tmp_path / "pkl"
    with s.MDSWriter(out=str(d), columns={"x": "int", "obj": "pkl"}) as w:
        w.write({"x": 1, "obj": {"a": 1}})
    with pytest.raises(gpufeed.Error) as e:
        gpufeed.inspect(d)
    assert "pkl" in str(e.value) and "unpickling" in str(e.value), e.value
