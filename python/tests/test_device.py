"""The GPU path: ``gpufeed.Loader(..., device="cuda:N")``, device batches as CUDA tensors through
DLPack on the consumer's stream.

Skipped without torch or without a GPU, except with GPUFEED_REQUIRE_GPU=1 (the GPU machine),
where a missing GPU is a failure. CuPy and JAX consumers run where they are importable.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess

import numpy as np
import pytest

import gpufeed
from conftest import CLASSES, N, documents, live, require_gpu_tools, rows, write_megatron, write_png

# JAX takes most of the GPU's memory at its first use unless told not to.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None

_why = None
if torch is None:
    _why = "torch is not installed"
elif not gpufeed._gpufeed.HAS_CUDA:
    _why = "this gpufeed was built without its cuda feature"
elif not torch.cuda.is_available():
    _why = "no GPU"
if _why is not None:
    if require_gpu_tools():
        pytest.fail(f"GPUFEED_REQUIRE_GPU=1 but {_why}", pytrace=False)
    pytest.skip(_why, allow_module_level=True)

DEV = "cuda:0"


def sleep_ms(ms: float) -> None:
    """Holds the current stream busy for about `ms` of GPU time (a spin kernel)."""
    torch.cuda._sleep(int(ms * 2e6))  # about 2 GHz: cycles per millisecond


@pytest.fixture
def records(tmp_path):
    """(path, bytes): 512 random records of 3,072 bytes in a .npy."""
    data = np.random.default_rng().integers(0, 256, (512, 3072), dtype=np.uint8)
    path = tmp_path / "records.npy"
    np.save(path, data)
    return path, data


@pytest.fixture
def photos(tmp_path):
    """An ImageFolder of 3 classes x 6 PNGs of random pixels, 37x53 (crops resample them)."""
    rng = np.random.default_rng(7)
    root = tmp_path / "photos"
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(6):
            write_png(root / name / f"{i}.png", rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    return root


def test_device_batches_hold_the_files_bytes_as_cuda_tensors(packed, records):
    current = torch.cuda.current_device()
    loader = gpufeed.Loader(packed, batch_size=64, shuffle=3, workers=2, device=DEV, indices=True)
    assert loader.device == DEV and loader.output == "torch"
    assert loader.fields["data"] == ("float32", (2, 3))
    seen = []
    for batch in loader:
        data, label, index = batch["data"], batch["label"], batch[gpufeed.INDEX_KEY]
        for t in (data, label, index):
            assert t.is_cuda and t.device == torch.device(DEV)
        assert data.dtype == torch.float32 and tuple(data.shape[1:]) == (2, 3)
        assert index.dtype == torch.int64 and torch.equal(index, label)
        idx = index.cpu().numpy()
        assert np.array_equal(data.cpu().numpy(), rows()[idx])
        seen.extend(idx.tolist())
    assert sorted(seen) == list(range(N))
    # Zero copy on the device: the fields are views of one buffer, 256-byte aligned apart.
    batch = next(iter(loader))
    gap = batch["label"].data_ptr() - batch["data"].data_ptr()
    assert gap > 0 and gap % 256 == 0
    del batch
    # Raw bytes, every byte.
    path, data = records
    loader = gpufeed.Loader(path, batch_size=100, shuffle=1, workers=3, device=DEV, indices=True)
    for batch in loader:
        idx = batch[gpufeed.INDEX_KEY].cpu().numpy()
        got = batch["data"]
        assert got.dtype == torch.uint8 and tuple(got.shape[1:]) == (3072,)
        assert np.array_equal(got.cpu().numpy(), data[idx])
    assert torch.cuda.current_device() == current


@pytest.mark.parametrize("where", ["side stream", "default stream"])
def test_a_tensor_read_on_a_busy_stream_is_never_overwritten_by_a_later_batch(records, where):
    """Each batch is cloned on a stream held busy by a spin kernel, and its tensors are dropped
    at once: the clone runs long after the host let go. The copy stage reuses device buffers
    meanwhile (the stream is drained now and then); a buffer reused before the stream passed
    the clone would show another batch's rows in it."""
    path, data = records
    stream = torch.cuda.Stream() if where == "side stream" else torch.cuda.default_stream()
    # 64 small batches: more than the copy stage keeps ahead (its depth is 16 batches this
    # small), so that it must reuse buffers.
    loader = gpufeed.Loader(path, batch_size=8, shuffle=5, workers=2, prefetch=2,
                            device=DEV, indices=True)
    snaps = []
    it = iter(loader)
    for k in range(len(loader)):
        with torch.cuda.stream(stream):
            batch = next(it)  # made on `stream`: it waits for the copy, and is registered
            sleep_ms(10)
            snaps.append((batch[gpufeed.INDEX_KEY].clone(), batch["data"].clone()))
        del batch  # the last views: the buffer returns behind an event on `stream`
        if k % 4 == 3:
            stream.synchronize()  # let the copy stage reuse the returned buffers
    torch.cuda.synchronize()
    for k, (index, snap) in enumerate(snaps):
        idx = index.cpu().numpy()
        assert np.array_equal(snap.cpu().numpy(), data[idx]), f"batch {k} was overwritten"
    stats = loader.stats()["device"]
    assert stats["pool"]["reuses"] > 0, f"no buffer was reused, so nothing was tested: {stats}"
    assert stats["leaked_buffers"] == 0


def test_a_kept_tensor_outlives_the_loader(packed):
    loader = gpufeed.Loader(packed, batch_size=64, workers=2, device=DEV)
    it = iter(loader)
    kept = next(it)["data"]
    for _ in range(8):
        next(it)["data"].fill_(-1)  # scribble over every other buffer
    del it, loader
    gc.collect()
    assert torch.equal(kept.cpu(), torch.from_numpy(rows()[:64]))
    assert float(kept.sum()) == float(rows()[:64].sum())  # used on the GPU, loader gone
    assert live() == (1, 0)
    del kept
    gc.collect()
    assert live() == (0, 0)


def gpu_free_bytes():
    """(free bytes on GPU 0 by the driver, MiB used by nvidia-smi or None)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(0)[0]
    smi = None
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True,
        )
        if out.returncode == 0 and out.stdout.strip():
            smi = int(out.stdout.strip().splitlines()[0])
    return free, smi


def threads():
    return len(os.listdir("/proc/self/task"))


def run_device_loaders(path, n):
    for i in range(n):
        loader = gpufeed.Loader(path, batch_size=128, shuffle=i, workers=2, device=DEV,
                                evaluation=i % 2 == 1, indices=i % 3 == 0)
        it = iter(loader)
        kept = next(it)["data"]
        for _ in range(2):
            next(it)
        loader.load_state_dict(loader.state_dict())
        del it, loader  # mid-epoch, with device batches in flight
        assert kept.shape[0] == 128
        del kept


def test_many_device_loaders_leave_no_gpu_memory(records):
    path, _ = records
    run_device_loaders(path, 3)  # warm up: the device, its kernels, the release thread
    gc.collect()
    reserved0, leaked0 = gpufeed._gpufeed._device_memory()
    free0, smi0 = gpu_free_bytes()
    threads0 = threads()
    run_device_loaders(path, 40)
    gc.collect()
    reserved, leaked = gpufeed._gpufeed._device_memory()  # waits for dropped pools to be freed
    free, smi = gpu_free_bytes()
    assert live() == (0, 0), "device batches still held"
    assert (reserved, leaked) == (reserved0, leaked0), "gpufeed's device pools kept memory"
    assert threads() == threads0, "copy or worker threads left running"
    # Each loader's pool holds a few MiB on the GPU: 40 leaked pools would be far more.
    assert free0 - free < 32 << 20, f"GPU free memory fell by {(free0 - free) >> 20} MiB"
    if smi0 is not None and smi is not None:
        assert smi - smi0 < 32, f"nvidia-smi: {smi - smi0} MiB more used after 40 loaders"


def test_resume_through_state_dict_on_the_device(packed):
    def labels(loader):
        return [b["label"].cpu().tolist() for b in loader]

    reference = gpufeed.Loader(packed, batch_size=100, shuffle=11, workers=2, device=DEV)
    want = []
    for epoch in range(2):
        reference.set_epoch(epoch)
        want.append(labels(reference))
    assert len(reference) == 10 and all(len(e) == 10 for e in want)
    # Stop after 3 batches of epoch 1, keeping one of them; resume in a new loader.
    loader = gpufeed.Loader(packed, batch_size=100, shuffle=11, workers=2, device=DEV)
    loader.set_epoch(1)
    it = iter(loader)
    head = [next(it)["label"] for _ in range(3)]
    state = loader.state_dict()
    assert (state["epoch"], state["next_batch"]) == (1, 3)
    del it, loader
    fresh = gpufeed.Loader(packed, batch_size=100, shuffle=11, workers=3, device=DEV)
    fresh.load_state_dict(state)
    fresh.set_epoch(1)  # the README's loop: keeps the position
    assert [h.cpu().tolist() for h in head] + labels(fresh) == want[1]
    # A resumed device loader and a host loader agree on the state.
    host = gpufeed.Loader(packed, batch_size=100, shuffle=11, output="numpy")
    host.load_state_dict(state)
    assert [b["label"].tolist() for b in host] == want[1][3:]


def ulp_bf16(x):
    """One bfloat16 step at |x| (x as float32)."""
    mag = x.abs().clamp_min(2.0**-126)
    return torch.pow(2.0, torch.floor(torch.log2(mag)) - 7)


def ulp_f16(x):
    mag = x.abs().clamp_min(2.0**-14)
    return torch.pow(2.0, torch.floor(torch.log2(mag)) - 10)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_images_converted_on_the_gpu_match_the_host_pipeline(photos, dtype):
    """Same crops and flips (a function of seed, epoch and sample), the u8 CHW image converted
    on the GPU against the host pipeline writing the same dtype: within one step of the
    dtype (the two round the same f32 value, computed in a different order)."""
    options = {"size": 24, "dtype": dtype, "normalize": "imagenet"}
    args = dict(batch_size=5, shuffle=2, workers=2, indices=True)
    host = [(b["image"].clone(), b[gpufeed.INDEX_KEY].clone())
            for b in gpufeed.Loader(photos, images=options, **args)]
    device = gpufeed.Loader(photos, images=options, device=DEV, **args)
    assert device.fields["image"] == (dtype, (3, 24, 24))
    got = [(b["image"].cpu(), b[gpufeed.INDEX_KEY].cpu(), b["label"]) for b in device]
    assert len(got) == len(host) == 4
    for (want, want_idx), (image, idx, label) in zip(host, got):
        assert torch.equal(idx, want_idx)
        assert label.is_cuda and label.dtype == torch.int64
        assert image.dtype == getattr(torch, dtype) and image.shape == want.shape
        a, b = image.float(), want.float()
        if dtype == "float32":
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        else:
            step = (ulp_bf16 if dtype == "bfloat16" else ulp_f16)(torch.maximum(a.abs(), b.abs()))
            worst = ((a - b).abs() / step).max().item()
            assert worst <= 1.0, f"{dtype}: {worst} steps apart"
    # Not a trivial image: the values cover the normalised range.
    assert float(got[0][0].float().std()) > 0.1


def test_uint8_images_are_copied_and_hwc_floats_are_refused(photos):
    u8 = gpufeed.Loader(photos, batch_size=6, images={"size": 16}, device=DEV)
    batch = next(iter(u8))
    assert batch["image"].dtype == torch.uint8 and tuple(batch["image"].shape) == (6, 3, 16, 16)
    host = next(iter(gpufeed.Loader(photos, batch_size=6, images={"size": 16})))
    assert torch.equal(batch["image"].cpu(), host["image"])
    with pytest.raises(gpufeed.ConfigError, match="layout"):
        gpufeed.Loader(photos, images={"size": 16, "dtype": "float16", "layout": "hwc"},
                       device=DEV)


def test_the_mask_and_indices_are_gpu_tensors(folder):
    # Rank 4 of 5 over 12 images: samples 4 and 9, then one padding slot.
    loader = gpufeed.Loader(
        folder, batch_size=5, evaluation=True, shard=(4, 5), indices=True, device=DEV,
        images={"size": 8, "dtype": torch.bfloat16, "normalize": "imagenet"},
    )
    batches = list(loader)
    assert len(batches) == 1
    b = batches[0]
    mask, index = b[gpufeed.MASK_KEY], b[gpufeed.INDEX_KEY]
    assert mask.is_cuda and mask.dtype == torch.bool and mask.tolist() == [True, True, False]
    assert index.is_cuda and index.tolist()[:2] == [4, 9]
    assert b["image"].dtype == torch.bfloat16 and tuple(b["image"].shape) == (3, 3, 8, 8)
    assert set(loader.fields) == {"image", "label"}


def test_dlpack_stream_argument_and_device(packed):
    loader = gpufeed.Loader(packed, batch_size=10, device=DEV, output="dlpack")
    batch = next(iter(loader))
    a = batch["data"]
    assert a.__dlpack_device__() == (2, 0) and a.device == DEV
    with pytest.raises(BufferError, match="ambiguous"):
        a.__dlpack__(stream=0)
    with pytest.raises(BufferError):
        a.__dlpack__(stream=1, copy=True)
    with pytest.raises(BufferError):
        a.__dlpack__(stream=1, dl_device=(1, 0))
    with pytest.raises(TypeError, match="device memory"):
        np.asarray(a)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.from_dlpack(a)  # waits on `side`
        u = t * 2
    assert torch.equal(u.cpu(), torch.from_numpy(rows()[:10] * 2))
    assert a.__dlpack__(stream=-1) is not None  # no ordering asked for
    assert a.__dlpack__(stream=2) is not None  # the per-thread default stream
    del a, batch, t, u
    gc.collect()
    torch.cuda.synchronize()
    assert live() == (0, 0)


def test_stats_include_the_device(packed):
    loader = gpufeed.Loader(packed, batch_size=100, workers=2, device=DEV)
    for _ in loader:
        pass
    s = loader.stats()
    assert s["batches"] == 10 and s["samples"] == N
    d = s["device"]
    assert d["ordinal"] == 0 and d["name"]
    assert d["h2d_copies"] == 10 and d["h2d_bytes"] > 0
    assert d["pool"]["reserved_bytes"] > 0 and d["leaked_buffers"] == 0
    assert d["reserved_bytes_all_pools"] >= d["pool"]["reserved_bytes"]
    assert s["pool"]["reserved_bytes"] > 0  # the pinned host buffers
    assert s["workers"] == 2 and "H2D" in s["text"]


def test_the_iterable_dataset_yields_device_batches(packed):
    from torch.utils.data import DataLoader

    import gpufeed.torch as gt

    ds = gt.IterableDataset(packed, batch_size=100, shuffle=4, workers=2, device=DEV)
    want = [b["label"].tolist() for b in gpufeed.Loader(packed, batch_size=100, shuffle=4,
                                                         output="numpy")]
    got = []
    for b in DataLoader(ds, batch_size=None):
        assert b["data"].is_cuda and b["label"].is_cuda
        got.append(b["label"].cpu().tolist())
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_and_the_current_device_is_left_alone(packed):
    torch.cuda.set_device(0)
    loader = gpufeed.Loader(packed, batch_size=100, workers=2, device="cuda:1")
    for b in loader:
        assert b["data"].device == torch.device("cuda:1")
        assert torch.cuda.current_device() == 0
    assert np.array_equal(b["data"].cpu().numpy(), rows()[900:])
    del b
    gc.collect()
    assert torch.cuda.current_device() == 0


def test_cupy_consumer(packed):
    cupy = pytest.importorskip("cupy")
    loader = gpufeed.Loader(packed, batch_size=64, shuffle=8, device=DEV, output="cupy",
                            indices=True)
    for batch in loader:
        data = batch["data"]
        assert isinstance(data, cupy.ndarray) and data.dtype == cupy.float32
        idx = cupy.asnumpy(batch[gpufeed.INDEX_KEY])
        assert np.array_equal(cupy.asnumpy(data), rows()[idx])
    # A gpufeed.Array to cupy.from_dlpack on a stream of cupy's own.
    a = next(iter(gpufeed.Loader(packed, batch_size=8, device=DEV, output="dlpack")))["data"]
    with cupy.cuda.Stream(non_blocking=True) as s:
        x = cupy.from_dlpack(a) * 3
        s.synchronize()
    assert np.array_equal(cupy.asnumpy(x), rows()[:8] * 3)


def test_jax_consumer(packed):
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("jax is installed without its GPU backend")
    loader = gpufeed.Loader(packed, batch_size=64, shuffle=8, device=DEV, output="jax",
                            indices=True)
    for batch in loader:
        data = batch["data"]
        idx = np.asarray(batch[gpufeed.INDEX_KEY])
        assert np.array_equal(np.asarray(data), rows()[idx])


def test_ragged_fields_reach_the_gpu_exactly_as_values_offsets_and_lists(tmp_path):
    import io
    import tarfile

    def text(i: int) -> bytes:
        return bytes((i * 31 + j) % 256 for j in range((i * 37) % 200))

    root = tmp_path / "wds"
    root.mkdir()
    with tarfile.open(root / "shard-0000.tar", "w") as tar:
        for i in range(50):
            # Raw bytes of every value (`.bin`; a `.txt` member must be UTF-8 text).
            info = tarfile.TarInfo(f"{i:06d}.bin")
            data = text(i)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    for ragged in ("offsets", "list"):
        loader = gpufeed.Loader(
            root, batch_size=8, shuffle=1, workers=2, device=DEV, indices=True, ragged=ragged
        )
        seen = []
        for batch in loader:
            indices = batch[gpufeed.INDEX_KEY].tolist()
            if ragged == "offsets":
                values, offsets = batch["bin"]
                assert values.is_cuda and offsets.is_cuda and offsets.dtype == torch.int64
                offsets = offsets.cpu().tolist()
                got = bytes(values.cpu().numpy())
                assert got == b"".join(text(i) for i in indices)
                assert offsets[0] == 0 and offsets[-1] == len(got)
            else:
                assert [bytes(t.cpu().numpy()) for t in batch["bin"]] == [text(i) for i in indices]
                assert all(t.is_cuda for t in batch["bin"])
            seen.extend(indices)
        assert sorted(seen) == list(range(50))


def test_token_batches_on_the_gpu_are_the_host_ones(tmp_path):
    """TokenLoader(device=...): narrow integers over PCIe, widened on the GPU, equal to the host
    loader's rows field by field, int64 as asked; the states agree."""
    docs = [d % 65536 for d in documents(count=300, longest=200, seed=11)]
    prefix = tmp_path / "docs"
    write_megatron(prefix, docs)
    common = dict(seq_len=64, batch_size=8, mode="packed", shuffle=3, shard=(1, 2))
    host = gpufeed.TokenLoader(str(prefix), output="torch", **common)
    gpu = gpufeed.TokenLoader(str(prefix), device=DEV, output="torch", **common)
    n = 0
    for h, d in zip(host, gpu):
        for name in ("input_ids", "labels", "position_ids", "document_ids", "cu_seqlens"):
            assert d[name].is_cuda, name
            assert d[name].dtype == h[name].dtype, name
            assert torch.equal(d[name].cpu(), h[name]), name
        n += 1
    assert n == len(host) and n > 0
    assert gpu.state_dict() == host.state_dict()
    assert gpu.stats()["tokens"] == host.stats()["tokens"]
