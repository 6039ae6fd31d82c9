"""The GPU decode's yardstick: torchvision's nvJPEG decode of every JPEG of an
ImageFolder, `decode_jpeg(device="cuda")` in batches of 128, no crop, three passes; first the
time of the process's first batched decode (nvJPEG's set-up included).

    python3 nvjpeg_yardstick.py DIR

Prints one JSON object per figure.
"""

import glob
import json
import os
import sys
import time

import torch
from torchvision.io import decode_jpeg, read_file

files = sorted(glob.glob(os.path.join(sys.argv[1], "*", "*.jpg")))
data = [read_file(f) for f in files]
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t = time.perf_counter()
decode_jpeg(data[:128], device="cuda")
torch.cuda.synchronize()
print(json.dumps({"case": "torchvision_first_decode_b128", "seconds": round(time.perf_counter() - t, 4)}))
for p in range(3):
    t0 = time.perf_counter()
    for s in range(0, len(data) - 127, 128):
        decode_jpeg(data[s:s + 128], device="cuda")
    torch.cuda.synchronize()
    n = (len(data) // 128) * 128
    print(json.dumps({"case": "torchvision_nvjpeg_decode_b128", "pass": p, "images": n,
                      "value": round(n / (time.perf_counter() - t0), 1), "unit": "images/s"}))
