"""Data as the hub ships it, written by the real tools (pyarrow, `datasets`, polars, DuckDB),
read through ``gpufeed.Loader``: every field of every row equals what pyarrow reads, byte for
byte; nulls, corrupt pages and DatasetDicts give errors that say what is wrong."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import gpufeed

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 300


def table(n: int = N, start: int = 0):
    """A table with a column of every kind the readers map (no nulls)."""
    v = list(range(start, start + n))
    text = [f"row {i} " + "é" * (i % 5) + "x" * (i % 37) for i in v]
    return pa.table(
        {
            "id": pa.array(v, pa.int64()),
            "small": pa.array([i % 128 - 64 for i in v], pa.int8()),
            "u16": pa.array([i * 7 % 65536 for i in v], pa.uint16()),
            "f32": pa.array([i / 7 for i in v], pa.float32()),
            "f64": pa.array([i / 3 for i in v], pa.float64()),
            "flag": pa.array([i % 3 == 0 for i in v], pa.bool_()),
            "day": pa.array(v, pa.int32()).cast(pa.date32()),
            "when": pa.array([i * 1_000_003 for i in v], pa.int64()).cast(pa.timestamp("us")),
            "text": pa.array(text, pa.string()),
            "animal": pa.array([["cat", "dog", "bird"][i % 3] for i in v]).dictionary_encode(),
            "big_text": pa.array([t * 2 for t in text], pa.large_string()),
            "blob": pa.array([bytes([i % 256]) * (i % 11) for i in v], pa.binary()),
            "big_blob": pa.array([bytes([i * 3 % 256]) * (i % 29) for i in v], pa.large_binary()),
            "vec": pa.array([[i + k / 4 for k in range(4)] for i in v], pa.list_(pa.float32(), 4)),
            "tokens": pa.array([[i * 10 + k for k in range(i % 9)] for i in v], pa.list_(pa.int32())),
            "meta": pa.array(
                [{"a": i * 2, "b": f"b{i}", "c": {"d": i / 5}} for i in v],
                pa.struct(
                    [("a", pa.int32()), ("b", pa.string()), ("c", pa.struct([("d", pa.float64())]))]
                ),
            ),
        }
    )


def flat_columns(t):
    """(field name, pyarrow array) for each field gpufeed makes: struct children flattened."""
    out = []

    def walk(name, arr):
        if pa.types.is_struct(arr.type) and not is_image(arr.type):
            for k in range(arr.type.num_fields):
                walk(f"{name}.{arr.type.field(k).name}", arr.field(k))
        else:
            out.append((name, arr))

    for name in t.column_names:
        walk(name, t.column(name).combine_chunks())
    return out


def is_image(ty) -> bool:
    return pa.types.is_struct(ty) and sorted(ty.field(k).name for k in range(ty.num_fields)) == [
        "bytes",
        "path",
    ]


def expected_bytes(arr) -> list[bytes]:
    """Each row's bytes as gpufeed holds them, computed from pyarrow's values."""
    ty = arr.type
    if pa.types.is_dictionary(ty):
        return expected_bytes(arr.cast(ty.value_type))
    if is_image(ty):
        return [v["bytes"] for v in arr.to_pylist()]
    if pa.types.is_string(ty) or pa.types.is_large_string(ty) or pa.types.is_string_view(ty):
        return [v.encode() for v in arr.to_pylist()]
    if pa.types.is_binary(ty) or pa.types.is_large_binary(ty) or pa.types.is_fixed_size_binary(ty):
        return arr.to_pylist()
    if pa.types.is_boolean(ty):
        return [bytes([int(v)]) for v in arr.to_pylist()]
    if pa.types.is_list(ty) or pa.types.is_large_list(ty) or pa.types.is_fixed_size_list(ty):
        dtype = ty.value_type.to_pandas_dtype()
        return [np.asarray(v, dtype=dtype).tobytes() for v in arr.to_pylist()]
    if pa.types.is_date32(ty) or pa.types.is_timestamp(ty):
        storage = pa.int32() if pa.types.is_date32(ty) else pa.int64()
        return [np.asarray(v, dtype=storage.to_pandas_dtype()).tobytes() for v in arr.cast(storage).to_pylist()]
    dtype = ty.to_pandas_dtype()
    return [np.asarray(v, dtype=dtype).tobytes() for v in arr.to_pylist()]


def value_of(col, k: int) -> bytes:
    """Sample k's bytes of a batch's field: a tensor row, or a ragged field's slice."""
    if isinstance(col, tuple):
        values, offsets = col
        return np.asarray(values[offsets[k] : offsets[k + 1]]).tobytes()
    if isinstance(col, list):
        return np.asarray(col[k]).tobytes()
    return np.ascontiguousarray(col[k]).tobytes()


def assert_reads_as_pyarrow(path, theirs, fields=None, **loader_args):
    """Reads `path` in order and compares every field of every row with `theirs` (a pyarrow
    table)."""
    columns = flat_columns(theirs)
    names = [n for n, _ in columns if fields is None or n in fields]
    want = {n: expected_bytes(a) for n, a in columns if n in names}
    loader = gpufeed.Loader(str(path), batch_size=64, fields=names, output="numpy", **loader_args)
    row = 0
    for batch in loader:
        b = len(batch[names[0]]) if not isinstance(batch[names[0]], tuple) else len(batch[names[0]][1]) - 1
        for k in range(b):
            for n in names:
                assert value_of(batch[n], k) == want[n][row + k], (row + k, n)
        row += b
    assert row == theirs.num_rows


@pytest.mark.parametrize("compression", ["snappy", "zstd", "none"])
@pytest.mark.parametrize("group_rows", [1, 7, 100_000])
def test_pyarrow_parquet_reads_byte_for_byte(tmp_path, compression, group_rows):
    t = table()
    p = tmp_path / "t.parquet"
    pq.write_table(t, p, compression=compression, row_group_size=group_rows, data_page_size=2048)
    assert_reads_as_pyarrow(p, pq.read_table(p))


def test_pyarrow_parquet_directory_pattern_and_page_index(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for k, (start, n) in enumerate([(0, 120), (120, 37), (157, 200)]):
        pq.write_table(
            table(n, start),
            d / f"train-{k:05d}-of-00003.parquet",
            row_group_size=50,
            write_page_index=True,
            data_page_size=1024,
        )
    pq.write_table(table(5, 1000), d / "test-00000-of-00001.parquet")
    theirs = pq.read_table([str(p) for p in sorted(d.glob("train-*.parquet"))])
    assert_reads_as_pyarrow(d / "train-*.parquet", theirs)


def test_a_null_names_its_row_and_column(tmp_path):
    t = pa.table({"id": pa.array(range(10), pa.int64()), "text": pa.array([None if i == 6 else str(i) for i in range(10)])})
    p = tmp_path / "n.parquet"
    pq.write_table(t, p)
    loader = gpufeed.Loader(str(p), batch_size=4, fields=["id", "text"], output="numpy")
    with pytest.raises(gpufeed.DataError, match=r"record 6.*`text` is null") as e:
        list(loader)
    assert "n.parquet" in str(e.value)
    # fill= gives the nulls a value, for Parquet and JSON lines alike.
    loader = gpufeed.Loader(
        str(p), batch_size=10, fields=["id", "text"], fill={"text": "?"}, output="numpy", ragged="list"
    )
    (batch,) = list(loader)
    assert bytes(batch["text"][6]) == b"?"
    lines = tmp_path / "n.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "label": None if i == 3 else i}) + "\n" for i in range(5)))
    loader = gpufeed.Loader(str(lines), batch_size=5, fill={"label": -1}, output="numpy")
    (batch,) = list(loader)
    assert batch["label"].reshape(-1).tolist() == [0, 1, 2, -1, 4]
    with pytest.raises(gpufeed.ConfigError, match="fill"):
        gpufeed.Loader(str(lines), batch_size=5, fill={"label": [1]})


def test_a_corrupt_page_is_caught_by_its_checksum(tmp_path):
    t = pa.table({"x": pa.array(np.arange(20_000, dtype=np.int64))})
    p = tmp_path / "c.parquet"
    pq.write_table(t, p, compression="none", write_page_checksum=True, use_dictionary=False)
    col = pq.ParquetFile(p).metadata.row_group(0).column(0)
    raw = bytearray(p.read_bytes())
    raw[col.data_page_offset + col.total_compressed_size // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(gpufeed.DataError, match=r"c\.parquet.*row group 0") as e:
        list(gpufeed.Loader(str(p), batch_size=1000, fields=["x"], output="numpy"))
    assert "CRC" in str(e.value) or "checksum" in str(e.value).lower(), str(e.value)


def test_arrow_ipc_stream_and_file_read_byte_for_byte(tmp_path):
    t = table(200)
    views = t.append_column("text_view", t.column("text").cast(pa.string_view()))
    for name, new in (("s.arrow", pa.ipc.new_stream), ("f.arrow", pa.ipc.new_file)):
        p = tmp_path / name
        with new(str(p), views.schema) as w:
            for b in views.to_batches(max_chunksize=33):
                w.write_batch(b)
        assert_reads_as_pyarrow(p, views)


def _datasets():
    return pytest.importorskip("datasets")


def hf_rows(n: int = 50):
    return {
        "id": list(range(n)),
        "text": [f"doc {i} " + "ü" * (i % 7) for i in range(n)],
        "score": [i / 9 for i in range(n)],
        "tokens": [list(range(i % 6)) for i in range(n)],
    }


def test_datasets_to_parquet_and_save_to_disk(tmp_path):
    ds_mod = _datasets()
    ds = ds_mod.Dataset.from_dict(hf_rows())
    p = tmp_path / "train.parquet"
    ds.to_parquet(str(p))
    assert_reads_as_pyarrow(p, pq.read_table(p))
    d = tmp_path / "saved"
    ds.save_to_disk(str(d))
    assert_reads_as_pyarrow(d, ds_mod.load_from_disk(str(d)).data.table)


def test_datasets_dataset_dict_by_split(tmp_path):
    ds_mod = _datasets()
    dd = ds_mod.DatasetDict(
        {"train": ds_mod.Dataset.from_dict(hf_rows(40)), "test": ds_mod.Dataset.from_dict(hf_rows(7))}
    )
    d = tmp_path / "dd"
    dd.save_to_disk(str(d))
    with pytest.raises(gpufeed.ConfigError, match="train, test"):
        gpufeed.Loader(str(d), batch_size=4, fields=["id"])
    assert_reads_as_pyarrow(d / "test", dd["test"].data.table)
    # split= reads one split of the dictionary's directory.
    loader = gpufeed.Loader(str(d), batch_size=64, fields=["id"], split="test", output="numpy")
    ids = np.concatenate([b["id"] for b in loader])
    assert ids.tolist() == dd["test"]["id"]
    with pytest.raises(gpufeed.ConfigError, match="split"):
        gpufeed.Loader(str(d), batch_size=4, fields=["id"], split="validation")


def png(i: int) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (9 + i % 3, 7), (i * 40 % 256, 10, 200))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def test_datasets_image_feature_is_an_image_field(tmp_path):
    ds_mod = _datasets()
    from PIL import Image

    images = [Image.open(io.BytesIO(png(i))) for i in range(12)]
    ds = ds_mod.Dataset.from_dict({"image": images, "label": [i % 4 for i in range(12)]})
    ds = ds.cast_column("image", ds_mod.Image())
    p = tmp_path / "img.parquet"
    ds.to_parquet(str(p))
    d = tmp_path / "img"
    ds.save_to_disk(str(d))
    for path, theirs in ((p, pq.read_table(p)), (d, ds_mod.load_from_disk(str(d)).data.table)):
        assert_reads_as_pyarrow(path, theirs)
        loader = gpufeed.Loader(str(path), batch_size=4, images={"size": 8}, output="numpy")
        batch = next(iter(loader))
        assert batch["image"].shape == (4, 3, 8, 8)
        assert batch["label"].tolist() == [0, 1, 2, 3]


def test_polars_and_duckdb_parquet(tmp_path):
    t = table(150)
    simple = t.select(["id", "f64", "text", "tokens", "blob"])
    polars = pytest.importorskip("polars")
    p = tmp_path / "polars.parquet"
    polars.from_arrow(simple).write_parquet(p, row_group_size=40)
    assert_reads_as_pyarrow(p, pq.read_table(p))
    duckdb = pytest.importorskip("duckdb")
    q = tmp_path / "duck.parquet"
    con = duckdb.connect()
    con.register("t", simple)
    con.execute(f"COPY t TO '{q}' (FORMAT PARQUET, ROW_GROUP_SIZE 64)")
    assert_reads_as_pyarrow(q, pq.read_table(q))


def test_shuffle_reads_each_row_once_in_windows(tmp_path):
    p = tmp_path / "s.parquet"
    pq.write_table(table(1000), p, row_group_size=300)
    ids = []
    for batch in gpufeed.Loader(str(p), batch_size=64, shuffle=5, fields=["id"], output="numpy"):
        ids.extend(batch["id"].tolist())
    assert sorted(ids) == list(range(1000))
    assert ids != sorted(ids)
