"""What ``stats()`` says, and what errors tell a Python user to do: a sharded data set's
figures (its open shards, its store), images skipped counted in the batches delivered, an image
refused by ``max_pixels`` naming the Python argument that raises it."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from conftest import write_png

MDS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "streaming" / "mds"


def test_a_sharded_data_set_s_figures_are_in_stats(tmp_path, packed):
    mds = tmp_path / "mds"
    shutil.copytree(MDS, mds)
    shards = len(json.loads((mds / "index.json").read_text())["shards"])
    loader = gpufeed.Loader(mds, batch_size=3, fields=["id"], output="numpy")
    for _ in loader:
        pass
    s = loader.stats()
    assert s["shards"]["count"] == shards, s["shards"]
    assert s["shards"]["opens"] >= shards and s["shards"]["open_limit"] >= 1, s["shards"]
    assert 1 <= s["shards"]["open_now"] <= s["shards"]["open_limit"], s["shards"]
    assert s["shards"]["evictions"] == s["shards"]["opens"] - s["shards"]["open_now"]
    # Local shards: no store that downloads.
    assert s["store"] is None
    json.dumps(s)
    # A single file has neither.
    plain = gpufeed.Loader(packed, batch_size=100, output="numpy").stats()
    assert plain["shards"] is None and plain["store"] is None


def bad_folder(root: Path, good: int, bad: int) -> Path:
    """An ImageFolder of one class: `good` PNGs, then `bad` files that are no image."""
    (root / "only").mkdir(parents=True)
    for i in range(good):
        write_png(root / "only" / f"{i:03d}.png", np.full((8, 8, 3), 9, np.uint8))
    for i in range(good, good + bad):
        (root / "only" / f"{i:03d}.png").write_bytes(b"not an image")
    return root


def test_images_skipped_are_counted_in_the_batches_delivered(tmp_path):
    # Every image after the first two is bad; batches of 2 in file order, made ahead.
    root = bad_folder(tmp_path / "folder", good=2, bad=10)
    loader = gpufeed.Loader(
        root, batch_size=2, workers=1, prefetch=4, output="numpy",
        images={"size": 8, "skip_bad_images": True, "train": False},
    )
    it = iter(loader)
    first, second = next(it), next(it)
    assert (first["label"] == 0).all() and (second["label"] == -1).all()
    # The worker has made batches ahead of the two delivered, their images skipped too.
    while loader.stats()["stages"]["batches_made"] < 4:
        time.sleep(0.001)
    s = loader.stats()
    assert s["samples"] == 4
    # Counted as delivered, not as made: before, this was 6 (the batch made ahead too).
    assert s["images"]["skipped"] == 2, s["images"]
    assert "skipped" in s["text"] and "2 of the samples delivered" in s["text"], s["text"]
    rest = [b["label"].tolist() for b in it]
    assert loader.stats()["images"]["skipped"] == 10 and len(rest) == 4


def test_an_image_over_max_pixels_names_the_python_argument(tmp_path, folder):
    # The folder's images are 30x40: 1,200 pixels.
    with pytest.raises(gpufeed.DataError) as e:
        next(iter(gpufeed.Loader(folder, batch_size=4, images={"size": 8, "max_pixels": 1199})))
    message = str(e.value)
    assert e.value.kind == "image" and e.value.sample is not None, message
    assert "1200 pixels" in message and "max_pixels limit of 1199" in message, message
    assert "raise it with images={..., 'max_pixels': N}" in message, message
    assert "ImageTransformBuilder" not in message, message
    enough = gpufeed.Loader(folder, batch_size=12, images={"size": 8, "max_pixels": 1200})
    assert len(list(enough)) == 1
    # Skipped as any bad image.
    skip = gpufeed.Loader(
        folder, batch_size=12, output="numpy",
        images={"size": 8, "max_pixels": 1000, "skip_bad_images": True},
    )
    assert (next(iter(skip))["label"] == -1).all()
    assert "raise it with images=" in skip.stats()["images"]["last_skipped"]
    for bad in (0, -1, "many"):
        with pytest.raises((gpufeed.ConfigError, TypeError)) as e:
            gpufeed.Loader(folder, images={"size": 8, "max_pixels": bad})
        assert "images['max_pixels']" in str(e.value), e.value
