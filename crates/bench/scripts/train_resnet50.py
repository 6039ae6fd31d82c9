#!/usr/bin/env python3
"""torchvision's ResNet-50 trained on a folder of JPEGs, fed once by PyTorch's DataLoader and once
by gpufeed, side by side: images per second and the fraction of time the GPU waited for data.

The data: the ImageFolder that `torch_baseline.py --jpeg-dir DIR` writes (3,000 JPEGs of 500x375
in 10 classes, DIR/class_k/NNNNNN.jpg). Both feeds make RandomResizedCrop(224) + horizontal
flip crops, normalised with ImageNet's mean and std, as bfloat16 NCHW on the GPU, then
`contiguous(memory_format=torch.channels_last)`:

- pytorch: `DataLoader(dataset, batch_size, shuffle=True, num_workers=W, pin_memory=True,
  drop_last=True, persistent_workers=True, prefetch_factor=4)` over a dataset that decodes with
  PIL and applies torchvision's RandomResizedCrop(224), RandomHorizontalFlip() and PILToTensor()
  (uint8 CHW) in the worker processes; on the GPU: `.to(device, non_blocking=True)`, then
  `(x.float() - mean) / std` to bfloat16 (the usual GPU-side normalisation).
- gpufeed: `gpufeed.Loader(DIR, batch_size, shuffle=seed, workers=W, drop_last=True,
  device="cuda:N", images={"size": 224, "dtype": "bfloat16", "normalize": "imagenet"})`: W
  threads decode, crop and flip to uint8 CHW in pinned memory, gpufeed copies each batch to the
  GPU and converts it to normalised bfloat16 there, on its own stream, ahead of the step.

The model: `torchvision.models.resnet50(num_classes=classes)` in channels_last, SGD (momentum
0.9, lr 0.1, weight decay 1e-4), cross-entropy, the forward pass and the loss under
`torch.autocast("cuda", dtype=torch.bfloat16)`, `torch.backends.cudnn.benchmark = True`, all on
the default stream. Each feed trains a fresh model for `--steps` steps (epochs restart as the
data runs out; `set_epoch` for gpufeed), in a process of its own (`--feed both` runs one after
the other and prints both).

What is measured, precisely. Step k is: take the next batch from the loader (host), prepare it
on the GPU (PyTorch: the copy and the normalisation; both: channels_last), then forward, loss,
backward and the optimizer's step. Two CUDA events (timing enabled) are recorded on the default
stream for step k: `start[k]` right after the preparation was enqueued, before the forward
pass, and `end[k]` right after `optimizer.step()` was enqueued. The GPU runs the stream in
order, so:

- `compute[k] = elapsed(start[k], end[k])`: GPU time of the model's work of step k;
- `wait[k] = elapsed(end[k-1], start[k])`: GPU time between the end of step k-1's model work
  and the start of step k's: the stream was idle because the host had not yet handed it step
  k (the loader had no batch ready, or Python was slower than the GPU), or busy preparing the
  input (PyTorch's copy and normalisation; gpufeed's stream wait for its copy, if not done).
  That is the GPU's time waiting for data.

Over the steady steps (those after `--warmup`, default 20, which cover cuDNN's autotuning and
the loaders' start), `gpu_wait_fraction = sum(wait) / (sum(wait) + sum(compute))` and
`images_per_s = images / (sum(wait) + sum(compute))`, GPU time from the end of the last warm-up
step to the end of the last step. Also reported: the host-side data time (the time spent in the
loader's `next()`, the usual "data time" of training scripts) as a fraction of the host's wall
time over the same steps, images per second of wall time, the whole run's rate (from the
loader's creation), and the first and last losses (a sanity check: finite numbers).

    python3 crates/bench/scripts/train_resnet50.py --data /tmp/jpegs --steps 200 --workers 16 --out r.json

`--device cpu` runs the same code on the CPU (events become host timers; gpufeed's host path
with `.to(device)`), with small `--batch-size`, `--image-size` and `--steps`: a smoke test of the
script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FEEDS = ("gpufeed", "pytorch")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the ImageFolder of JPEGs")
    p.add_argument("--feed", default="both", choices=["both", *FEEDS])
    p.add_argument("--order", default="gpufeed,pytorch", help="with --feed both: which first")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the steady figures")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--workers", type=int, default=16, help="per GPU: processes or threads")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--device", default="cuda", help="cuda (LOCAL_RANK's GPU), cuda:N, or cpu")
    p.add_argument("--decode", default="cpu", choices=["cpu", "gpu", "auto"],
                   help="gpufeed's JPEG decode: in its worker threads, or nvJPEG on the GPU")
    p.add_argument("--out", help="write the JSON here too")
    return p


def image_folder(root: str):
    """(files, labels, classes) of an ImageFolder, in sorted order."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    files, labels = [], []
    for k, c in enumerate(classes):
        for f in sorted(glob.glob(os.path.join(root, c, "*"))):
            files.append(f)
            labels.append(k)
    if not files:
        raise SystemExit(f"{root}: no images (expected {root}/CLASS/FILE)")
    return files, labels, classes


def torch_device(spec: str):
    import torch

    if spec == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(spec)


class PytorchFeed:
    """PyTorch's DataLoader at its usual best settings; the GPU normalises."""

    name = "pytorch"

    def __init__(self, args, device, rank: int = 0, world: int = 1):
        import torch
        from PIL import Image
        from torch.utils.data import DataLoader, Dataset, DistributedSampler
        from torchvision import transforms as T

        files, labels, self.classes = image_folder(args.data)
        tf = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(),
                        T.PILToTensor()])

        class Jpegs(Dataset):
            def __len__(self):
                return len(files)

            def __getitem__(self, i):
                with Image.open(files[i]) as im:
                    return tf(im.convert("RGB")), labels[i], i

        self.device = device
        ds = Jpegs()
        self.sampler = None
        if world > 1:
            self.sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True,
                                              seed=args.seed, drop_last=True)
        workers = args.workers
        self.loader = DataLoader(
            ds, batch_size=args.batch_size, shuffle=self.sampler is None, sampler=self.sampler,
            num_workers=workers, pin_memory=device.type == "cuda", drop_last=True,
            persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None,
        )
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
        self.settings = {"num_workers": workers, "pin_memory": device.type == "cuda",
                         "persistent_workers": workers > 0, "prefetch_factor": 4,
                         "sampler": "DistributedSampler" if world > 1 else "shuffle"}

    def epoch(self, e: int):
        if self.sampler is not None:
            self.sampler.set_epoch(e)
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)

    def prepare(self, batch):
        """(images bf16 channels_last, labels, sample indices) on the device."""
        import torch

        x, y, idx = batch
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        x = ((x.float() - self.mean) / self.std).to(torch.bfloat16)
        return x.contiguous(memory_format=torch.channels_last), y, idx

    def stats(self):
        return {"settings": self.settings}

    def close(self):
        del self.loader


class GpufeedFeed:
    """gpufeed.Loader: decoded in threads, copied and normalised on the GPU by gpufeed."""

    name = "gpufeed"

    def __init__(self, args, device, rank: int = 0, world: int = 1):
        import gpufeed

        _, _, self.classes = image_folder(args.data)
        self.device = device
        self.key = gpufeed.INDEX_KEY
        self.loader = gpufeed.Loader(
            args.data, batch_size=args.batch_size, shuffle=args.seed, workers=args.workers,
            drop_last=True, indices=True,
            device=str(device) if device.type == "cuda" else None,
            shard="env" if world > 1 else None,
            images={"size": args.image_size, "dtype": "bfloat16", "normalize": "imagenet"},
            decode=args.decode if device.type == "cuda" else None,
        )
        self.settings = {"workers": args.workers, "device": self.loader.device,
                         "shard": "env" if world > 1 else None, "decode": args.decode}

    def epoch(self, e: int):
        self.loader.set_epoch(e)
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)

    def prepare(self, batch):
        import torch

        x, y, idx = batch["image"], batch["label"], batch[self.key]
        if x.device != self.device:  # the CPU smoke test: host batches
            x, y = x.to(self.device), y.to(self.device)
        return x.contiguous(memory_format=torch.channels_last), y, idx

    def stats(self):
        s = self.loader.stats()
        keep = ("batches", "samples", "elapsed_s", "waited_s", "wait_fraction", "samples_per_s",
                "workers", "first_batch_s", "device", "images")
        return {"settings": self.settings, "loader": {k: s[k] for k in keep if k in s}}

    def close(self):
        self.loader.close()


class Timeline:
    """Per step, a start and an end mark on the device's stream: CUDA events with timing (on the
    CPU, host timers; the CPU runs each op before the next is issued)."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.starts, self.ends = [], []

    def _mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self):
        self.starts.append(self._mark())

    def end(self):
        self.ends.append(self._mark())

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def read(self):
        """(wait ms, compute ms) per step (wait[0] is 0: nothing came before it)."""
        if self.cuda:
            self.torch.cuda.synchronize()
        n = len(self.ends)
        compute = [self._ms(self.starts[k], self.ends[k]) for k in range(n)]
        wait = [0.0] + [self._ms(self.ends[k - 1], self.starts[k]) for k in range(1, n)]
        return wait, compute


def train(feed, args, device, ddp_model=None, created: float = None):
    """Trains for `args.steps` steps; returns the report and the (epoch, sample index) tensors
    seen, in order."""
    import torch
    import torchvision

    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(num_classes=len(feed.classes))
    model = model.to(device, memory_format=torch.channels_last)
    net = ddp_model(model) if ddp_model is not None else model
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    timeline = Timeline(device)
    host_data, host_start = [], []
    losses, seen = [], []
    step, epoch, epochs_cut = 0, 0, 0
    per_epoch = len(feed)
    while step < args.steps:
        it = feed.epoch(epoch)
        in_epoch = 0
        while step < args.steps:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            host_data.append(time.perf_counter() - t0)
            host_start.append(t0)
            x, y, idx = feed.prepare(batch)
            timeline.start()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            timeline.end()
            losses.append(loss.detach())
            # A copy: a view would keep the whole batch (every field shares its buffer).
            seen.append((epoch, idx.clone()))
            del batch, x, y, idx, loss
            step += 1
            in_epoch += 1
        if in_epoch < per_epoch and step < args.steps:
            epochs_cut += 1  # the loader ended an epoch early: a bug, reported
        epoch += 1
    wait, compute = timeline.read()
    t_end = time.perf_counter()
    n = len(compute)
    # Steady steps: w onwards; wait[w] starts at the end of the last warm-up step.
    w = max(1, min(args.warmup, n - 1))
    steady_ms = sum(wait[w:]) + sum(compute[w:]) if w < n else 0.0
    steady_steps = max(n - w, 0)
    images = steady_steps * args.batch_size
    wall = t_end - host_start[w] if steady_steps > 0 else 0.0
    report = {
        "feed": feed.name,
        "steps": len(compute),
        "batch_size": args.batch_size,
        "batches_per_epoch": per_epoch,
        "epochs_started": epoch,
        "epochs_ended_early": epochs_cut,
        "warmup_steps": w,
        "steady_steps": steady_steps,
        "images_per_s": images / (steady_ms / 1e3) if steady_ms > 0 else None,
        "gpu_wait_fraction": sum(wait[w:]) / steady_ms if steady_ms > 0 else None,
        "gpu_wait_ms_per_step": sum(wait[w:]) / max(steady_steps, 1),
        "gpu_compute_ms_per_step": sum(compute[w:]) / max(steady_steps, 1),
        "gpu_wait_ms_max": max(wait[w:], default=0.0),
        "host_data_time_fraction": sum(host_data[w:]) / wall if wall > 0 else None,
        "images_per_s_wall": images / wall if wall > 0 else None,
        "whole_run_images_per_s": n * args.batch_size / (t_end - created) if created else None,
        "first_step_s": (host_start[0] - created) if created else None,
        "loss_first": float(losses[0]),
        "loss_last": float(losses[-1]),
    }
    return report, seen


def machine(device) -> dict:
    import torch

    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_one(args) -> dict:
    """One feed in this process."""
    import torch

    device = torch_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = time.perf_counter()
    feed = (GpufeedFeed if args.feed == "gpufeed" else PytorchFeed)(args, device)
    report, _ = train(feed, args, device, created=created)
    report["loader"] = feed.stats()
    feed.close()
    report["machine"] = machine(device)
    report["data"] = args.data
    return report


def main():
    args = parser().parse_args()
    if args.feed != "both":
        report = run_one(args)
        text = json.dumps(report, separators=(",", ":"))
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        print(text, flush=True)
        return
    # Each feed in a process of its own: nothing of one (GPU memory, threads, worker
    # processes) is left to the other.
    runs = {}
    order = [f.strip() for f in args.order.split(",") if f.strip()]
    for name in order:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        argv = [a for a in sys.argv[1:]]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--feed", name, "--out", out]
        print(f"# {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            runs[name] = {"feed": name, "error": f"exit status {done.returncode}"}
        else:
            with open(out) as f:
                runs[name] = json.loads(f.read())
        os.remove(out)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "case": "train_resnet50",
        "order": order,
        "runs": runs,
    }
    g, t = runs.get("gpufeed", {}), runs.get("pytorch", {})
    if g.get("images_per_s") and t.get("images_per_s"):
        result["gpufeed_over_pytorch_images_per_s"] = g["images_per_s"] / t["images_per_s"]
        result["gpu_wait_fraction"] = {"gpufeed": g["gpu_wait_fraction"],
                                       "pytorch": t["gpu_wait_fraction"]}
    text = json.dumps(result, separators=(",", ":"))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    if any("error" in r for r in runs.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
