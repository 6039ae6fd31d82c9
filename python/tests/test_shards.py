"""Ranks: disjoint and complete shares, equal batch counts, the evaluation mask."""

from __future__ import annotations

import numpy as np
import pytest

import gpufeed
from conftest import N

MASK = gpufeed.MASK_KEY


def shares(packed, world, **kw):
    out = []
    for rank in range(world):
        loader = gpufeed.Loader(packed, batch_size=64, shard=(rank, world), output="numpy", **kw)
        assert (loader.rank, loader.world_size) == (rank, world)
        out.append([{k: v.copy() for k, v in b.items()} for b in loader])
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("seed", [None, 11])
def test_ranks_are_disjoint_and_complete(packed, world, seed):
    per_rank = shares(packed, world, shuffle=seed, drop_last=True)
    assert len({len(r) for r in per_rank}) == 1, "ranks got different batch counts"
    seen = [int(v) for r in per_rank for b in r for v in b["label"]]
    assert len(seen) == len(set(seen)), "a sample went to two ranks"
    # drop_last drops the tail that does not fill every rank's whole batches, nothing else.
    per = N // world
    assert len(seen) == world * (per - per % 64)


@pytest.mark.parametrize("world", [2, 3, 7])
def test_wrap_pads_shares_with_a_few_repeated_samples(packed, world):
    per_rank = shares(packed, world, shuffle=5)
    seen = [int(v) for r in per_rank for b in r for v in b["label"]]
    assert set(seen) == set(range(N))
    assert len(seen) == world * -(-N // world)


@pytest.mark.parametrize("world", [2, 3, 6, 7])
@pytest.mark.parametrize("seed", [None, 4])
def test_evaluation_reads_every_sample_once_and_masks_the_padding(packed, world, seed):
    per_rank = shares(packed, world, shuffle=seed, evaluation=True)
    assert len({len(r) for r in per_rank}) == 1, "ranks got different batch counts"
    real = []
    for r in per_rank:
        for b in r:
            mask = b[MASK]
            assert mask.dtype == np.bool_ and mask.shape == b["label"].shape
            # Padding slots are the last ones of a batch.
            n = int(mask.sum())
            assert mask[:n].all() and not mask[n:].any()
            real.extend(int(v) for v in b["label"][mask])
    assert sorted(real) == list(range(N)), "evaluation did not read every sample exactly once"


def test_no_mask_outside_evaluation_and_indices_on_request(packed):
    b = next(iter(gpufeed.Loader(packed, batch_size=8, shuffle=2, output="numpy")))
    assert MASK not in b
    b = next(iter(gpufeed.Loader(packed, batch_size=8, shuffle=2, indices=True, output="numpy")))
    assert np.array_equal(b[gpufeed.INDEX_KEY], b["label"])


def test_shard_env_reads_torchruns_variables(packed, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    loader = gpufeed.Loader(packed, batch_size=10, shard="env", output="numpy")
    assert (loader.rank, loader.world_size) == (1, 4)
    assert next(iter(loader))["label"].tolist() == list(range(1, 40, 4))
    # Sharding is never implicit.
    assert gpufeed.Loader(packed, output="numpy").world_size == 1
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(gpufeed.ConfigError) as e:
        gpufeed.Loader(packed, shard="env", output="numpy")
    assert e.value.argument == "shard" and "RANK" in str(e.value)
