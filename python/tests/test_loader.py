"""Order and contents against the files, shuffle, epochs, outputs, zero copy, images."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gpufeed
from conftest import CLASSES, N, NUMPY_WRITES, Producer, class_color, rows


def epoch(loader) -> list:
    """One `for` loop over the loader: each batch's (data, label), copied."""
    return [(b["data"].copy(), b["label"].copy()) for b in loader]


def labels_of(loader) -> list:
    return [int(v) for b in loader for v in b["label"]]


def test_sequential_batches_are_the_files_rows_in_order(packed):
    loader = gpufeed.Loader(packed, batch_size=64, workers=2, output="numpy")
    assert len(loader) == 16 and loader.num_samples == N
    assert loader.fields == {"data": ("float32", (2, 3)), "label": ("int64", ())}
    batches = epoch(loader)
    assert [len(l) for _, l in batches] == [64] * 15 + [N - 15 * 64]
    assert np.array_equal(np.concatenate([d for d, _ in batches]), rows())
    assert np.array_equal(np.concatenate([l for _, l in batches]), np.arange(N))
    assert batches[0][0].dtype == np.float32 and batches[0][0].shape == (64, 2, 3)
    assert loader.position == 16 and loader.epoch == 0


def test_npy_files_and_several_files_read_as_one(tmp_path, arrays):
    loader = gpufeed.Loader(arrays[0], batch_size=100, output="numpy")
    assert np.array_equal(np.concatenate([b["data"].copy() for b in loader]), rows())
    a, b = tmp_path / "a.gfd", tmp_path / "b.gfd"
    np.save(tmp_path / "a.npy", rows()[:300])
    np.save(tmp_path / "b.npy", rows()[300:])
    gpufeed.pack(tmp_path / "a.npy", a)
    gpufeed.pack(tmp_path / "b.npy", b)
    shards = gpufeed.Loader([a, b], batch_size=128, output="numpy")
    assert np.array_equal(np.concatenate([x["data"].copy() for x in shards]), rows())


def test_shuffle_is_a_seeded_permutation_per_epoch(packed):
    def order(seed, ep, workers=2, prefetch=None):
        loader = gpufeed.Loader(
            packed, batch_size=50, shuffle=seed, workers=workers, prefetch=prefetch,
            epoch=ep, output="numpy",
        )
        return labels_of(loader)

    a = order(42, 0)
    assert sorted(a) == list(range(N)) and a != list(range(N))
    assert order(42, 0, workers=1, prefetch=1) == a, "the order depends on the workers"
    assert order(42, 0, workers=3, prefetch=7) == a
    assert order(42, 1) != a and sorted(order(42, 1)) == list(range(N))
    assert order(43, 0) != a
    assert order(True, 0) == order(0, 0)
    # Batches made in parts by several workers hold the same samples in the same places.
    for parts in (1, 3, 50):
        split = gpufeed.Loader(
            packed, batch_size=50, shuffle=42, workers=3, batch_parts=parts, output="numpy",
        )
        whole = gpufeed.Loader(
            packed, batch_size=50, shuffle=42, workers=1, batch_parts=1, output="numpy",
        )
        count = 0
        for x, y in zip(split, whole):
            assert np.array_equal(x["data"], y["data"]) and np.array_equal(x["label"], y["label"])
            count += 1
        assert count == N // 50
    # Contents follow the indices.
    loader = gpufeed.Loader(packed, batch_size=50, shuffle=42, output="numpy")
    for b in loader:
        assert np.array_equal(b["data"], rows()[b["label"]])


def test_for_loops_go_epoch_after_epoch_and_set_epoch_picks_one(packed):
    loader = gpufeed.Loader(packed, batch_size=100, shuffle=3, output="numpy")
    e0 = labels_of(loader)
    assert loader.epoch == 0
    e1 = labels_of(loader)  # no set_epoch: the next epoch
    assert loader.epoch == 1
    other = gpufeed.Loader(packed, batch_size=100, shuffle=3, output="numpy")
    other.set_epoch(1)
    assert labels_of(other) == e1 != e0
    # set_epoch at the top of each loop gives the same epochs.
    again = gpufeed.Loader(packed, batch_size=100, shuffle=3, output="numpy")
    seen = []
    for ep in range(2):
        again.set_epoch(ep)
        seen.append(labels_of(again))
    assert seen == [e0, e1]
    # A loop left early is taken up where it stopped.
    part = gpufeed.Loader(packed, batch_size=100, shuffle=3, output="numpy")
    head = []
    for b in part:
        head.extend(int(v) for v in b["label"])
        if len(head) == 300:
            break
    assert head + labels_of(part) == e0


def test_drop_last_and_the_short_last_batch(packed):
    loader = gpufeed.Loader(packed, batch_size=300, drop_last=True, output="numpy")
    assert len(loader) == 3
    assert [len(b["label"]) for b in loader] == [300] * 3


def test_dlpack_output_is_gpufeeds_array_and_views_the_batch(packed):
    loader = gpufeed.Loader(packed, batch_size=64, output="dlpack")
    batch = next(iter(loader))
    data, label = batch["data"], batch["label"]
    assert isinstance(data, gpufeed.Array)
    assert data.shape == (64, 2, 3) and data.dtype == "float32" and data.device == "cpu"
    assert data.__dlpack_device__() == (1, 0)  # kDLCPU
    assert len(data) == 64 and data.nbytes == 64 * 24 and data.ndim == 3
    a = np.from_dlpack(data)
    b = np.from_dlpack(data)
    assert np.shares_memory(a, b), "two exports of one array are not views of one buffer"
    assert np.array_equal(a, rows()[:64])
    assert np.array_equal(np.asarray(label), np.arange(64))
    # Both fields live in one batch buffer, at 256-byte aligned offsets.
    pa = a.__array_interface__["data"][0]
    pl = np.from_dlpack(label).__array_interface__["data"][0]
    assert pl > pa and (pl - pa) % 256 == 0 and pl - pa < 64 * 24 + 256
    # Legacy and versioned capsules; a copy on request.
    assert "dltensor" in repr(data.__dlpack__())
    assert "dltensor_versioned" in repr(data.__dlpack__(max_version=(1, 0)))
    c = np.from_dlpack(Producer(data, copy=True))
    assert not np.shares_memory(a, c) and np.array_equal(a, c)
    with pytest.raises(BufferError):
        data.__dlpack__(dl_device=(2, 0))
    if NUMPY_WRITES:
        # Writes through one view are seen by the others: no copy anywhere.
        a[0, 0, 0] = -1.0
        assert np.from_dlpack(data)[0, 0, 0] == -1.0


def test_the_legacy_capsule_is_consumed_too(packed):
    from conftest import live

    loader = gpufeed.Loader(packed, batch_size=64, output="dlpack")
    batch = next(iter(loader))
    a = np.from_dlpack(Producer(batch["data"]))
    assert np.array_equal(a, rows()[:64])
    assert np.shares_memory(a, np.from_dlpack(batch["data"]))
    del batch
    assert live()[0] == 1
    del a
    assert live()[0] == 0


def test_numpy_output_arrays_are_views_writable_from_numpy_2_1(packed):
    loader = gpufeed.Loader(packed, batch_size=10, output="numpy")
    b = next(iter(loader))
    assert isinstance(b["data"], np.ndarray) and b["data"].base is not None
    assert b["data"].flags.c_contiguous
    assert b["data"].flags.writeable == NUMPY_WRITES
    if NUMPY_WRITES:
        b["data"] *= 2  # a training loop may normalise in place
        assert b["data"][1, 0, 0] == 20.0


def test_stats_is_a_dict_of_figures(packed):
    loader = gpufeed.Loader(packed, batch_size=100, workers=2, output="numpy")
    for _ in loader:
        pass
    s = loader.stats()
    assert s["batches"] == 10 and s["samples"] == N and s["bytes"] == N * 32
    assert s["workers"] == 2 and 0.0 <= s["wait_fraction"] <= 1.0
    assert s["pool"]["budget_bytes"] > 0 and s["pool"]["reuses"] + s["pool"]["allocations"] >= 10
    assert "delivered" in s["text"]
    json.dumps({k: v for k, v in s.items()})


def test_auto_settings_trace_and_verdict(tmp_path, packed):
    out = tmp_path / "run.json"
    with gpufeed.Loader(
        packed,
        batch_size=50,
        workers="auto",
        prefetch="auto",
        batch_parts="auto",
        trace=out,
        output="numpy",
    ) as loader:
        assert labels_of(loader) == list(range(N))
        s = loader.stats()
        tuning = s["tuning"]
        assert tuning["reason"].startswith("autotune: ") and tuning["workers"] == s["workers"]
        assert tuning["workers"] >= 1 and tuning["prefetch"] >= 1 and tuning["batch_parts"] >= 1
        assert s["verdict"].startswith("waited ") and "-bound: " in s["verdict"], s["verdict"]
        json.dumps(s)
        # Written on demand, elsewhere too, and again at the end of the `with` block.
        early = tmp_path / "early.json"
        assert loader.write_trace(early) == str(early)
        assert json.loads(early.read_text())["traceEvents"]
    doc = json.loads(out.read_text())
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert "consumer" in threads and "worker 0" in threads, threads
    batches = {e["args"]["batch"] for e in doc["traceEvents"] if e.get("name") == "fetch"}
    assert batches == set(range(N // 50)), batches
    # Without trace=, there is nothing to write; a setting neither a count nor "auto" is refused.
    plain = gpufeed.Loader(packed, batch_size=50, workers=1, output="numpy")
    assert plain.stats()["tuning"] is None
    with pytest.raises(gpufeed.ConfigError, match="trace"):
        plain.write_trace(tmp_path / "x.json")
    with pytest.raises(gpufeed.ConfigError, match="workers"):
        gpufeed.Loader(packed, workers="many")


def test_images_from_a_folder_and_from_its_packed_file_agree(tmp_path, folder):
    opts = {"size": 16, "train": False}
    direct = gpufeed.Loader(folder, batch_size=5, images=opts, output="numpy")
    assert direct.fields == {"image": ("uint8", (3, 16, 16)), "label": ("int64", ())}
    got = [(b["image"].copy(), b["label"].copy()) for b in direct]
    images = np.concatenate([i for i, _ in got])
    labels = np.concatenate([l for _, l in got])
    assert labels.tolist() == [k for k in range(3) for _ in range(4)]
    for img, k in zip(images, labels):
        # A solid colour stays that colour through resize and crop.
        assert (img == np.array(class_color(int(k)), np.uint8)[:, None, None]).all()
    out = tmp_path / "images.gfd"
    summary = gpufeed.pack(folder, out)
    assert summary["records"] == 12
    info = gpufeed.inspect(out)
    assert [f["name"] for f in info["fields"]] == ["image", "label", "size", "path"]
    from_file = gpufeed.Loader(out, batch_size=5, images=opts, output="numpy")
    again = np.concatenate([b["image"].copy() for b in from_file])
    assert np.array_equal(again, images)


def test_image_options_dtype_layout_normalise_and_train(folder):
    opts = gpufeed.ImageOptions(size=(8, 12), dtype="float32", normalise="imagenet", layout="hwc")
    loader = gpufeed.Loader(folder, batch_size=12, images=opts, shuffle=1, output="numpy")
    b = next(iter(loader))
    assert b["image"].shape == (12, 8, 12, 3) and b["image"].dtype == np.float32
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    for img, k in zip(b["image"], b["label"]):
        want = (np.array(class_color(int(k))) / 255 - mean) / std
        assert np.allclose(img, want, atol=1e-5)
    f16 = gpufeed.Loader(folder, batch_size=4, images={"size": 8, "dtype": np.float16}, output="numpy")
    assert next(iter(f16))["image"].dtype == np.float16
    # bfloat16 is torch's: numpy output refuses it at construction, naming the argument.
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(folder, batch_size=4, images={"size": 8, "dtype": "bfloat16"}, output="numpy")
    assert e.value.argument == "output"
    bf = gpufeed.Loader(folder, batch_size=4, images={"size": 8, "dtype": "bfloat16"}, output="dlpack")
    assert next(iter(bf))["image"].dtype == "bfloat16"
    assert gpufeed.Loader(folder, images={"size": 8}, output="numpy").stats()["images"]["skipped"] == 0


def test_inspect_and_pack_mirror_the_command(tmp_path, arrays, packed, folder):
    info = gpufeed.inspect(packed, verify=True)
    assert info["format"] == "packed" and info["records"] == N and info["verified"]
    assert info["fields"][0] == {"name": "data", "kind": "tensor", "dtype": "float32", "shape": [2, 3], "bytes": 24}
    npy = gpufeed.inspect(arrays[0])
    assert npy["format"] == "npy" and npy["shape"] == [N, 2, 3] and npy["dtype"] == "float32"
    assert gpufeed.inspect(folder)["classes"] == CLASSES
    raw = tmp_path / "raw.bin"
    raw.write_bytes(bytes(range(256)) * 4)
    s = gpufeed.pack(raw, tmp_path / "raw.gfd", record_bytes=64)
    assert s["records"] == 16 and s["input_bytes"] == 1024
    loader = gpufeed.Loader(tmp_path / "raw.gfd", batch_size=16, output="numpy")
    assert next(iter(loader))["data"].tobytes() == raw.read_bytes()
