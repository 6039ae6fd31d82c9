"""Sharded data sets through ``gpufeed.Loader``: a shard directory (the MDS fixture that
mosaicml-streaming wrote, tests/fixtures/streaming/mds) and a directory of WebDataset tar
shards go to the library's ``open`` as a path does; a URL reaches it too."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

import gpufeed

FIXTURES = (
    Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "streaming"
)


@pytest.mark.parametrize("as_path", [True, False])
def test_a_shard_directory_reads_every_sample_once(tmp_path, as_path):
    mds = tmp_path / "mds"
    shutil.copytree(FIXTURES / "mds", mds)
    index = json.loads((mds / "index.json").read_text())
    n = sum(s["samples"] for s in index["shards"])
    loader = gpufeed.Loader(
        mds if as_path else str(mds),
        batch_size=3,
        shuffle=5,
        fields=["id", "fixed"],
        output="numpy",
    )
    ids = []
    for batch in loader:
        assert batch["fixed"].shape[1:] == (2, 3)
        assert batch["fixed"].dtype == np.int16
        ids.extend(int(v) for v in batch["id"])
    assert len(ids) == n
    assert len(set(ids)) == n, "a sample came twice"


def test_a_directory_of_tar_shards_is_not_taken_for_an_image_folder(tmp_path):
    shards = tmp_path / "wds"
    shards.mkdir()
    for s in range(3):
        with tarfile.open(shards / f"shard-{s:04d}.tar", "w") as tar:
            for i in range(10):
                k = s * 10 + i
                for ext, value in (("label.u32", k), ("x.u32", 1000 + k)):
                    data = np.uint32(value).tobytes()
                    info = tarfile.TarInfo(f"{k:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    # Bytes fields (WebDataset members, named by their extensions), batched as ragged fields:
    # the directory reached the shard reader (an image folder has the fields image, label,
    # size and path).
    loader = gpufeed.Loader(shards, batch_size=4, output="numpy")
    assert set(loader.fields) == {"label.u32", "x.u32"}
    labels = []
    for batch in loader:
        values, offsets = batch["label.u32"]
        assert list(offsets) == [4 * i for i in range(len(offsets))]
        labels.extend(np.frombuffer(bytes(values), np.uint32).tolist())
    assert labels == list(range(30))


def test_a_url_reaches_the_library(monkeypatch):
    # A build without the `s3` feature says so, naming the URL; one with it finds no server
    # at this port (on this machine: nothing leaves it). Either way the URL was not taken for
    # a local path.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(gpufeed.Error) as e:
        gpufeed.Loader("s3://no-bucket-here/prefix", batch_size=4)
    assert "s3://no-bucket-here/prefix" in str(e.value), e.value
    if "reads no object store" in str(e.value):
        # A pip user is told the pip command that builds the package with them, not a
        # cargo feature.
        assert 'pip install ./python --config-settings=build-args="--features s3"' in str(e.value), e.value
        assert "build it with" not in str(e.value), e.value
