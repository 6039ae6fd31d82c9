#!/usr/bin/env python3
"""Several ranks of one machine feeding one GPU: what gpufeed's loaders deliver together,
against one rank alone on the same machine.

    torchrun --nproc-per-node 8 crates/bench/scripts/ranks_throughput.py --case raw --data R.npy --workers 2
    torchrun --nproc-per-node 1 crates/bench/scripts/ranks_throughput.py --case raw --data R.npy --workers 16

Each rank (torchrun's RANK, WORLD_SIZE) builds its loader with `shard="env"` and
`device="cuda:0"`: every rank copies to the same GPU, through its own pinned buffers and copy
stream, as 8 training processes sharing one GPU would (the lent machine has one). Cases:

- `raw`: a `.npy` of fixed-size records (150,528 B: a 224x224x3 image), shuffled, batches of
  `--batch-size` per rank; the figure is GB/s of records delivered on the GPU.
- `jpeg`: an ImageFolder of JPEGs, RandomResizedCrop(224) + flip, bf16 normalised, decoded on
  the GPU by nvJPEG (`decode="gpu"`: the workers gather the compressed bytes); images/s.
- `tokens`: a flat `train.bin` of uint16 tokens through `TokenLoader` (`--batch-size` rows of
  `--seq-len` is the global batch, each rank its share); tokens/s of input ids.

What a batch counts is read from its shapes only: no step waits for the GPU.

Epoch 0 is the warm-up (first reads, the decoders' set-up) and is not counted. Then every rank
meets at a barrier, runs `--epochs` more epochs (waiting for each batch's copy on the GPU:
`torch.cuda.current_stream().synchronize()` after the last), and meets again: the aggregate
rate is everything the ranks delivered over the time between the two barriers, as rank 0's
clock measured it. Rank 0 appends one JSON object to `--out` (and prints it): the case, the
ranks, the workers per rank, the aggregate and per-rank figures, and each rank's
`stats()["verdict"]` (where its time went).

The ranks meet over gloo: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def nbytes(x) -> int:
    """A tensor's (or, on the CPU, a numpy array's) bytes."""
    return x.numel() * x.element_size() if hasattr(x, "numel") else x.nbytes


def elements(x) -> int:
    """A tensor's (or a numpy array's) elements."""
    return x.numel() if hasattr(x, "numel") else x.size


def loader_of(a, gpufeed):
    """The rank's loader for the case, and what one batch counts (GB, images or tokens)."""
    common = dict(shard="env", device=a.device, workers=a.workers, shuffle=a.seed)
    if a.device == "cpu":
        common["output"] = "numpy"
    if a.case == "raw":
        loader = gpufeed.Loader(a.data, batch_size=a.batch_size, drop_last=True, **common)
        return loader, "GB/s", lambda batch: sum(nbytes(t) for t in batch.values()) / 1e9
    if a.case == "jpeg":
        images = {"size": 224, "dtype": "bfloat16", "normalize": "imagenet", "decode": "gpu"}
        loader = gpufeed.Loader(a.data, batch_size=a.batch_size, drop_last=True, images=images, **common)
        return loader, "images/s", lambda batch: batch["image"].shape[0]
    if a.case == "tokens":
        loader = gpufeed.TokenLoader(
            a.data, seq_len=a.seq_len, batch_size=a.batch_size, token_dtype="uint16",
            drop_last=True, **common,
        )
        # Input tokens delivered (a flat file's rows are full but for an epoch's last, which
        # drop_last leaves out); counted from the shape, so that no step waits for the GPU.
        return loader, "tokens/s", lambda batch: elements(batch["input_ids"])
    raise SystemExit(f"--case {a.case!r}: raw, jpeg or tokens")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", required=True, choices=["raw", "jpeg", "tokens"])
    p.add_argument("--data", required=True)
    p.add_argument("--workers", type=int, required=True, help="worker threads per rank")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=3, help="measured epochs, after the warm-up one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="ranks_throughput.jsonl")
    p.add_argument("--timeout", type=int, default=300, help="seconds a collective may wait")
    p.add_argument("--device", default="cuda:0", help="cpu: host batches (a dry run without a GPU)")
    a = p.parse_args()

    import torch
    import torch.distributed as dist

    import gpufeed

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(a.device))
    loader, unit, amount = loader_of(a, gpufeed)

    def synchronize():
        if cuda:
            torch.cuda.current_stream().synchronize()

    loader.set_epoch(0)
    for batch in loader:
        del batch
    synchronize()

    dist.barrier()
    t0 = time.perf_counter()
    done, batches = 0.0, 0
    for epoch in range(1, 1 + a.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            done += amount(batch)
            batches += 1
            del batch
    synchronize()
    mine = time.perf_counter() - t0
    dist.barrier()
    elapsed = time.perf_counter() - t0

    stats = loader.stats()
    row = {"rank": rank, "amount": done, "batches": batches, "seconds": mine,
           "verdict": stats.get("verdict")}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    loader.close()
    if rank == 0:
        total = sum(r["amount"] for r in rows)
        result = {
            "case": a.case,
            "ranks": world,
            "workers_per_rank": a.workers,
            "batch_size": a.batch_size,
            "epochs": a.epochs,
            "unit": unit,
            "aggregate": total / elapsed,
            "seconds": elapsed,
            "per_rank": [r["amount"] / r["seconds"] for r in rows],
            "batches_per_rank": [r["batches"] for r in rows],
            "verdicts": [r["verdict"] for r in rows],
            "cpus": os.cpu_count(),
        }
        line = json.dumps(result)
        print(line, flush=True)
        with open(a.out, "a") as f:
            f.write(line + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
