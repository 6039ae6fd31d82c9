#!/usr/bin/env python3
"""PIL side of the image bench: JPEG decode + RandomResizedCrop(224) + horizontal flip.

Usage:
  python3 crates/bench/scripts/pil_rrc.py --make --dir /tmp/gpufeed-baseline/jpegs --count 500
  python3 crates/bench/scripts/pil_rrc.py --dir /tmp/gpufeed-baseline/jpegs --count 500 --rounds 3

--make writes the JPEGs exactly as ../shared/bench/torch_baseline.py's make_jpegs does (same
photographs, same generator and seed, so the first N files are the same bytes; needs pillow,
scikit-image). The bench does what torchvision's Compose([RandomResizedCrop(224),
RandomHorizontalFlip(), PILToTensor()]) does on a PIL image, without torch: get_params (10
attempts, central fallback), img.crop(box).resize((224, 224), BILINEAR), a flip with p=0.5,
then a copy of the pixels into an array. One process, one core.
"""
import argparse, glob, math, os, random, time

import numpy as np
from PIL import Image

p = argparse.ArgumentParser()
p.add_argument("--dir", default="/tmp/gpufeed-baseline/jpegs")
p.add_argument("--count", type=int, default=500)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--make", action="store_true")
a = p.parse_args()


def make_jpegs():
    from skimage import data as skd
    photos = []
    for name in ["astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina"]:
        try:
            arr = getattr(skd, name)()
        except Exception:
            continue
        if arr.ndim == 3 and arr.shape[2] >= 3:
            photos.append(Image.fromarray(arr[..., :3]))
    rng = np.random.default_rng(2)
    for i in range(a.count):
        im = photos[i % len(photos)]
        w, h = im.size
        cw, ch = int(w * rng.uniform(0.5, 1)), int(h * rng.uniform(0.5, 1))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        d = os.path.join(a.dir, f"class_{i % 10}")
        os.makedirs(d, exist_ok=True)
        im.crop((x0, y0, x0 + cw, y0 + ch)).resize((500, 375)).save(os.path.join(d, f"{i:06d}.jpg"), quality=90)


def get_params(width, height, rnd, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rnd.uniform(*scale)
        aspect = math.exp(rnd.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rnd.randint(0, height - h), rnd.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


if a.make:
    make_jpegs()
files = sorted(glob.glob(os.path.join(a.dir, "*", "*.jpg")))[: a.count]
blobs = [open(f, "rb").read() for f in files]  # from memory, as the Rust bench reads them
import io

rnd = random.Random(0)
best = 0.0
for r in range(a.rounds):
    t0 = time.perf_counter()
    for b in blobs:
        with Image.open(io.BytesIO(b)) as im:
            im = im.convert("RGB")
            i, j, h, w = get_params(im.width, im.height, rnd)
            im = im.crop((j, i, j + w, i + h)).resize((224, 224), Image.BILINEAR)
            if rnd.random() < 0.5:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
            np.asarray(im).copy()
    rate = len(blobs) / (time.perf_counter() - t0)
    best = max(best, rate)
    print(f"round {r}: {rate:.1f} images/s")
print(f"pil_rrc224 files={len(blobs)} best={best:.1f} images/s (one core)")
