"""torch as the DLPack consumer, and gpufeed.torch.IterableDataset in torch's DataLoader.
Skipped without torch, except with GPUFEED_REQUIRE_GPU=1 (the GPU machine), where they fail."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpufeed
from conftest import N, live, require_gpu_tools, rows

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

if torch is None:
    if require_gpu_tools():
        pytest.fail("GPUFEED_REQUIRE_GPU=1 but torch is not installed", pytrace=False)
    pytest.skip("torch is not installed", allow_module_level=True)


def test_torch_is_the_default_output_and_tensors_view_the_buffer(packed):
    loader = gpufeed.Loader(packed, batch_size=64, workers=2)
    assert loader.output == "torch"
    batch = next(iter(loader))
    data = batch["data"]
    assert isinstance(data, torch.Tensor) and data.device.type == "cpu"
    assert data.dtype == torch.float32 and tuple(data.shape) == (64, 2, 3)
    assert torch.equal(data, torch.from_numpy(rows()[:64]))
    assert batch["label"].dtype == torch.int64
    # Zero copy: the two fields are views of one buffer, 256-byte aligned apart.
    gap = batch["label"].data_ptr() - data.data_ptr()
    assert gap > 0 and gap % 256 == 0


def test_a_kept_tensor_outlives_the_loader(packed):
    loader = gpufeed.Loader(packed, batch_size=64, output="torch")
    it = iter(loader)
    kept = next(it)["data"]
    for _ in range(8):
        next(it)["data"].fill_(-1)
    del it, loader
    gc.collect()
    assert torch.equal(kept, torch.from_numpy(rows()[:64]))
    del kept
    gc.collect()
    assert live() == (0, 0)


def test_masks_are_bool_and_bfloat16_images_cross(folder):
    # Rank 4 of 5 over 12 images: samples 4 and 9, then one padding slot.
    loader = gpufeed.Loader(
        folder, batch_size=5, evaluation=True, shard=(4, 5),
        images={"size": 8, "dtype": torch.bfloat16, "normalize": "imagenet"},
    )
    batches = [(b["image"].clone(), b[gpufeed.MASK_KEY].clone()) for b in loader]
    assert len(batches) == 1
    image, mask = batches[0]
    assert image.dtype == torch.bfloat16 and tuple(image.shape) == (3, 3, 8, 8)
    assert mask.dtype == torch.bool and mask.tolist() == [True, True, False]


def test_the_iterable_dataset_in_a_torch_dataloader(packed):
    from torch.utils.data import DataLoader

    import gpufeed.torch as gt

    ds = gt.IterableDataset(packed, batch_size=100, shuffle=9, workers=2)
    assert len(ds) == 10
    reference = gpufeed.Loader(packed, batch_size=100, shuffle=9, output="numpy")
    want = [[b["label"].tolist() for b in reference] for _ in range(1)]
    reference.set_epoch(1)
    want.append([b["label"].tolist() for b in reference])
    got = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        got.append([b["label"].tolist() for b in DataLoader(ds, batch_size=None)])
    assert got == want
    # Stateful: stop after 3 batches of epoch 0, resume in a new dataset.
    ds.set_epoch(0)
    it = iter(DataLoader(ds, batch_size=None))
    head = [next(it)["label"].tolist() for _ in range(3)]
    state = ds.state_dict()
    fresh = gt.IterableDataset(packed, batch_size=100, shuffle=9, workers=2)
    fresh.load_state_dict(state)
    tail = [b["label"].tolist() for b in DataLoader(fresh, batch_size=None)]
    assert head + tail == want[0]
    wrapped = gt.IterableDataset(gpufeed.Loader(packed, batch_size=500))
    assert [len(b["label"]) for b in DataLoader(wrapped, batch_size=None)] == [500, 500]


def test_the_iterable_dataset_refuses_worker_processes(packed):
    from torch.utils.data import DataLoader

    import gpufeed.torch as gt

    ds = gt.IterableDataset(packed, batch_size=100)
    with pytest.raises((RuntimeError, TypeError), match="num_workers=0|worker"):
        for _ in DataLoader(ds, batch_size=None, num_workers=2):
            pass
    # Still usable in the main process.
    assert sum(len(b["label"]) for b in DataLoader(ds, batch_size=None)) == N


def test_statefuldataloader_when_torchdata_is_there(packed):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    import gpufeed.torch as gt

    ds = gt.IterableDataset(packed, batch_size=100, shuffle=1)
    dl = sdl.StatefulDataLoader(ds, batch_size=None)
    it = iter(dl)
    head = [next(it)["label"].tolist() for _ in range(4)]
    state = dl.state_dict()
    dl2 = sdl.StatefulDataLoader(gt.IterableDataset(packed, batch_size=100, shuffle=1), batch_size=None)
    dl2.load_state_dict(state)
    tail = [b["label"].tolist() for b in dl2]
    whole = [b["label"].tolist() for b in gpufeed.Loader(packed, batch_size=100, shuffle=1, output="numpy")]
    assert head + tail == whole


def test_numpy_and_torch_views_of_one_array_share_memory(packed):
    batch = next(iter(gpufeed.Loader(packed, batch_size=10, output="dlpack")))
    t = torch.from_dlpack(batch["data"])
    a = np.from_dlpack(batch["data"])
    t[0, 0, 0] = 123.0
    assert a[0, 0, 0] == 123.0


def test_the_dataset_adapter_passes_read_mode_to_its_loader(packed):
    import os

    from torch.utils.data import DataLoader

    import gpufeed.torch

    ds = gpufeed.torch.IterableDataset(
        packed, batch_size=10, workers=1, prefetch=1, read_mode="pread"
    )
    os.truncate(packed, os.path.getsize(packed) // 2)
    with pytest.raises(gpufeed.DataError) as e:
        for _ in DataLoader(ds, batch_size=None):
            pass
    assert e.value.kind == "file_changed" and e.value.path == str(packed), e.value
