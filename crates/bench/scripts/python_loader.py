#!/usr/bin/env python3
"""gpufeed.Loader (Python) against `gpufeed bench` (Rust) on the same files, in the same run.

Raw records (default): writes the data set `gpufeed bench` generates (8,192 records of
3x224x224 uint8 and a uint32 label, as a packed file; or reads `--dataset`), then, for each
round, runs `gpufeed bench FILE --json` and a Python loop over `gpufeed.Loader(FILE)` with the
same settings (batch size, workers, prefetch, seed, epochs), each going first in every other
round, and prints one JSON
object: both reports, each epoch's rate, and the Python path's steady-state rate (the epochs
after the first) as a fraction of the command's, per round and their median (the issue's
target: at least 0.9).

Images (`--images DIR|PACKED`): `gpufeed bench --images` (RandomResizedCrop + flip, uint8 or
normalised float) beside `gpufeed.Loader(PATH, images=...)`, in images/s.

To the GPU (`--device N`, with torch and a GPU): `gpufeed bench ... --device N` beside
`gpufeed.Loader(..., device="cuda:N")`, whose batches are CUDA tensors made on torch's current
stream (the loop synchronises the device at each epoch's end, as the command does); the image
pipeline then stops at uint8 CHW on the host and converts to `--image-dtype`, normalised with
ImageNet's statistics, on the GPU. The generated records are a `.npy` of `--records` x
`--record-bytes` uint8 (the layout `torch_baseline.py --npy` writes), so that PyTorch reads the
same file. `--torch` adds PyTorch's DataLoader on the same files in the same run, at its best
settings (`--workers` worker processes, persistent, `pin_memory=True`, prefetch factor 4,
`.to(device, non_blocking=True)`; records through a batched `__getitems__` fetch and through
per-sample `__getitem__`; JPEGs decoded with PIL, RandomResizedCrop(224) + flip to uint8 CHW in
the workers, then converted and normalised to `--image-dtype` on the GPU), and the ratios.

    cargo build --release && pip install ./python
    python crates/bench/scripts/python_loader.py --gpufeed target/release/gpufeed [--workers 16] [--rounds 2]
    python crates/bench/scripts/python_loader.py --gpufeed .gpu/bin/gpufeed --device 0 --torch --jsonl \
        --workers 16 --epochs 10 --rounds 3 [--records 16384 | --record-bytes 4096 ... |
        --images DIR --image-dtype bf16]

The Python loop touches each batch as the command's does (it reads one element); its tensors
are torch's if torch is installed, else numpy's (`--output` to choose). `--jsonl` prints the
result as one line of JSON (for appending runs to a `.jsonl` file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import gpufeed


def steady(rates):
    """The harmonic mean of the epochs after the first (as the library's steady_rate)."""
    later = rates[1:]
    if not later:
        return None
    return len(later) / sum(1.0 / max(r, 1e-9) for r in later)


def write_default(path, records, record_bytes):
    """The data set `gpufeed bench` generates: records of pseudo-random bytes (3x224x224 when
    150,528 bytes) and a uint32 label i % 1000, packed through a temporary .npy pair."""
    import numpy as np

    shape = (3, 224, 224) if record_bytes == 3 * 224 * 224 else (record_bytes,)
    tmp = os.path.dirname(path)
    data, labels = os.path.join(tmp, "data.npy"), os.path.join(tmp, "labels.npy")
    array = np.lib.format.open_memmap(data, mode="w+", dtype=np.uint8, shape=(records, *shape))
    rng = np.random.default_rng(0x2545F4914F6CDD1D)
    step = max(1, (64 << 20) // record_bytes)
    for start in range(0, records, step):
        n = min(step, records - start)
        array[start : start + n] = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    array.flush()
    del array
    np.save(labels, (np.arange(records) % 1000).astype(np.uint32))
    gpufeed.pack(data, path, labels=labels)
    os.remove(data)
    os.remove(labels)


def write_npy(path, records, record_bytes):
    """`records` rows of `record_bytes` pseudo-random uint8 in a .npy (torch_baseline.py's
    layout), reused when a file of that shape is there."""
    import numpy as np

    shape = (records, record_bytes)
    if os.path.exists(path):
        try:
            if np.load(path, mmap_mode="r").shape == shape:
                return
        except ValueError:
            pass
    array = np.lib.format.open_memmap(path + ".tmp", mode="w+", dtype=np.uint8, shape=shape)
    rng = np.random.default_rng(0)
    step = max(1, (64 << 20) // record_bytes)
    for start in range(0, records, step):
        n = min(step, records - start)
        array[start : start + n] = rng.integers(0, 256, (n, record_bytes), dtype=np.uint8)
    array.flush()
    del array
    os.replace(path + ".tmp", path)


def warm(path):
    """Reads a file once, so its pages are in the page cache (as `gpufeed bench` does)."""
    if os.path.isdir(path):
        return
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run_bench(args, path):
    cmd = [*args.gpufeed.split(), "bench", path, "--json", "--batch-size", str(args.batch_size),
           "--epochs", str(args.epochs), "--seed", str(args.seed)]
    if args.images:
        cmd = [*args.gpufeed.split(), "bench", "--images", path, "--json", "--batch-size",
               str(args.batch_size), "--epochs", str(args.epochs), "--seed", str(args.seed),
               "--image-size", str(args.image_size), "--image-dtype", args.image_dtype]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    if args.prefetch and not args.images:
        cmd += ["--prefetch", str(args.prefetch)]
    if args.device is not None:
        cmd += ["--device", str(args.device)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    report["command"] = " ".join(cmd)
    return report


def run_python(args, path):
    """The Python loop; rates in bytes/s (records) or images/s (images), per epoch."""
    kwargs = dict(batch_size=args.batch_size, shuffle=args.seed, workers=args.workers,
                  output=args.output)
    sync = None
    if args.device is not None:
        import torch

        kwargs["device"] = f"cuda:{args.device}"
        kwargs["output"] = "torch"
        sync = torch.cuda.synchronize
    if args.images:
        dtype = {"u8": "uint8", "f16": "float16", "bf16": "bfloat16", "f32": "float32"}[args.image_dtype]
        kwargs["images"] = {"size": args.image_size, "dtype": dtype, "train": True,
                            "normalize": None if dtype == "uint8" else "imagenet"}
    else:
        kwargs["prefetch"] = args.prefetch
    # The image bench times its first epoch from the loader's creation; the records bench from
    # the first batch asked for. Do the same.
    created = time.perf_counter()
    loader = gpufeed.Loader(path, **kwargs)
    first = next(iter(loader.fields.values()))
    rates = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        t0 = created if (epoch == 0 and args.images) else time.perf_counter()
        samples = 0
        for batch in loader:
            value = next(iter(batch.values()))
            samples += len(value)
            value[0]  # touch the batch, as the command does
        if sync is not None:
            sync()  # the epoch is on the GPU, as the command's consumer stream has it
        seconds = time.perf_counter() - t0
        rates.append(samples / seconds)
    stats = loader.stats()
    sample_bytes = stats["bytes"] // max(stats["samples"], 1)
    if not args.images:
        rates = [r * sample_bytes for r in rates]
    report = {
        "output": loader.output,
        "workers": stats["workers"],
        "epoch_rates": rates,
        "steady_rate": steady(rates),
        "wait_fraction": stats["wait_fraction"],
        "first_field": first,
        "sample_bytes": sample_bytes,
    }
    if "device" in stats:
        report["device"] = {k: v for k, v in stats["device"].items() if k != "pool"}
        report["device"]["pool_reserved_bytes"] = stats["device"]["pool"]["reserved_bytes"]
    loader.close()
    return report


def torch_device(args):
    """The torch device of `--device`."""
    import torch

    return torch.device("cuda", args.device)


def sync_device(dev):
    """Waits until `dev` has done all the work queued so far."""
    import torch

    torch.cuda.synchronize(dev)


def run_torch(args, path):
    """PyTorch's DataLoader on the same file or folder, to the same device, at its best
    settings; rates per epoch in the unit of the run. Records: both fetches (batched
    `__getitems__` and per-sample `__getitem__`); images: PIL + RandomResizedCrop + flip."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    dev = torch_device(args)
    workers = args.workers or min(16, os.cpu_count() or 1)
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=workers, drop_last=False,
                  pin_memory=True, persistent_workers=True, prefetch_factor=4)

    def timed(loader, to_device, unit_per_sample):
        rates = []
        for epoch in range(args.torch_epochs):
            t0 = time.perf_counter()
            n = 0
            for batch in loader:
                x = to_device(batch)
                n += x.shape[0]
            sync_device(dev)
            rates.append(n * unit_per_sample / (time.perf_counter() - t0))
        return rates

    results = {}
    if args.images:
        import glob

        from PIL import Image
        from torchvision import transforms as T

        files = sorted(glob.glob(os.path.join(path, "*", "*")))
        tf = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(),
                        T.PILToTensor()])

        class Jpegs(Dataset):
            def __len__(self):
                return len(files)

            def __getitem__(self, i):
                with Image.open(files[i]) as im:
                    return tf(im.convert("RGB"))

        dtype = {"u8": torch.uint8, "f16": torch.float16, "bf16": torch.bfloat16,
                 "f32": torch.float32}[args.image_dtype]
        mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
        std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255

        def to_device(x):
            x = x.to(dev, non_blocking=True)
            if dtype != torch.uint8:
                x = ((x.float() - mean) / std).to(dtype)
            return x

        loader = DataLoader(Jpegs(), **common)
        results["jpeg"] = timed(loader, to_device, 1)
        del loader
    else:
        import numpy as np

        class Records(Dataset):
            def __init__(self):
                self.mm = None
                self.n = np.load(path, mmap_mode="r").shape[0]

            def __len__(self):
                return self.n

            def _open(self):
                if self.mm is None:
                    self.mm = np.load(path, mmap_mode="r")
                return self.mm

            def __getitem__(self, i):
                return torch.from_numpy(np.array(self._open()[i]))

        class RecordBatches(Records):
            def __getitems__(self, idx):
                return torch.from_numpy(np.take(self._open(), np.sort(idx), axis=0))

        def to_device(x):
            return x.to(dev, non_blocking=True)

        sample_bytes = int(np.prod(np.load(path, mmap_mode="r").shape[1:]))
        loader = DataLoader(RecordBatches(), collate_fn=lambda b: b, **common)
        results["getitems"] = timed(loader, to_device, sample_bytes)
        del loader
        loader = DataLoader(Records(), **common)
        results["per_sample"] = timed(loader, to_device, sample_bytes)
        del loader
    cases = {name: {"epoch_rates": rates, "steady_rate": steady(rates)}
             for name, rates in results.items()}
    best = max(cases, key=lambda c: cases[c]["steady_rate"] or 0)
    return {"workers": workers, "cases": cases, "best_case": best,
            "steady_rate": cases[best]["steady_rate"], "settings": {
                k: v for k, v in common.items() if k != "shuffle"}}


def consumer_cost(args):
    """Microseconds the Python consumer spends per batch when batches are already made: the
    loader's own cost per batch on top of the workers' (batch size 1, so that it dominates)."""
    import numpy as np

    tmpdir = tempfile.mkdtemp(prefix="gpufeed-python-cost-")
    try:
        x, y, f = (os.path.join(tmpdir, n) for n in ("x.npy", "y.npy", "t.gfd"))
        np.save(x, np.zeros((4096, 16), np.uint8))
        np.save(y, np.arange(4096))
        gpufeed.pack(x, f, labels=y)
        costs = {}
        for output in ("dlpack", "numpy", "torch"):
            try:
                loader = gpufeed.Loader(f, batch_size=1, workers=2, prefetch=1024, output=output)
            except gpufeed.ConfigError:
                continue  # torch not installed
            samples = []
            for _ in range(5):
                it = iter(loader)
                next(it)
                time.sleep(0.5)  # the workers fill the pipeline
                t = time.perf_counter()
                for _ in range(800):
                    next(it)
                samples.append((time.perf_counter() - t) / 800 * 1e6)
                for _ in it:
                    pass
            costs[output] = sorted(samples)[len(samples) // 2]
        return {"us_per_batch_two_fields_median_of_5": costs}
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpufeed", default="target/release/gpufeed",
                   help="the command to run (a path, or e.g. 'cargo run --release --')")
    p.add_argument("--dataset", help="a packed file or .npy array (default: generate bench's)")
    p.add_argument("--images", help="an ImageFolder or packed image file: the image bench")
    p.add_argument("--records", type=int, default=8192)
    p.add_argument("--record-bytes", type=int, default=150_528)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int)
    p.add_argument("--prefetch", type=int)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--image-dtype", default="u8", choices=["u8", "f16", "bf16", "f32"])
    p.add_argument("--rounds", type=int, default=2, help="alternating bench/Python rounds")
    p.add_argument("--output", choices=["torch", "numpy", "dlpack"])
    p.add_argument("--device", type=int, help="to GPU N: gpufeed bench --device N beside "
                   "gpufeed.Loader(device='cuda:N') (needs torch and a GPU)")
    p.add_argument("--npy", help="with --device: the records .npy to write or reuse "
                   "(default: a temporary one)")
    p.add_argument("--torch", action="store_true",
                   help="with --device: PyTorch's DataLoader on the same files, same run")
    p.add_argument("--torch-epochs", type=int, default=3,
                   help="epochs of each PyTorch case (the first is not in its steady rate)")
    p.add_argument("--jsonl", action="store_true", help="print the result as one JSON line")
    p.add_argument("--consumer-cost", action="store_true",
                   help="only measure the Python consumer's cost per ready batch")
    args = p.parse_args()
    if args.torch and args.device is None:
        p.error("--torch needs --device")
    if args.consumer_cost:
        print(json.dumps(consumer_cost(args), indent=1))
        return

    tmpdir = None
    if args.images:
        path = args.images
    elif args.dataset:
        path = args.dataset
    elif args.device is not None:
        # A .npy both gpufeed and PyTorch read.
        if args.npy:
            path = args.npy
        else:
            tmpdir = tempfile.mkdtemp(prefix="gpufeed-python-bench-")
            path = os.path.join(tmpdir, "records.npy")
        t = time.perf_counter()
        write_npy(path, args.records, args.record_bytes)
        print(f"{path} ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    else:
        tmpdir = tempfile.mkdtemp(prefix="gpufeed-python-bench-")
        path = os.path.join(tmpdir, "default.gfd")
        t = time.perf_counter()
        write_default(path, args.records, args.record_bytes)
        print(f"wrote {path} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    try:
        warm(path)
        rounds = []
        for r in range(args.rounds):
            # Alternate which goes first, so that a drift within a round cancels out.
            if r % 2 == 0:
                bench = run_bench(args, path)
                py = run_python(args, path)
            else:
                py = run_python(args, path)
                bench = run_bench(args, path)
            rounds.append({"gpufeed_bench": bench, "python": py})
            print(f"round {r}: bench {bench_steady(args, bench):.4g}, python {py['steady_rate']:.4g}",
                  file=sys.stderr)
        pytorch = None
        if args.torch:
            pytorch = run_torch(args, path)
            print(f"pytorch: {pytorch['steady_rate']:.4g} ({pytorch['best_case']})",
                  file=sys.stderr)
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    best_bench = max(bench_steady(args, r["gpufeed_bench"]) for r in rounds)
    best_py = max(r["python"]["steady_rate"] for r in rounds)
    # Each round's ratio compares runs made seconds apart; their median is what a shared
    # machine's drift disturbs least.
    ratios = sorted(r["python"]["steady_rate"] / bench_steady(args, r["gpufeed_bench"]) for r in rounds)
    median = ratios[len(ratios) // 2] if len(ratios) % 2 else sum(ratios[len(ratios) // 2 - 1 : len(ratios) // 2 + 1]) / 2
    unit = "images/s" if args.images else "bytes/s"
    device = None
    if args.device is not None:
        import torch

        device = torch.cuda.get_device_name(args.device)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "gpufeed": gpufeed.__version__,
            "device": device,
        },
        "case": case_name(args),
        "dataset": path,
        "unit": unit,
        "settings": {k: v for k, v in vars(args).items() if k not in ("dataset",)},
        "rounds": rounds,
        "bench_steady_best": best_bench,
        "python_steady_best": best_py,
        "python_over_bench_best": best_py / best_bench,
        "python_over_bench_per_round": ratios,
        "python_over_bench_median": median,
    }
    if pytorch is not None:
        result["pytorch"] = pytorch
        result["python_over_pytorch"] = best_py / pytorch["steady_rate"]
        result["bench_over_pytorch"] = best_bench / pytorch["steady_rate"]
    print(json.dumps(result, separators=(",", ":")) if args.jsonl else json.dumps(result, indent=1))


def case_name(args):
    """A short name of what the run measured, for JSON lines."""
    where = "host" if args.device is None else f"cuda:{args.device}"
    if args.images:
        return f"jpeg_rrc{args.image_size}_{args.image_dtype}_{where}"
    if args.dataset:
        return f"{os.path.basename(args.dataset)}_{where}"
    return f"records_{args.record_bytes}B_{where}"


def bench_steady(args, report):
    if args.images:
        # `gpufeed bench --json` has one set of keys for raw and image runs: samples are images.
        return report.get("steady_samples_per_sec") or report["samples_per_sec"]
    return report.get("steady_bytes_per_sec") or report["bytes_per_sec"]


if __name__ == "__main__":
    main()
