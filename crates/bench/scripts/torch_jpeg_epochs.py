#!/usr/bin/env python3
"""PyTorch + PIL on the JPEG ImageFolder over several epochs, each timed: the steady-state
companion of `../shared/bench/torch_baseline.py --only jpeg`, which times one epoch from the
DataLoader's creation (worker start-up and the last, partly idle round of batches included).

Same dataset, transform and DataLoader settings as torch_baseline.py's `jpeg` case
(PIL open + convert("RGB"), RandomResizedCrop(224), RandomHorizontalFlip, PILToTensor,
batch 128, shuffle, drop_last, pinned when a GPU is present), with persistent workers so that
the epochs after the first run without start-up, as gpufeed's bench does. Prints one JSON line
per worker count: {"case": "jpeg_rrc224_epochs", "workers": W, "epochs": [...], "steady": S}.

  python3 crates/bench/scripts/torch_jpeg_epochs.py --jpeg-dir /tmp/gpufeed-baseline/jpegs --workers 1,16
"""
import argparse, glob, json, os, time

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

p = argparse.ArgumentParser()
p.add_argument("--jpeg-dir", default="/tmp/gpufeed-baseline/jpegs")
p.add_argument("--workers", default="1,16")
p.add_argument("--epochs", type=int, default=3)
a = p.parse_args()

files = sorted(glob.glob(os.path.join(a.jpeg_dir, "*", "*.jpg")))
if not files:
    raise SystemExit(f"no JPEGs under {a.jpeg_dir}: run torch_baseline.py --only jpeg first")
tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
dev = torch.device("cuda") if torch.cuda.is_available() else None


class Jpegs(Dataset):
    def __len__(self):
        return len(files)

    def __getitem__(self, i):
        with Image.open(files[i]) as im:
            return tf(im.convert("RGB"))


for w in [int(w) for w in a.workers.split(",")]:
    dl = DataLoader(Jpegs(), batch_size=128, shuffle=True, num_workers=w, drop_last=True,
                    pin_memory=dev is not None, persistent_workers=True)
    rates = []
    for _ in range(a.epochs):
        t0, n = time.perf_counter(), 0
        for b in dl:
            n += b.shape[0]
        rates.append(n / (time.perf_counter() - t0))
    later = rates[1:]
    steady = len(later) / sum(1 / r for r in later) if later else None
    print(json.dumps({"case": "jpeg_rrc224_epochs", "workers": w,
                      "epochs": [round(r, 1) for r in rates],
                      "steady": round(steady, 1) if steady else None}), flush=True)
    del dl
