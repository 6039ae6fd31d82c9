#!/usr/bin/env python3
"""ResNet-50 with DistributedDataParallel over the GPUs of one machine, fed by gpufeed and by
PyTorch's DataLoader in turn: every rank gets the same number of batches, ranks see disjoint
samples, nothing hangs at an epoch's end, and images per second per rank.

    torchrun --nproc-per-node 2 crates/bench/scripts/train_resnet50_ddp.py --data /tmp/jpegs --steps 200

Each rank (torchrun's RANK, WORLD_SIZE, LOCAL_RANK) trains `train_resnet50.py`'s model, step and
measurements (see its docstring: CUDA events around each step, the GPU's wait for data), with
the model wrapped in `DistributedDataParallel(device_ids=[LOCAL_RANK])` over NCCL, `--batch-size`
images per rank per step, for each feed in `--order` (default gpufeed, then pytorch; a fresh
model each):

- gpufeed: `gpufeed.Loader(DIR, shard="env", device="cuda", drop_last=True, indices=True, ...)`:
  the rank's share of each epoch's order (a function of seed, epoch, rank and world size).
- pytorch: `DistributedSampler(shuffle=True, seed=..., drop_last=True)` with `set_epoch`, and the
  DataLoader of `train_resnet50.py`.

With 3,000 images, 2 ranks and 256 per batch, an epoch is 5 batches per rank, so 200 steps
cross 39 epoch boundaries. After each feed's run the ranks check, over NCCL:

- `same_batches`: every rank ran the same number of steps, and each epoch it finished had the
  same number of batches on every rank (all-gathered counts);
- `disjoint`: within each epoch, no sample index (the dataset's, all-gathered at the end) is
  seen by two ranks, and none twice on one rank;
- `epochs_ended_early`: no rank's loader ended an epoch before its length;

then meet at a barrier with a timeout (`monitored_barrier` on a gloo group, `--barrier-timeout`
seconds): a rank stuck at an epoch's end fails it instead of hanging. Rank 0 prints one JSON
object with every rank's figures (`images_per_s` per rank: compare with the one-GPU run of
`train_resnet50.py` on the same machine) and the checks.

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set (unless already set): NVLink
multicast is left off on the lent machines.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_resnet50 as single  # noqa: E402


def check(seen, per_epoch_counts, world, dist, torch, device):
    """The cross-rank checks on what this rank saw: `seen` is [(epoch, index tensor)]."""
    steps = torch.tensor([len(seen)], device=device)
    all_steps = [torch.zeros_like(steps) for _ in range(world)]
    dist.all_gather(all_steps, steps)
    all_steps = [int(s) for s in all_steps]
    result = {"steps_per_rank": all_steps}
    # Batches per finished epoch, per rank (a fixed-size tensor: the epochs every rank started).
    epochs = torch.tensor([len(per_epoch_counts)], device=device)
    all_epochs = [torch.zeros_like(epochs) for _ in range(world)]
    dist.all_gather(all_epochs, epochs)
    common = min(int(e) for e in all_epochs)
    counts = torch.tensor(per_epoch_counts[:common], device=device, dtype=torch.int64)
    all_counts = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    same = len(set(all_steps)) == 1 and all(torch.equal(c, all_counts[0]) for c in all_counts)
    result["same_batches"] = bool(same)
    result["epochs_seen"] = common
    if len(set(all_steps)) != 1:
        # Tensors of different sizes cannot be gathered: the first check failed already.
        result["disjoint"] = None
        return result
    # (epoch, index) of every sample this rank trained on, gathered.
    pairs = torch.cat([torch.stack([torch.full_like(idx.to(device), e), idx.to(device)], 1)
                       for e, idx in seen])
    gathered = [torch.zeros_like(pairs) for _ in range(world)]
    dist.all_gather(gathered, pairs)
    by_epoch = {}
    overlap = duplicates = 0
    for rank, p in enumerate(gathered):
        for e, i in p.cpu().tolist():
            owners = by_epoch.setdefault(e, {})
            if i in owners:
                if owners[i] == rank:
                    duplicates += 1
                else:
                    overlap += 1
            else:
                owners[i] = rank
    result["disjoint"] = overlap == 0 and duplicates == 0
    result["samples_seen_by_two_ranks"] = overlap
    result["samples_seen_twice_by_one_rank_in_an_epoch"] = duplicates
    result["samples_checked"] = sum(len(v) for v in by_epoch.values())
    return result


def main():
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    p = single.parser()
    p.set_defaults(feed="both")
    p.add_argument("--barrier-timeout", type=float, default=120.0)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.barrier_timeout * 2)
    if args.device == "cpu":
        # A smoke test of the script on a machine without GPUs (gloo), not a measurement.
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)

        def wrap(m):
            return DDP(m)
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)

        def wrap(m):
            return DDP(m, device_ids=[local])
    gloo = dist.new_group(backend="gloo")
    feeds = [f.strip() for f in args.order.split(",") if f.strip()]
    if args.feed != "both":
        feeds = [args.feed]
    runs = {}
    for name in feeds:
        created = time.perf_counter()
        feed = (single.GpufeedFeed if name == "gpufeed" else single.PytorchFeed)(
            args, device, rank, world)
        report, seen = single.train(feed, args, device, ddp_model=wrap, created=created)
        report["loader"] = feed.stats()
        feed.close()
        per_epoch = {}
        for e, _ in seen:
            per_epoch[e] = per_epoch.get(e, 0) + 1
        finished = [per_epoch[e] for e in sorted(per_epoch)][:-1]  # the last may be cut short
        checks = check(seen, finished, world, dist, torch, device)
        t0 = time.perf_counter()
        try:
            dist.monitored_barrier(group=gloo,
                                   timeout=datetime.timedelta(seconds=args.barrier_timeout),
                                   wait_all_ranks=True)
            checks["final_barrier"] = "passed"
        except RuntimeError as e:
            checks["final_barrier"] = f"failed: {e}"
        checks["final_barrier_s"] = time.perf_counter() - t0
        reports = [None] * world
        dist.all_gather_object(reports, report, group=gloo)
        runs[name] = {"per_rank": reports, "checks": checks}
        del feed, seen
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "case": "train_resnet50_ddp",
            "world_size": world,
            "machine": single.machine(device),
            "data": args.data,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",
                                                    "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
            "runs": runs,
        }
        for name, run in runs.items():
            rates = [r["images_per_s"] for r in run["per_rank"] if r and r.get("images_per_s")]
            run["images_per_s_per_rank"] = rates
            run["images_per_s_total"] = sum(rates)
        text = json.dumps(result, separators=(",", ":"))
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        print(text, flush=True)
    ok = all(r["checks"]["same_batches"] and r["checks"]["disjoint"]
             and r["checks"]["final_barrier"] == "passed"
             and all(x["epochs_ended_early"] == 0 for x in r["per_rank"])
             for r in runs.values())
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
