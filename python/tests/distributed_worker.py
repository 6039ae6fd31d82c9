"""One rank of test_distributed.py's runs, started as torchrun starts a training process: the
rank, world size, local rank, local world size and node (group) rank come from torchrun's
variables, the node's cache directory from ``GPUFEED_CACHE_DIR``. Not a test module: the test
starts it as ``python distributed_worker.py SPEC.json``.

It runs the README's loop (``set_epoch`` at the top of each epoch, the state taken after the
step that used the last batch) over ``gpufeed.Loader(..., shard="env")`` or
``gpufeed.TokenLoader(..., shard="env")``, and writes what it saw to ``OUT/rank{RANK}.json``
(written under a temporary name and renamed, so the test never reads half a file): each
step's epoch and samples, the steps it took, its ``state_dict()`` and its ``stats()``.

The spec (JSON) says:

- ``kind``: ``"loader"`` or ``"tokens"``; ``data``: the path or URL; ``args``: the loader's
  other arguments (``shard="env"`` is added); ``epochs``: the loop's end (exclusive).
- ``out``: the directory of the results.
- ``resume``: a state file to load before the loop, ``{rank}`` in its name replaced by this
  rank (the loop then starts at its epoch), or None.
- ``stop_after``: stop (write the results, close the loader, exit 0) after this many steps of
  this run: a job stopped mid-epoch.
- ``checkpoint_at``: after this many steps, write ``OUT/checkpoint-rank{RANK}.json``: the
  steps so far and the state, as a training loop's checkpoint does, then go on.
- ``pause_after``: after this many steps, write ``OUT/paused-rank{RANK}`` and wait (sleep)
  until killed: a rank blocked in a collective.
- ``field``: the field that holds each sample's own id (``Loader`` only): recorded with the
  sample's index, so that the test checks the bytes that arrived, not only the order.
- ``collective``: started by the real ``torchrun`` (where torch is installed): the process
  group is made (gloo, torchrun's rendezvous variables), this rank's output goes to
  ``OUT/log-rank{RANK}.txt`` and its pid to ``OUT/pid-rank{RANK}``, and the ranks meet as a
  training loop's would: a barrier before a checkpoint or a stop (rank 0's state is then
  every rank's), and at each epoch's end an ``all_gather_object`` of the epoch's samples
  (recorded as ``gathered``: what ``torch.distributed`` saw). A paused rank sleeps (a rank
  stuck mid-step); its peers then wait in their next collective, until the collective fails
  or times out (``timeout`` seconds, default 60).
"""

from __future__ import annotations

import json
import os
import sys
import time


def write_json(path: str, value) -> None:
    """`value` as JSON at `path`, by a temporary name and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def ids_of(batch, field):
    """The batch's samples as [index, id] pairs (a scalar field, or a ragged one whose values
    are the id's decimal digits)."""
    import numpy as np

    index = np.asarray(batch["__index__"]).tolist()
    value = batch[field]
    if isinstance(value, tuple):
        values, offsets = (np.asarray(v) for v in value)
        raw = bytes(values)
        ids = [int(raw[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    else:
        ids = np.asarray(value).reshape(len(index)).tolist()
    return [[i, int(s)] for i, s in zip(index, ids)]


def rows_of(batch):
    """A token batch's rows: input_ids and labels, as lists (padding rows included)."""
    import numpy as np

    return {
        "input_ids": np.asarray(batch["input_ids"]).tolist(),
        "labels": np.asarray(batch["labels"]).tolist(),
        "document_ids": np.asarray(batch["document_ids"]).tolist(),
    }


class Collective:
    """The ranks' meetings: torch.distributed's where the spec asks for them, else none."""

    def __init__(self, spec: dict, rank: int):
        self.dist = None
        if not spec.get("collective"):
            return
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", timeout=datetime.timedelta(seconds=spec.get("timeout", 60))
        )
        self.dist = dist

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    def gather(self, value):
        """Every rank's `value`, by rank (None without collectives)."""
        if self.dist is None:
            return None
        values = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(values, value)
        return values

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    out = spec["out"]
    if spec.get("collective"):
        # Under torchrun the test sees neither this process's pid nor its output: both go to
        # files of the rank's own.
        log = os.open(os.path.join(out, f"log-rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        with open(os.path.join(out, f"pid-rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
    collective = Collective(spec, rank)
    import gpufeed

    args = dict(spec.get("args", {}))
    if spec["kind"] == "tokens":
        loader = gpufeed.TokenLoader(spec["data"], shard="env", output="numpy", **args)
    else:
        loader = gpufeed.Loader(spec["data"], shard="env", output="numpy", indices=True, **args)
    first_epoch = 0
    if spec.get("resume"):
        with open(spec["resume"].replace("{rank}", str(rank))) as f:
            state = json.load(f)
        loader.load_state_dict(state)
        first_epoch = state["epoch"]
    steps = []
    gathered = {}

    def results(done: bool):
        stats = loader.stats()
        return {
            "rank": rank,
            "world": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
            "group_rank": int(os.environ["GROUP_RANK"]),
            "loader_rank": loader.rank,
            "loader_world": loader.world_size,
            "pid": os.getpid(),
            "batches_per_epoch": len(loader),
            "steps": steps,
            "gathered": gathered,
            "state": loader.state_dict(),
            "store": stats.get("store"),
            "shards": stats.get("shards"),
            "done": done,
        }

    def finish(done: bool) -> int:
        write_json(os.path.join(out, f"rank{rank}.json"), results(done))
        loader.close()
        collective.close()
        return 0

    for epoch in range(first_epoch, spec["epochs"]):
        loader.set_epoch(epoch)
        for batch in loader:
            if spec["kind"] == "tokens":
                steps.append([epoch, rows_of(batch)])
            else:
                steps.append([epoch, ids_of(batch, spec["field"])])
            del batch
            if len(steps) == spec.get("checkpoint_at"):
                # As a training loop checkpoints: every rank past the step, then the state.
                collective.barrier()
                write_json(os.path.join(out, f"checkpoint-rank{rank}.json"), results(False))
            if len(steps) == spec.get("stop_after"):
                collective.barrier()
                return finish(False)
            if len(steps) == spec.get("pause_after"):
                with open(os.path.join(out, f"paused-rank{rank}"), "w"):
                    pass
                while True:
                    time.sleep(60)
        mine = [step for e, step in steps if e == epoch]
        everyone = collective.gather(mine)
        if everyone is not None:
            gathered[str(epoch)] = everyone
    return finish(True)


if __name__ == "__main__":
    sys.exit(main())
