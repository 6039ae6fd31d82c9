"""Eight training processes on two "nodes", started as torchrun starts them, each with a
gpufeed loader that reads its rank from the environment (``shard="env"``): what gpufeed
promises across ranks and nodes, checked from every rank's own record of what it saw.

Each run starts ``distributed_worker.py`` once per rank with torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, and ``MASTER_ADDR`` /
``MASTER_PORT``, which gpufeed does not use), two nodes of 4 ranks, each node with its own
cache directory (``GPUFEED_CACHE_DIR``), as two machines would have; every process runs the
README's loop and writes each step's samples (index and the sample's own id field), its steps,
its ``state_dict()`` and its ``stats()``. The checks, on the gathered records:

- every sample of the data set exactly once per epoch over all ranks, and in the order of one
  uninterrupted single-process run (rank ``r``'s ``k``-th sample of an epoch is position
  ``r + k * world`` of the epoch's sequence, PyTorch's ``DistributedSampler`` rule), each
  sample's id field the one its index names (the bytes arrived, not only the order);
- every rank the same number of steps, in every epoch;
- from object storage: one download per shard per node (the store's ``cache_misses``, summed
  over a node's processes, is the number of shards the node read, whichever rank fetched
  them: the processes of a node share its cache), and nothing but whole shards (and their
  empty lock files) left in each node's cache, each byte for byte the object;
- a stop mid-epoch, every rank's state saved, then a restart as 2 nodes x 3 ranks: the rest of
  the run is the uninterrupted run's (see the tests for what exactly, for ``Loader`` and for
  ``TokenLoader``), with rank 0's state given to every new rank, or each rank's own;
- a node killed (``kill -9``) mid-epoch after a checkpoint: the restart from the checkpoint
  loses and repeats nothing; killed mid-download, the node's cache holds a temporary file and
  never a half shard under a shard's name, and the next open removes the temporary file.

Data: WebDataset shards written by webdataset's ``ShardWriter``, MDS by mosaicml-streaming's
``MDSWriter`` (zstd-compressed: decompressed once per node into the node's cache, under the
same lock as a download), Parquet by pyarrow (local only: object-store URLs name sharded sets),
token files by numpy (nanoGPT's ``train.bin``) and in Megatron's layout; from a local S3 server
(moto, from python/requirements-s3.txt) where the installed package reads ``s3://`` (built with
``--features s3``). Without such a build or without moto, the S3 tests skip and say why; with
``GPUFEED_REQUIRE_S3=1`` they fail instead.

Every run of processes is bounded: a run that has not ended within ``DEADLINE`` seconds is
killed and the test fails with the ranks' output.

With ``GPUFEED_TEST_LAUNCHER=torchrun`` (where torch is installed: the GPU machine's run,
``crates/bench/scripts/device_distributed.sh``), each node's ranks are started by the real
``torchrun`` (two agents, static rendezvous on loopback) and meet in torch.distributed's
collectives over gloo: each epoch's samples are also gathered with ``all_gather_object`` and
checked against what every rank recorded, and a node killed mid-epoch leaves the other
node's ranks with the collective's error. What the test without torch cannot show: that a
surviving rank stops (it has no collective to stop in; its loader goes on serving its share).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest

import gpufeed
from conftest import documents, write_megatron

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_worker.py")
#: Seconds a run of processes may take before it is killed and the test fails.
DEADLINE = 180

N = 240  # samples: divisible by both world sizes (8 and 6)
PER_SHARD = 20
BATCH = 7  # per rank: 30 samples a rank of 8 is 5 batches, the last of 2
SEED = 11
EPOCHS = 2
LOADER_ARGS = dict(batch_size=BATCH, shuffle=SEED, workers=1)

# ---- the data --------------------------------------------------------------------------


def write_wds(d: Path) -> Path:
    """WebDataset tar shards by webdataset's ShardWriter: sample i has `cls` i and a `txt`."""
    import webdataset as wds

    d.mkdir(parents=True)
    with wds.ShardWriter(str(d / "train-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i in range(N):
            sink.write({"__key__": f"s{i:05d}", "cls": i, "txt": f"sample {i} " * (i % 7)})
    return d


def write_mds(d: Path, compression: Optional[str]) -> Path:
    """MDS shards by streaming's MDSWriter: `id` i and some bytes, xxh3_64 hashes."""
    from test_real_writers import _streaming

    s = _streaming()
    with s.MDSWriter(
        out=str(d),
        columns={"id": "int", "raw": "bytes"},
        compression=compression,
        size_limit=PER_SHARD * 120,
        hashes=["xxh3_64"],
    ) as w:
        for i in range(N):
            w.write({"id": i, "raw": bytes([i % 256]) * (50 + i % 40)})
    return d


def write_parquet(d: Path) -> Path:
    """Parquet files by pyarrow: column `id` i and a string, 4 files of several row groups."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    d.mkdir(parents=True)
    per_file = N // 4
    for f in range(4):
        ids = list(range(f * per_file, (f + 1) * per_file))
        table = pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row {i}" for i in ids]})
        pq.write_table(table, d / f"part-{f}.parquet", row_group_size=25)
    return d


def shard_of_sample(data: Path) -> Dict[int, str]:
    """Each sample's shard (file name in the data set's directory)."""
    index = data / "index.json"
    if index.exists():
        out, at = {}, 0
        for sh in json.loads(index.read_text())["shards"]:
            name = (sh["zip_data"] or sh["raw_data"])["basename"]
            for i in range(at, at + sh["samples"]):
                out[i] = name
            at += sh["samples"]
        return out
    names = sorted(p.name for p in data.glob("*.tar"))
    return {i: names[i // PER_SHARD] for i in range(N)}


# ---- launching ranks as torchrun does --------------------------------------------------


#: `GPUFEED_TEST_LAUNCHER=torchrun` (where torch is installed: the GPU machine's run) starts
#: each node's ranks with the real `torchrun` (static rendezvous on loopback, gloo), and the
#: ranks meet in torch.distributed's collectives; by default the test starts every rank itself
#: with torchrun's variables.
TORCHRUN = os.environ.get("GPUFEED_TEST_LAUNCHER") == "torchrun"


class Run:
    """The processes of one run: `nodes` x `per_node` ranks of `distributed_worker.py`, node
    `g` with the spec `specs[g]` and the cache `caches[g]` (and, as two machines would have,
    its own `XDG_CACHE_HOME` beside it, where WebDataset's tar indexes go). With `TORCHRUN`,
    one `torchrun` agent per node starts its ranks."""

    def __init__(self, out: Path, nodes: int, per_node: int, specs, caches, env=None, only=None):
        self.out, self.nodes, self.per_node = out, nodes, per_node
        self.world = nodes * per_node
        out.mkdir(parents=True, exist_ok=True)
        #: The processes the test started: by rank, or (torchrun) by node.
        self.procs: Dict[int, subprocess.Popen] = {}
        self.started = time.monotonic()
        self.nodes_run = [g for g in range(nodes) if only is None or g in only]
        port = free_port()
        for g in self.nodes_run:
            spec_file = out / f"spec-node{g}.json"
            spec_file.write_text(json.dumps({**specs[g], "out": str(out), "collective": TORCHRUN}))
            base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
            base.update(
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
                GPUFEED_CACHE_DIR=str(caches[g]),
                XDG_CACHE_HOME=f"{caches[g]}-home",
                **(env or {}),
            )
            if TORCHRUN:
                log = open(out / f"torchrun-node{g}.txt", "w")
                self.procs[g] = subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                     f"--node-rank={g}", f"--nproc-per-node={per_node}",
                     f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0",
                     str(WORKER), str(spec_file)],
                    env=base, cwd=str(out), stdout=log, stderr=subprocess.STDOUT,
                )
                log.close()
                continue
            for local in range(per_node):
                rank = g * per_node + local
                e = dict(base)
                e.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(self.world),
                    LOCAL_RANK=str(local),
                    LOCAL_WORLD_SIZE=str(per_node),
                    GROUP_RANK=str(g),
                    GROUP_WORLD_SIZE=str(nodes),
                    ROLE_RANK=str(rank),
                    ROLE_WORLD_SIZE=str(self.world),
                    ROLE_NAME="default",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    TORCHELASTIC_RUN_ID="gpufeed-test",
                    TORCHELASTIC_RESTART_COUNT="0",
                    TORCHELASTIC_MAX_RESTARTS="0",
                )
                log = open(out / f"log-rank{rank}.txt", "w")
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, str(WORKER), str(spec_file)],
                    env=e,
                    cwd=str(out),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                log.close()

    def ranks_of(self, node: int) -> List[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def units_of(self, nodes) -> List[int]:
        """The keys of `procs` that run the ranks of `nodes`."""
        if TORCHRUN:
            return [g for g in nodes if g in self.procs]
        return [r for g in nodes for r in self.ranks_of(g) if r in self.procs]

    def logs(self) -> str:
        files = sorted(self.out.glob("torchrun-node*.txt")) + sorted(self.out.glob("log-rank*.txt"))
        return "\n".join(f"--- {f.name}:\n{f.read_text(errors='replace')[-3000:]}" for f in files)

    def stop_all(self) -> None:
        self.kill_nodes(self.nodes_run)

    def kill_nodes(self, nodes, sig=signal.SIGKILL) -> None:
        """Kills the ranks of `nodes` with `sig` (under torchrun the ranks, by the pids they
        wrote, then their agent: as a machine's death would), and waits for them."""
        units = self.units_of(nodes)
        if TORCHRUN:
            for g in units:
                for r in self.ranks_of(g):
                    pid_file = self.out / f"pid-rank{r}"
                    if pid_file.exists():
                        try:
                            os.kill(int(pid_file.read_text()), sig)
                        except ProcessLookupError:
                            pass
        for u in units:
            if self.procs[u].poll() is None:
                os.kill(self.procs[u].pid, sig)
        for u in units:
            self.procs[u].wait()

    def wait_for(self, what, nodes=None) -> None:
        """Waits (within the run's deadline) until `what()` is true; fails if a process of
        `nodes` (default: all) ended with an error first."""
        watched = self.units_of(self.nodes_run if nodes is None else nodes)
        while not what():
            for u in watched:
                code = self.procs[u].poll()
                if code not in (None, 0):
                    self.stop_all()
                    pytest.fail(f"{'node' if TORCHRUN else 'rank'} {u} exited with {code}:\n{self.logs()}")
            if time.monotonic() - self.started > DEADLINE:
                self.stop_all()
                pytest.fail(f"the run did not get there within {DEADLINE} s:\n{self.logs()}")
            time.sleep(0.05)

    def ended(self, nodes) -> bool:
        return all(self.procs[u].poll() is not None for u in self.units_of(nodes))

    def finish(self) -> List[dict]:
        """Waits for every process; each must exit 0. Their results, by rank."""
        self.wait_for(lambda: self.ended(self.nodes_run))
        bad = {u: p.returncode for u, p in self.procs.items() if p.returncode != 0}
        assert not bad, f"exited with {bad}:\n{self.logs()}"
        results = [self.result(r) for g in self.nodes_run for r in self.ranks_of(g)]
        if TORCHRUN:
            check_gathered(results)
        return results

    def result(self, rank: int, name: str = "rank") -> dict:
        return json.loads((self.out / f"{name}{rank}.json").read_text())


def check_gathered(results: List[dict]) -> None:
    """Under torchrun: what every rank received from `all_gather_object` at each epoch's end is
    what each rank recorded of that epoch."""
    for res in results:
        for epoch, everyone in res["gathered"].items():
            assert everyone == [
                [step for e, step in other["steps"] if e == int(epoch)] for other in results
            ], f"rank {res['rank']}: epoch {epoch} as gathered"


def run(tmp: Path, name: str, nodes: int, per_node: int, spec: dict, caches, **kw) -> List[dict]:
    """A whole run, every node with `spec`; its results by rank, checked for the rank each
    process was given."""
    r = Run(tmp / name, nodes, per_node, [spec] * nodes, caches, **kw)
    results = r.finish()
    check_launch(results, nodes, per_node)
    return results


def check_launch(results: List[dict], nodes: int, per_node: int) -> None:
    """Each process read its rank and world size from the environment as torchrun set them."""
    world = nodes * per_node
    for rank, res in enumerate(results):
        assert (res["rank"], res["loader_rank"], res["loader_world"]) == (rank, rank, world)
        assert (res["group_rank"], res["local_rank"]) == divmod(rank, per_node)


# ---- the checks ------------------------------------------------------------------------


def epochs_of(results: List[dict]) -> List[int]:
    return sorted({e for res in results for e, _ in res["steps"]})


def same_steps(results: List[dict]) -> None:
    """Every rank took the same number of steps, in every epoch."""
    counts = [
        {e: sum(1 for x, _ in res["steps"] if x == e) for e in epochs_of(results)}
        for res in results
    ]
    assert all(c == counts[0] for c in counts), counts


def global_stream(results: List[dict], epoch: int, start: int, n: int = N) -> tuple:
    """The epoch's samples in their global order, from each rank's: rank r's k-th sample of the
    epoch is position start + r + k * world of the epoch's sequence. Returns (real, padding):
    [(position, index, id)] for positions below n, and those past it (padding that wraps
    around to the run's first positions)."""
    world = len(results)
    per_rank = [[p for e, step in res["steps"] if e == epoch for p in step] for res in results]
    assert len({len(s) for s in per_rank}) == 1, "every rank the same number of samples"
    seq = [
        (start + r + k * world, *per_rank[r][k])
        for k in range(len(per_rank[0]))
        for r in range(world)
    ]
    return [s for s in seq if s[0] < n], [s for s in seq if s[0] >= n]


def check_loader_epoch(results, epoch, reference, start=0, whole=True, n=N) -> int:
    """The epoch as every rank saw it, against the single-process run's order `reference`:
    the samples in global order are the reference's from `start` on (all of them to the
    epoch's end if `whole`), each with its own id, and padding repeats the first positions of
    the run. Returns the positions covered."""
    real, padding = global_stream(results, epoch, start, n)
    assert all(index == sample_id for _, index, sample_id in real + padding), "ids"
    got = [index for _, index, _ in real]
    assert got == reference[start : start + len(got)], f"epoch {epoch} from position {start}"
    if whole:
        assert len(got) == n - start, f"epoch {epoch}: {len(got)} of {n - start} positions"
        for pos, index, _ in padding:
            assert index == reference[start + (pos - start) % (n - start)], pos
    else:
        assert not padding
    return len(got)


def reference_order(data, epochs=EPOCHS, **args) -> Dict[int, List[int]]:
    """Each epoch's samples as one uninterrupted process reads them (world size 1)."""
    loader = gpufeed.Loader(data, indices=True, output="numpy", **{**LOADER_ARGS, **args})
    out = {}
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out[epoch] = [int(i) for b in loader for i in b["__index__"]]
    loader.close()
    return out


def check_whole_run(results, reference, epochs=EPOCHS) -> None:
    """Every epoch: every sample exactly once over all ranks, in the reference's order, every
    rank the same number of steps."""
    same_steps(results)
    assert epochs_of(results) == list(range(epochs))
    for epoch in range(epochs):
        check_loader_epoch(results, epoch, reference[epoch])
        ids = sorted(i for _, i, _ in global_stream(results, epoch, 0)[0])
        assert ids == list(range(N)), f"epoch {epoch}: every sample exactly once"


def cache_files(cache: Path) -> List[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


def temporaries(cache: Path) -> List[Path]:
    return [p for p in cache_files(cache) if ".part-" in p.name]


def check_cache(cache: Path, objects: Dict[str, bytes]) -> int:
    """Nothing in a node's cache but whole shards (`NAME~VERSION`, each byte for byte the
    object or the decompressed shard of that name) and their empty lock files. Returns the
    shards."""
    whole = 0
    for p in cache_files(cache):
        if p.name.endswith(".lock"):
            assert p.stat().st_size == 0, p
            continue
        assert ".part-" not in p.name, f"a temporary file left: {p}"
        name = p.name.rsplit("~", 1)[0]
        assert name in objects, f"not a shard: {p}"
        assert p.read_bytes() == objects[name], f"not the whole shard: {p}"
        whole += 1
    return whole


def cached_shards(cache: Path, names) -> set:
    """The names among `names` of which `cache` holds a whole file."""
    return {
        p.name.rsplit("~", 1)[0]
        for p in cache_files(cache)
        if ".part-" not in p.name and not p.name.endswith(".lock") and p.name.rsplit("~", 1)[0] in names
    }


def local_objects(data: Path) -> Dict[str, bytes]:
    """The data set's files by name, and the decompressed bytes of compressed MDS shards by
    their raw names."""
    out = {p.name: p.read_bytes() for p in data.iterdir()}
    index = data / "index.json"
    if index.exists():
        from test_real_writers import _streaming

        for sh in json.loads(index.read_text())["shards"]:
            if sh["zip_data"]:
                zipped = out[sh["zip_data"]["basename"]]
                raw = _streaming().compression.decompress(sh["compression"], zipped)
                out[sh["raw_data"]["basename"]] = raw
    return out


# ---- local data: 8 ranks, 2 nodes ------------------------------------------------------


@pytest.fixture(scope="module")
def local_sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("sets")
    return {
        "webdataset": write_wds(d / "wds"),
        "mds-zstd": write_mds(d / "mds", "zstd"),
        "parquet": write_parquet(d / "parquet"),
    }


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Two nodes' cache directories; this process's own for the reference runs."""
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache-reference"))
    return [tmp_path / "cache-node0", tmp_path / "cache-node1"]


@pytest.mark.parametrize("kind", ["webdataset", "mds-zstd", "parquet"])
def test_eight_ranks_on_two_nodes_see_every_sample_once_per_epoch(tmp_path, local_sets, caches, kind):
    data = local_sets[kind]
    field = {"webdataset": "cls"}.get(kind, "id")
    spec = dict(kind="loader", data=str(data), args=LOADER_ARGS, epochs=EPOCHS, field=field)
    results = run(tmp_path, "run", 2, 4, spec, caches)
    check_whole_run(results, reference_order(data))
    assert all(res["batches_per_epoch"] == 5 for res in results)
    assert all(len(res["steps"]) == 5 * EPOCHS for res in results)
    if kind == "mds-zstd":
        # Each node decompressed every shard once, into its own cache, whole.
        shards = len(json.loads((data / "index.json").read_text())["shards"])
        for cache in caches:
            assert check_cache(cache, local_objects(data)) == shards
    else:
        assert all(cache_files(c) == [] for c in caches), "local files need no cache"


def stop_and_resume(tmp_path, spec, caches, stop_after, states):
    """8 ranks (2 x 4) stopped after `stop_after` steps, then 6 (2 x 3) resumed from their
    states (`states`: "rank0", every new rank given rank 0's; "each", new rank r given old rank
    r % 8's) to the end of the run. Returns (first run's results, second's, the state)."""
    first = run(tmp_path, "first", 2, 4, {**spec, "stop_after": stop_after}, caches)
    saved = [res["state"] for res in first]
    # Every rank's state names the same epoch and batch; they differ only in the rank.
    assert len({(s["epoch"], s["next_batch"]) for s in saved}) == 1
    for rank, s in enumerate(saved):
        s = json.loads(json.dumps(s))
        (tmp_path / f"state-rank{rank}.json").write_text(json.dumps(s))
    if states == "rank0":
        resume = str(tmp_path / "state-rank0.json")
    else:
        for new in range(6):
            shutil.copy(tmp_path / f"state-rank{new % 8}.json", tmp_path / f"each-rank{new}.json")
        resume = str(tmp_path / "each-rank{rank}.json")
    second = run(tmp_path, "second", 2, 3, {**spec, "resume": resume}, caches)
    return first, second, saved[0]


@pytest.mark.parametrize("stop_after, states", [(2, "rank0"), (7, "each")])
def test_a_stop_mid_epoch_resumes_on_two_nodes_of_three_with_the_rest_of_the_run(
    tmp_path, local_sets, caches, states, stop_after
):
    # 8 ranks x 7 samples a batch: a step is 56 positions of the epoch's sequence. Stopped
    # after 2 steps (epoch 0, 112 positions) or 7 (epoch 1, 2 steps in: the first epoch's 5
    # steps took all 240). The 6 ranks of the restart share the positions from there, 42 a
    # step; 128 left in epoch 0 is not a multiple of 6: its last batch has 4 padding slots
    # that repeat the first positions of the restart (the Wrap rule, as an uninterrupted run's
    # epoch end would have), and the next epoch is whole, under the new world size.
    data = local_sets["mds-zstd"]
    spec = dict(kind="loader", data=str(data), args=LOADER_ARGS, epochs=EPOCHS, field="id")
    reference = reference_order(data)
    first, second, state = stop_and_resume(tmp_path, spec, caches, stop_after, states)
    same_steps(first)
    same_steps(second)
    stop_epoch, next_batch = divmod(stop_after, 5)
    assert (state["epoch"], state["next_batch"]) == (stop_epoch, next_batch)
    for epoch in range(stop_epoch):
        check_loader_epoch(first, epoch, reference[epoch])
    consumed = next_batch * BATCH * 8
    if next_batch:
        check_loader_epoch(first, stop_epoch, reference[stop_epoch], whole=False)
    assert epochs_of(second) == list(range(stop_epoch, EPOCHS))
    check_loader_epoch(second, stop_epoch, reference[stop_epoch], start=consumed)
    for epoch in range(stop_epoch + 1, EPOCHS):
        check_loader_epoch(second, epoch, reference[epoch])
    # Joined, the two runs read every sample once in each epoch.
    for epoch in range(EPOCHS):
        head = global_stream(first, epoch, 0)[0] if epoch <= stop_epoch else []
        tail = global_stream(second, epoch, consumed if epoch == stop_epoch else 0)[0]
        tail = tail if epoch >= stop_epoch else []
        assert sorted(i for _, i, _ in head + tail) == list(range(N)), epoch
    # No shard was decompressed again by the restart: each node's cache is as it was.
    shards = len(json.loads((data / "index.json").read_text())["shards"])
    for cache in caches:
        assert check_cache(cache, local_objects(data)) == shards


def test_a_node_killed_mid_epoch_restarts_from_the_checkpoint(tmp_path, local_sets, caches):
    # Every rank writes a checkpoint (its steps so far and its state) after 3 steps; node 1's
    # ranks then stop after 4 steps (stuck mid-step) and are killed with SIGKILL, as a machine
    # dies. Without collectives (CI), node 0's ranks go on to the end of the run: nothing of
    # gpufeed's waits for another rank, so the loaders themselves never hang on a lost peer.
    # Under torchrun, node 0's ranks wait at the end of epoch 0 in a collective that node 1
    # never joins; once node 1 is gone it fails with the collective's error, and node 0's
    # agent ends every rank of the node (within the deadline: no hang). The restart (2 nodes
    # x 3) from rank 0's checkpoint: the checkpointed steps and the restart are the
    # uninterrupted run, nothing lost or repeated, and each node's cache holds whole shards
    # only.
    data = local_sets["mds-zstd"]
    spec = dict(kind="loader", data=str(data), args=LOADER_ARGS, epochs=EPOCHS, field="id")
    reference = reference_order(data)
    out = tmp_path / "killed"
    specs = [{**spec, "checkpoint_at": 3}, {**spec, "checkpoint_at": 3, "pause_after": 4}]
    job = Run(out, 2, 4, specs, caches)
    job.wait_for(lambda: all((out / f"paused-rank{r}").exists() for r in job.ranks_of(1)))
    job.kill_nodes([1])
    assert all(job.procs[u].returncode == -signal.SIGKILL for u in job.units_of([1]))
    if TORCHRUN:
        job.wait_for(lambda: job.ended([0]), nodes=[])
        assert job.procs[0].returncode != 0, job.logs()
        # The first rank whose collective fails ends the node: its agent stops the others
        # (SIGTERM), which may not get to say why.
        logs = [(out / f"log-rank{r}.txt").read_text(errors="replace") for r in job.ranks_of(0)]
        assert any("Traceback" in log and "all_gather" in log for log in logs), job.logs()
    else:
        job.wait_for(lambda: job.ended([0]), nodes=[0])
        assert all(job.procs[r].returncode == 0 for r in job.ranks_of(0)), job.logs()
    checkpoint = [job.result(r, "checkpoint-rank") for r in range(8)]
    same_steps(checkpoint)
    assert check_loader_epoch(checkpoint, 0, reference[0], whole=False) == 3 * BATCH * 8
    (tmp_path / "checkpoint.json").write_text(json.dumps(checkpoint[0]["state"]))
    restart = run(
        tmp_path, "restart", 2, 3, {**spec, "resume": str(tmp_path / "checkpoint.json")}, caches
    )
    same_steps(restart)
    check_loader_epoch(restart, 0, reference[0], start=3 * BATCH * 8)
    check_loader_epoch(restart, 1, reference[1])
    shards = len(json.loads((data / "index.json").read_text())["shards"])
    for cache in caches:
        assert check_cache(cache, local_objects(data)) == shards


# ---- token streams ---------------------------------------------------------------------

SEQ = 16
TOKEN_ARGS = dict(seq_len=SEQ, batch_size=24, shuffle=3, window=16, workers=1)


@pytest.fixture(scope="module")
def token_sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    write_megatron(d / "docs", documents(count=200, longest=40, seed=9))
    (np.arange(5000) * 37 % 50000 + 1).astype(np.uint16).tofile(d / "train.bin")
    return {
        "megatron-packed": (str(d / "docs"), dict(mode="packed")),
        "train.bin": (str(d / "train.bin"), dict(token_dtype="uint16")),
    }


def token_stream(results: List[dict]) -> List[tuple]:
    """Each global step: its epoch and the ranks' real rows joined in rank order (padding rows,
    with no token of a document, left out)."""
    steps = [res["steps"] for res in results]
    assert len({len(s) for s in steps}) == 1, "every rank the same number of steps"
    out = []
    for parts in zip(*steps):
        assert len({e for e, _ in parts}) == 1, "every rank in the same epoch"
        rows = {
            f: [row for _, p in parts for row in p[f]] for f in ("input_ids", "labels", "document_ids")
        }
        real = [any(d != -1 for d in row) for row in rows["document_ids"]]
        out.append(
            (
                parts[0][0],
                [r for r, k in zip(rows["input_ids"], real) if k],
                [r for r, k in zip(rows["labels"], real) if k],
            )
        )
    return out


def token_reference(data, args) -> List[tuple]:
    loader = gpufeed.TokenLoader(data, output="numpy", **{**TOKEN_ARGS, **args})
    out = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for b in loader:
            real = (np.asarray(b["document_ids"]) != -1).any(axis=1)
            out.append(
                (
                    epoch,
                    np.asarray(b["input_ids"])[real].tolist(),
                    np.asarray(b["labels"])[real].tolist(),
                )
            )
    loader.close()
    return out


@pytest.mark.parametrize("kind", ["megatron-packed"])
def test_eight_token_ranks_make_the_single_process_stream(tmp_path, token_sets, caches, kind):
    data, args = token_sets[kind]
    spec = dict(kind="tokens", data=data, args={**TOKEN_ARGS, **args}, epochs=EPOCHS)
    results = run(tmp_path, "run", 2, 4, spec, caches)
    reference = token_reference(data, args)
    assert len(reference) > 2 * EPOCHS
    assert token_stream(results) == reference


@pytest.mark.parametrize("kind, states", [("megatron-packed", "rank0"), ("train.bin", "each")])
def test_a_token_stream_stopped_on_eight_ranks_resumes_exactly_on_six(
    tmp_path, token_sets, caches, kind, states
):
    data, args = token_sets[kind]
    spec = dict(kind="tokens", data=data, args={**TOKEN_ARGS, **args}, epochs=EPOCHS)
    reference = token_reference(data, args)
    per_epoch = sum(1 for e, _, _ in reference if e == 0)
    stop_after = per_epoch + 2  # into the second epoch
    first, second, state = stop_and_resume(tmp_path, spec, caches, stop_after, states)
    # The state counts global batches, the same on every rank and under any world size.
    assert (state["epoch"], state["next_batch"]) == divmod(stop_after, per_epoch)
    assert token_stream(first) + token_stream(second) == reference


# ---- from a local S3 server ------------------------------------------------------------


def s3_required() -> bool:
    return os.environ.get("GPUFEED_REQUIRE_S3") == "1"


def skip_or_fail(why: str):
    if s3_required():
        pytest.fail(f"{why}; GPUFEED_REQUIRE_S3=1 is set, so this fails")
    pytest.skip(why)


def moto_python() -> str:
    given = os.environ.get("GPUFEED_MOTO_PYTHON")
    if given:
        return given
    venv = REPO / "target" / "s3-venv" / "bin" / "python"
    return str(venv) if venv.exists() else "python3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_request(port: int, method: str, path: str, body: bytes = b"") -> int:
    """Sends one unsigned request to the S3 server (moto accepts it); its status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body)
    answer = conn.getresponse()
    answer.read()
    conn.close()
    return answer.status


class StallingProxy:
    """A proxy in front of the S3 server that answers GETs of objects whose names end with
    `stall_suffix` with their headers and half their body, then holds the connection until
    closed: a download under way, for as long as the test needs. `stalled` counts them."""

    def __init__(self, upstream: int, stall_suffix: str):
        self.stalled = 0
        self.release = threading.Event()
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                head = self.rfile.readline().decode("latin-1").rstrip("\r\n")
                if not head:
                    return
                headers = {}
                while True:
                    line = self.rfile.readline().decode("latin-1").rstrip("\r\n")
                    if not line:
                        break
                    k, v = line.split(":", 1)
                    headers[k.strip()] = v.strip()
                body = self.rfile.read(int(headers.get("Content-Length", headers.get("content-length", 0))))
                method, target, _ = head.split(" ", 2)
                headers = {k: v for k, v in headers.items() if k.lower() != "connection"}
                up = http.client.HTTPConnection("127.0.0.1", upstream, timeout=30)
                up.request(method, target, body=body, headers=headers)
                answer = up.getresponse()
                data = answer.read()
                up.close()
                lines = [f"HTTP/1.1 {answer.status} {answer.reason}"]
                for k, v in answer.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        lines.append(f"{k}: {v}")
                lines += [f"Content-Length: {len(data)}", "Connection: close", "", ""]
                self.wfile.write("\r\n".join(lines).encode("latin-1"))
                path = target.split("?")[0]
                if method == "GET" and answer.status // 100 == 2 and path.endswith(stall_suffix):
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    proxy.stalled += 1
                    proxy.release.wait(DEADLINE)
                    return
                if method != "HEAD":
                    self.wfile.write(data)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server with the bucket `train`: `wds/` (WebDataset tar shards) and `mds/`
    (zstd MDS shards with xxh3_64 hashes), written by their writers; skipped (or failed, with
    GPUFEED_REQUIRE_S3=1) where moto or a gpufeed that reads s3:// is missing."""
    py = moto_python()
    have = subprocess.run([py, "-c", "import moto.server, flask, werkzeug"], capture_output=True)
    if have.returncode != 0:
        skip_or_fail(
            f"no moto server: `{py} -c 'import moto.server'` failed (.ci/s3-venv installs it; "
            "GPUFEED_MOTO_PYTHON names its Python)"
        )
    port = free_port()
    server = subprocess.Popen(
        [py, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("moto.server did not start listening within 60 s")
                time.sleep(0.05)
        env = dict(
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ALLOW_HTTP="true",
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_REGION="us-east-1",
        )
        assert s3_request(port, "PUT", "/train") == 200
        d = tmp_path_factory.mktemp("s3-sets")
        sets = {"webdataset": write_wds(d / "wds"), "mds-zstd": write_mds(d / "mds", "zstd")}
        prefixes = {"webdataset": "wds", "mds-zstd": "mds"}
        for kind, local in sets.items():
            for p in local.iterdir():
                assert s3_request(port, "PUT", f"/train/{prefixes[kind]}/{p.name}", p.read_bytes()) == 200
        # Does this gpufeed read s3:// (a build with `--features s3`)?
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            gpufeed.inspect("s3://train/wds")
        except gpufeed.Error as e:
            if "reads no object store" in str(e) or "--features s3" in str(e):
                skip_or_fail(f"this gpufeed does not read s3:// URLs: {e}")
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield dict(port=port, env=env, sets=sets, urls={k: f"s3://train/{v}" for k, v in prefixes.items()})
    finally:
        server.kill()
        server.wait()


def node_downloads(results: List[dict], per_node: int, node: int) -> int:
    return sum(res["store"]["cache_misses"] for res in results[node * per_node : (node + 1) * per_node])


def shards_read(results: List[dict], per_node: int, node: int, shard_of: Dict[int, str]) -> set:
    ranks = results[node * per_node : (node + 1) * per_node]
    return {shard_of[i] for res in ranks for _, step in res["steps"] for i, _ in step}


@pytest.mark.parametrize("kind", ["webdataset", "mds-zstd"])
def test_eight_ranks_read_s3_once_per_node_and_resume_on_six(tmp_path, s3, caches, monkeypatch, kind):
    for k, v in s3["env"].items():
        monkeypatch.setenv(k, v)
    local = s3["sets"][kind]
    field = {"webdataset": "cls"}.get(kind, "id")
    spec = dict(kind="loader", data=s3["urls"][kind], args=LOADER_ARGS, epochs=EPOCHS, field=field)
    reference = reference_order(local)
    objects = local_objects(local)
    shard_of = shard_of_sample(local)
    shards = len(set(shard_of.values()))

    results = run(tmp_path, "whole", 2, 4, spec, caches, env=s3["env"])
    check_whole_run(results, reference)
    for node, cache in enumerate(caches):
        # Every shard downloaded once by the node, whichever of its 4 processes fetched it;
        # the others found it in the node's cache or waited for it.
        assert shards_read(results, 4, node, shard_of) == set(shard_of.values())
        assert node_downloads(results, 4, node) == shards, [r["store"] for r in results]
        whole = check_cache(cache, objects)
        assert whole == shards * (2 if kind == "mds-zstd" else 1), "downloaded (and decompressed)"
    assert all(res["store"]["checksum_failures"] == 0 for res in results)

    # Stopped mid-epoch on 8 ranks, resumed on 2 nodes x 3 from rank 0's state, on fresh
    # caches for the first run and the same caches for the restart: nothing downloaded again.
    fresh = [tmp_path / "fresh-node0", tmp_path / "fresh-node1"]
    first = run(tmp_path, "first", 2, 4, {**spec, "stop_after": 2}, fresh, env=s3["env"])
    assert all(not temporaries(c) for c in fresh), "a store closed mid-fetch removes its own"
    (tmp_path / "state.json").write_text(json.dumps(first[0]["state"]))
    shard_files = {p.name for p in local.iterdir() if p.name != "index.json"}
    assert len(shard_files) == shards
    cached_after = [cached_shards(c, shard_files) for c in fresh]
    second = run(
        tmp_path, "second", 2, 3, {**spec, "resume": str(tmp_path / "state.json")}, fresh, env=s3["env"]
    )
    check_loader_epoch(first, 0, reference[0], whole=False)
    check_loader_epoch(second, 0, reference[0], start=2 * BATCH * 8)
    check_loader_epoch(second, 1, reference[1])
    for node, cache in enumerate(fresh):
        check_cache(cache, objects)
        # The first run's figures are taken at its last step; a shard its store was still
        # prefetching may land in the cache after them (its process finishes the fetch before
        # exiting, or removes the temporary). So: the second run downloads exactly the shards
        # the first left out of the cache, and none was downloaded twice.
        cached_by_first = cached_after[node]
        assert node_downloads(first, 4, node) <= len(cached_by_first)
        assert node_downloads(second, 3, node) == shards - len(cached_by_first)
        assert cached_shards(cache, shard_files) == shard_files


@pytest.mark.skipif(
    TORCHRUN, reason="one node alone cannot meet torchrun's rendezvous; the test without torchrun holds"
)
def test_a_node_killed_mid_download_from_s3_leaves_no_half_shard(tmp_path, s3, caches, monkeypatch):
    # Node 1's ranks read through a proxy that holds every shard's download half way; once
    # they are all waiting on one, they are killed with SIGKILL. Node 1's cache then holds
    # temporary files (`NAME~VERSION.part-PID-N`) and no file under a shard's name; the next
    # loader opened on that cache removes them before it reads anything, and the node's
    # ranks, started again, read their share whole.
    for k, v in s3["env"].items():
        monkeypatch.setenv(k, v)
    url, local = s3["urls"]["webdataset"], s3["sets"]["webdataset"]
    spec = dict(kind="loader", data=url, args=LOADER_ARGS, epochs=1, field="cls")
    proxy = StallingProxy(s3["port"], ".tar")
    try:
        stalled_env = {**s3["env"], "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
        job = Run(tmp_path / "stalled", 2, 4, [spec, spec], caches, env=stalled_env, only=[1])
        job.wait_for(lambda: proxy.stalled >= 1 and temporaries(caches[1]), nodes=[1])
        job.kill_nodes([1])
    finally:
        proxy.close()
    left = temporaries(caches[1])
    assert left, "a download was under way"
    assert [p for p in cache_files(caches[1]) if not p.name.endswith(".lock") and ".part-" not in p.name] == []
    # The next open removes them, before the first batch.
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(caches[1]))
    loader = gpufeed.Loader(url, batch_size=4, output="numpy")
    assert temporaries(caches[1]) == [], "the next open removes a killed download's files"
    loader.close()
    again = Run(tmp_path / "again", 2, 4, [spec, spec], caches, env=s3["env"], only=[1])
    results = again.finish()
    reference = reference_order(local, epochs=1)
    real = sorted(i for res in results for _, step in res["steps"] for i, sid in step if i == sid)
    node1 = sorted(reference[0][p] for p in range(N) if p % 8 >= 4)
    assert real == node1, "node 1's ranks read their share, each sample's own bytes"
    check_cache(caches[1], local_objects(local))
