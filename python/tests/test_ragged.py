"""Ragged fields through ``gpufeed.Loader``: variable-size fields (WebDataset members, encoded
images named in ``fields=``) arrive as ``(values, offsets)`` views of the batch buffer, or as
a list of one view per sample, exactly; a batch over its ``ragged_budget`` raises, naming it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from conftest import live


def text(i: int) -> bytes:
    """Sample i's text: 0 to 299 bytes of ASCII (a `.txt` member is UTF-8 checked), some empty."""
    n = (i * 2654435761) % 300 if i % 5 else 0
    return bytes((i * 31 + j * 7) % 128 for j in range(n))


def tokens(i: int) -> np.ndarray:
    """Sample i's raw member: i % 7 uint32s."""
    return np.arange(i % 7, dtype=np.uint32) + 1000 * i


N = 60


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """Three WebDataset shards of 20 samples each: `txt` (text(i)) and `bin` (tokens(i))."""
    root = tmp_path / "wds"
    root.mkdir()
    for s in range(3):
        with tarfile.open(root / f"shard-{s:04d}.tar", "w") as tar:
            for i in range(s * 20, (s + 1) * 20):
                for ext, data in (("txt", text(i)), ("bin", tokens(i).tobytes())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


def sample_of(batch_text, i: int) -> bytes:
    values, offsets = batch_text
    return bytes(values[offsets[i] : offsets[i + 1]])


@pytest.mark.parametrize("batch_parts", [1, 3])
def test_ragged_fields_arrive_as_values_and_offsets_exactly(shards, batch_parts):
    loader = gpufeed.Loader(
        shards,
        batch_size=8,
        shuffle=3,
        workers=2,
        batch_parts=batch_parts,
        indices=True,
        output="numpy",
    )
    assert loader.fields == {"bin": ("uint8", (None,)), "txt": ("uint8", (None,))}
    seen = []
    for batch in loader:
        indices = [int(i) for i in batch[gpufeed.INDEX_KEY]]
        values, offsets = batch["txt"]
        assert values.dtype == np.uint8 and offsets.dtype == np.int64
        assert offsets.shape == (len(indices) + 1,) and offsets[0] == 0
        assert values.shape == (offsets[-1],)
        assert bytes(values) == b"".join(text(i) for i in indices)
        for pos, i in enumerate(indices):
            assert sample_of(batch["txt"], pos) == text(i)
            raw = sample_of(batch["bin"], pos)
            assert np.array_equal(np.frombuffer(raw, np.uint32), tokens(i))
        seen.extend(indices)
    assert sorted(seen) == list(range(N))


def test_a_list_of_one_view_per_sample_on_request(shards):
    # Counted from here: batches other tests left to the garbage collector do not count.
    base = live()[0]
    loader = gpufeed.Loader(shards, batch_size=7, ragged="list", indices=True, output="numpy")
    batch = next(iter(loader))
    indices = [int(i) for i in batch[gpufeed.INDEX_KEY]]
    assert isinstance(batch["txt"], list) and len(batch["txt"]) == len(indices)
    for array, i in zip(batch["txt"], indices):
        assert array.dtype == np.uint8 and bytes(array) == text(i)
    # Views of the batch buffer: the batch lives as long as one of them.
    held = batch["txt"][3]
    del batch, array
    assert live()[0] == base + 1
    del held
    assert live()[0] == base


def test_ragged_views_share_the_batch_buffer(shards):
    base = live()[0]
    loader = gpufeed.Loader(shards, batch_size=10, output="dlpack")
    batch = next(iter(loader))
    values, offsets = batch["txt"]
    assert isinstance(values, gpufeed.Array) and isinstance(offsets, gpufeed.Array)
    assert offsets.dtype == "int64" and offsets.shape == (11,)
    v = np.from_dlpack(values)
    # One buffer: the values sit after the offsets, which sit after nothing else here.
    o = np.from_dlpack(offsets)
    assert v.__array_interface__["data"][0] > o.__array_interface__["data"][0]
    del batch, values, offsets
    assert live()[0] == base + 1, "the numpy views keep the batch"
    del v, o
    assert live()[0] == base


def test_torch_gets_values_and_offsets_a_nested_tensor_takes(shards):
    torch = pytest.importorskip("torch")
    loader = gpufeed.Loader(shards, batch_size=8, fields=["bin"], output="torch", indices=True)
    batch = next(iter(loader))
    values, offsets = batch["bin"]
    assert values.dtype == torch.uint8 and offsets.dtype == torch.int64
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    indices = batch[gpufeed.INDEX_KEY].tolist()
    assert lengths == [4 * (i % 7) for i in indices]


def test_a_batch_over_its_budget_raises_naming_it_and_the_next_one_comes(shards):
    # Batches of 4 in order: batch 0 holds samples 0..4 (0 + 3 texts of up to 299 bytes).
    sizes = [sum(len(text(i)) for i in range(b * 4, b * 4 + 4)) for b in range(N // 4)]
    budget = sorted(sizes)[len(sizes) // 2]
    over = [b for b, size in enumerate(sizes) if size > budget]
    loader = gpufeed.Loader(
        shards, batch_size=4, fields=["txt"], ragged_budget=budget, output="numpy"
    )
    it = iter(loader)
    for b in range(N // 4):
        if b in over:
            with pytest.raises(gpufeed.ConfigError) as e:
                next(it)
            message = str(e.value)
            assert "ragged_budget" in message and "`txt`" in message, message
            assert e.value.batch == b
            assert e.value.argument == "ragged_budget"
        else:
            values, offsets = next(it)["txt"]
            assert offsets[-1] == sizes[b]
    # Named per field, and a name that is not a ragged field is refused.
    gpufeed.Loader(shards, batch_size=4, ragged_budget={"txt": 1 << 16, "bin": 1 << 10})
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(shards, batch_size=4, ragged_budget={"text": 100})
    assert "no ragged field `text`" in str(e.value)
    with pytest.raises(gpufeed.ConfigError):
        gpufeed.Loader(shards, batch_size=4, ragged="nested")


def test_encoded_images_named_in_fields_arrive_as_their_bytes(tmp_path, folder):
    packed = tmp_path / "images.gfd"
    gpufeed.pack(folder, packed)
    loader = gpufeed.Loader(packed, batch_size=5, fields=["image", "label"], output="numpy")
    files = sorted(p for p in folder.rglob("*.png"))
    seen = 0
    for batch in loader:
        for pos, _ in enumerate(batch["label"]):
            assert sample_of(batch["image"], pos) == files[seen + pos].read_bytes()
        seen += len(batch["label"])
    assert seen == len(files)
