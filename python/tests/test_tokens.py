"""gpufeed.TokenLoader: rows of token files (nanoGPT's train.bin, a 1-D .npy, a Megatron
.bin/.idx written here by the MMIDIDX layout), checked value by value against the token stream;
blends, the ranks' shares of global batches, resume under another world size, and bad input."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

import gpufeed
from conftest import documents, gpufeed_command, write_megatron

SEQ = 16
IGNORE = -100
FIELDS = ("input_ids", "labels", "position_ids", "document_ids")

@pytest.fixture
def train_bin(tmp_path: Path) -> tuple:
    """nanoGPT's train.bin (uint16, written by numpy) of 1,000 tokens, and its tokens."""
    tokens = (np.arange(1000) * 37 % 50000 + 1).astype(np.uint16)
    path = tmp_path / "train.bin"
    np.array(tokens, dtype=np.uint16).tofile(path)
    return path, tokens.astype(np.int64)


@pytest.fixture
def megatron(tmp_path: Path) -> tuple:
    """A Megatron dataset (prefix `data`) of `documents()`, and those documents."""
    docs = documents()
    write_megatron(tmp_path / "data", docs)
    return tmp_path / "data", docs


def collect(loader, limit=None) -> List[Dict[str, np.ndarray]]:
    """The batches of an iteration (copies: holding the views would hold the pool)."""
    out = []
    for batch in loader:
        out.append({k: np.array(v) for k, v in batch.items()})
        if limit is not None and len(out) == limit:
            break
    return out


def rows_of(batches) -> Dict[str, np.ndarray]:
    """Every row of `batches`, field by field."""
    return {f: np.concatenate([b[f] for b in batches]) for f in FIELDS}


def real(rows: Dict[str, np.ndarray]) -> np.ndarray:
    """Per row, True unless it is a padding row (no token of any document)."""
    return (rows["document_ids"] != -1).any(axis=1)


def runs(row_ids: np.ndarray) -> List[tuple]:
    """(start, end, id) of each run of equal `row_ids` in a row."""
    cuts = [0] + list(np.flatnonzero(row_ids[1:] != row_ids[:-1]) + 1) + [len(row_ids)]
    return [(a, b, row_ids[a]) for a, b in zip(cuts, cuts[1:])]


def expected_cu_seqlens(document_ids: np.ndarray) -> np.ndarray:
    """A batch's cu_seqlens from its document_ids: every piece of a document, and each row's
    padding, one sequence, offsets in the batch's tokens end to end."""
    rows, length = document_ids.shape
    cu = [0] + [r * length + end for r in range(rows) for _, end, _ in runs(document_ids[r])]
    return np.array(cu, dtype=np.int32)


def pieces_of(doc_of_token: np.ndarray) -> tuple:
    """(piece number, place in the piece) of each token of a row, given its document."""
    change = np.r_[True, doc_of_token[1:] != doc_of_token[:-1]]
    piece = np.cumsum(change) - 1
    return piece, np.arange(len(doc_of_token)) - np.flatnonzero(change)[piece]


def concatenated_rows(stream: np.ndarray, doc_of: np.ndarray, length: int) -> Dict[str, np.ndarray]:
    """The rows of an unshuffled concatenated epoch: row g is the tokens from g * length,
    labels the next token, positions and piece numbers restarting at each document's piece."""
    count = -(-len(stream) // length)
    out = {
        "input_ids": np.zeros((count, length), np.int64),
        "labels": np.full((count, length), IGNORE, np.int64),
        "position_ids": np.zeros((count, length), np.int64),
        "document_ids": np.full((count, length), -1, np.int64),
    }
    for g in range(count):
        window = stream[g * length : g * length + length + 1]
        n = min(len(window), length)
        out["input_ids"][g, :n] = window[:n]
        out["labels"][g, : len(window) - 1] = window[1:]
        piece, place = pieces_of(doc_of[g * length : g * length + n])
        out["document_ids"][g, :n] = piece
        out["position_ids"][g, :n] = place
    return out


def check_cu_seqlens(batches) -> None:
    for b in batches:
        cu = b["cu_seqlens"]
        assert cu.dtype == np.int32 and cu.ndim == 1
        assert np.array_equal(cu, expected_cu_seqlens(b["document_ids"]))


def test_auto_settings_choose_workers_and_make_the_same_rows(train_bin):
    path, _ = train_bin
    common = dict(seq_len=SEQ, batch_size=4, token_dtype="uint16", shuffle=2, output="numpy")
    given = rows_of(collect(gpufeed.TokenLoader(path, workers=2, **common)))
    loader = gpufeed.TokenLoader(path, workers="auto", prefetch="auto", **common)
    chosen = rows_of(collect(loader))
    for f in FIELDS:
        assert np.array_equal(chosen[f], given[f]), f
    tuning = loader.stats()["tuning"]
    assert tuning["reason"].startswith("autotune: ") and tuning["workers"] >= 1


def test_concatenated_rows_of_a_flat_file_are_windows_of_its_tokens(train_bin):
    path, tokens = train_bin
    loader = gpufeed.TokenLoader(
        path, seq_len=SEQ, batch_size=4, token_dtype="uint16", workers=2, output="numpy"
    )
    assert len(loader) == 16  # ceil(ceil(1000 / 16) / 4): 63 rows
    batches = collect(loader)
    assert len(batches) == 16 and loader.position == 16
    for b in batches:
        assert b["input_ids"].shape == (4, SEQ) and b["input_ids"].dtype == np.int64
        assert b["document_ids"].dtype == np.int32
    got = rows_of(batches)
    want = concatenated_rows(tokens, np.zeros(len(tokens), np.int64), SEQ)
    # 63 real rows, then the last batch's padding row.
    assert list(real(got)) == [True] * 63 + [False]
    for f in FIELDS:
        assert np.array_equal(got[f][:63], want[f]), f
    pad = {f: got[f][63] for f in FIELDS}
    assert (pad["input_ids"] == 0).all() and (pad["labels"] == IGNORE).all()
    assert (pad["position_ids"] == 0).all() and (pad["document_ids"] == -1).all()
    # The last real row: 1000 - 62 * 16 = 8 tokens, its last label ignored, then padding.
    assert np.array_equal(got["input_ids"][62], np.r_[tokens[992:], np.zeros(8, np.int64)])
    assert np.array_equal(got["labels"][62], np.r_[tokens[993:], np.full(9, IGNORE)])
    check_cu_seqlens(batches)
    assert len(batches[0]["cu_seqlens"]) == 5  # a sequence per row
    # Rows 60, 61, then 62 (8 tokens, 8 padding), then a padding row.
    assert np.array_equal(batches[-1]["cu_seqlens"], [0, 16, 32, 40, 48, 64])
    t = loader.stats()["tokens"]
    assert (t["batches"], t["rows"], t["tokens"], t["padding"]) == (16, 64, 1000, 24)
    assert t["padding_fraction"] == pytest.approx(24 / 1024)
    assert t["rows_per_source"] == [63] and t["shares"] == [1.0]


def test_a_1d_npy_is_a_flat_source(tmp_path):
    tokens = np.arange(100, 300, dtype=np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    loader = gpufeed.TokenLoader(tmp_path / "tokens.npy", seq_len=10, batch_size=5, output="numpy")
    got = rows_of(collect(loader))
    want = concatenated_rows(tokens.astype(np.int64), np.zeros(200, np.int64), 10)
    for f in FIELDS:
        assert np.array_equal(got[f], want[f]), f


def test_concatenated_megatron_rows_follow_the_documents_in_file_order(megatron):
    prefix, docs = megatron
    stream = np.concatenate(docs)
    doc_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    loader = gpufeed.TokenLoader(
        f"{prefix}.idx", seq_len=SEQ, batch_size=3, window=8, workers=2, output="numpy"
    )
    batches = collect(loader)
    got = rows_of(batches)
    want = concatenated_rows(stream, doc_of, SEQ)
    n = len(want["input_ids"])
    assert list(real(got)) == [True] * n + [False] * (len(got["input_ids"]) - n)
    for f in FIELDS:
        assert np.array_equal(got[f][:n], want[f]), f
    check_cu_seqlens(batches)
    # Documents of 1 to 40 tokens in rows of 16: most batches have more sequences than rows.
    assert sum(len(b["cu_seqlens"]) - 1 for b in batches) > len(got["input_ids"])


def test_parts_joined_by_gpufeed_merge_are_the_whole_dataset_and_read_as_it(megatron, tmp_path):
    """Three Megatron datasets written as megatron-core's builder writes them, joined by
    `gpufeed merge`: the files of the whole written at once (what `tools/merge_datasets.py`
    writes for the parts), and the token loader reads them as the whole, document by
    document."""
    prefix, docs = megatron
    parts = []
    for i, chunk in enumerate(np.array_split(np.arange(len(docs)), 3)):
        part = tmp_path / f"part-{i}"
        write_megatron(part, [docs[d] for d in chunk])
        parts.append(str(part))
    merged = tmp_path / "merged"
    done = subprocess.run([str(gpufeed_command()), "merge", *parts, "-o", str(merged)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for ext in (".bin", ".idx"):
        assert Path(f"{merged}{ext}").read_bytes() == Path(f"{prefix}{ext}").read_bytes(), ext
    loader = gpufeed.TokenLoader(
        f"{merged}.idx", seq_len=SEQ, batch_size=3, window=8, workers=2, output="numpy"
    )
    got = rows_of(collect(loader))
    doc_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    want = concatenated_rows(np.concatenate(docs), doc_of, SEQ)
    n = len(want["input_ids"])
    for f in FIELDS:
        assert np.array_equal(got[f][:n], want[f]), f


def test_a_shuffled_concatenated_epoch_delivers_every_token_once(megatron):
    prefix, docs = megatron
    stream = np.concatenate(docs)
    settings = dict(seq_len=SEQ, batch_size=5, window=8, shuffle=3, workers=2, output="numpy")
    loader = gpufeed.TokenLoader(prefix, **settings)
    epoch0 = rows_of(collect(loader))
    epoch1 = rows_of(collect(loader))  # the next loop is the next epoch
    assert loader.epoch == 1
    for rows in (epoch0, epoch1):
        ids, inputs, labels = rows["document_ids"], rows["input_ids"], rows["labels"]
        assert np.array_equal(np.sort(inputs[ids != -1]), np.sort(stream))
        for r in np.flatnonzero(real(rows)):
            n = int((ids[r] != -1).sum())
            # Labels are the inputs shifted by one, across documents (as Megatron's).
            assert np.array_equal(labels[r, : n - 1], inputs[r, 1:n])
            for a, b, _ in runs(ids[r][:n]):
                # A piece is consecutive tokens of one document, its places from 0.
                assert (np.diff(inputs[r, a:b]) == 1).all()
                assert np.array_equal(rows["position_ids"][r, a:b], np.arange(b - a))
    unshuffled = rows_of(collect(gpufeed.TokenLoader(prefix, **{**settings, "shuffle": None})))
    assert not np.array_equal(epoch0["input_ids"], unshuffled["input_ids"])
    assert not np.array_equal(epoch0["input_ids"], epoch1["input_ids"])
    again = rows_of(collect(gpufeed.TokenLoader(prefix, **settings)))
    for f in FIELDS:
        assert np.array_equal(again[f], epoch0[f]), f


@pytest.mark.parametrize("shuffle", [None, 2])
def test_packed_rows_hold_whole_documents_and_positions_restart(megatron, shuffle):
    prefix, docs = megatron
    length = 32
    doc_len = {int(t): len(d) for d in docs for t in d}
    first = {int(t): int(d[0]) for d in docs for t in d}
    last = {int(d[-1]) for d in docs}
    loader = gpufeed.TokenLoader(
        prefix, seq_len=length, batch_size=4, mode="packed", window=16, shuffle=shuffle,
        workers=2, output="numpy",
    )
    batches = collect(loader)
    rows = rows_of(batches)
    ids, inputs = rows["document_ids"], rows["input_ids"]
    # Every token of every document, once.
    assert np.array_equal(np.sort(inputs[ids != -1]), np.concatenate(docs))
    for r in range(len(inputs)):
        for a, b, piece in runs(ids[r]):
            if piece == -1:
                assert b == length  # padding only at a row's end
                assert (inputs[r, a:b] == 0).all() and (rows["labels"][r, a:b] == IGNORE).all()
                continue
            tokens = inputs[r, a:b]
            assert (np.diff(tokens) == 1).all() and len({first[int(t)] for t in tokens}) == 1
            assert np.array_equal(rows["position_ids"][r, a:b], np.arange(b - a))
            # A whole document, or a full row of a longer one, or its remainder.
            start, n = int(tokens[0]) - first[int(tokens[0])], doc_len[int(tokens[0])]
            assert (b - a == length and start % length == 0) or (
                start == n // length * length and start + b - a == n
            )
            # The next token of the document (across a row's end too); none at its end.
            for t, label in zip(tokens, rows["labels"][r, a:b]):
                assert label == (IGNORE if int(t) in last else t + 1)
    check_cu_seqlens(batches)
    t = loader.stats()["tokens"]
    assert t["tokens"] == sum(len(d) for d in docs)
    assert t["tokens"] + t["padding"] == t["rows"] * length
    assert 0 < t["padding_fraction"] < 0.5


def test_a_weighted_blend_takes_each_source_s_share_exactly(tmp_path, train_bin):
    flat, _ = train_bin  # tokens below 50,001
    np.save(tmp_path / "code.npy", np.arange(60_000, 62_000, dtype=np.int32))
    loader = gpufeed.TokenLoader(
        {flat: 3, tmp_path / "code.npy": 1}, seq_len=8, batch_size=8, token_dtype="u16",
        samples_per_epoch=400, shuffle=1, output="numpy",
    )
    assert len(loader) == 50 and loader.samples_per_epoch == 400
    rows = rows_of(collect(loader))
    from_code = (rows["input_ids"] >= 60_000).all(axis=1)
    assert int(from_code.sum()) == 100
    t = loader.stats()["tokens"]
    assert t["rows_per_source"] == [300, 100] and t["shares"] == [0.75, 0.25]
    assert (t["batches"], t["rows"]) == (50, 400)
    # The same blend as (path, weight) pairs.
    pairs = gpufeed.TokenLoader(
        [(flat, 3), (tmp_path / "code.npy", 1)], seq_len=8, batch_size=8, token_dtype="u16",
        samples_per_epoch=400, shuffle=1, output="numpy",
    )
    assert np.array_equal(rows_of(collect(pairs))["input_ids"], rows["input_ids"])


SHARDED = dict(seq_len=SEQ, batch_size=6, window=8, shuffle=4, workers=2, output="numpy")
EPOCHS = 2


def global_run(prefix, world: int, first_epoch=0, state=None, stop_after=None, **over):
    """The README's loop on `world` ranks in step (settings `SHARDED`, and `over`): each
    global batch as its ranks' real rows joined in rank order; and, with `stop_after`, the
    state after that many global batches (one rank's: every rank's names the same batch)."""
    settings = {**SHARDED, **over}
    loaders = [gpufeed.TokenLoader(prefix, shard=(r, world), **settings) for r in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    seen = []
    try:
        for epoch in range(first_epoch, EPOCHS):
            for loader in loaders:
                loader.set_epoch(epoch)
            for parts in zip(*loaders):
                assert {p["input_ids"].shape for p in parts} == {(-(-6 // world), SEQ)}
                rows = rows_of([{k: np.array(v) for k, v in p.items()} for p in parts])
                keep = real(rows)
                seen.append((epoch, {f: rows[f][keep] for f in FIELDS}))
                if stop_after is not None and len(seen) == stop_after:
                    states = [loader.state_dict() for loader in loaders]
                    assert len({(s["epoch"], s["next_batch"]) for s in states}) == 1
                    return seen, states[world - 1]
    finally:
        for loader in loaders:
            loader.close()
    return seen, None


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        ea == eb and all(np.array_equal(ra[f], rb[f]) for f in FIELDS)
        for (ea, ra), (eb, rb) in zip(a, b)
    )


@pytest.mark.parametrize("mode", ["concatenated", "packed"])
def test_a_state_of_two_ranks_resumes_on_three_with_the_rest_of_the_global_stream(megatron, mode):
    prefix, _ = megatron
    whole, _ = global_run(prefix, 1, mode=mode)
    per_epoch = len(gpufeed.TokenLoader(prefix, mode=mode, **SHARDED))
    assert len(whole) == EPOCHS * per_epoch
    # 6 rows a global batch: 3 per rank of 2, 2 per rank of 3; the epoch's last is short.
    assert sum(len(rows["input_ids"]) for epoch, rows in whole if epoch == 0) % 6 != 0
    for stop_after in (3, per_epoch - 1, per_epoch + 2):
        head, state = global_run(prefix, 2, stop_after=stop_after, mode=mode)
        assert (state["epoch"], state["next_batch"]) == divmod(stop_after, per_epoch)
        state = json.loads(json.dumps(state))  # as a checkpoint keeps it
        tail, _ = global_run(prefix, 3, state["epoch"], state=state, mode=mode)
        assert same(head + tail, whole), stop_after


def test_resuming_twice_in_a_row_under_other_world_sizes(megatron):
    prefix, _ = megatron
    whole, _ = global_run(prefix, 1)
    first, state = global_run(prefix, 1, stop_after=4)
    second, state = global_run(prefix, 3, state["epoch"], state=state, stop_after=5)
    assert state["next_batch"] == 9
    rest, _ = global_run(prefix, 2, state["epoch"], state=state)
    assert same(first + second + rest, whole)


def test_the_state_is_plain_python_and_a_copy_resumes(megatron):
    prefix, _ = megatron
    loader = gpufeed.TokenLoader(prefix, **SHARDED)
    collect(loader, 3)
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["next_batch"] == 3
    assert json.loads(json.dumps(state)) == state
    assert pickle.loads(pickle.dumps(state)) == state
    following = collect(loader, 2)
    resumed = gpufeed.TokenLoader(prefix, **SHARDED)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert resumed.position == 3
    for a, b in zip(collect(resumed, 2), following):
        for f in FIELDS + ("cu_seqlens",):
            assert np.array_equal(a[f], b[f]), f
    # A state of other settings is refused, naming the argument.
    other = gpufeed.TokenLoader(prefix, **{**SHARDED, "seq_len": SEQ * 2})
    with pytest.raises(gpufeed.ConfigError, match="state_dict") as e:
        other.load_state_dict(state)
    assert e.value.argument == "state_dict"


def test_state_epochs_len_and_the_context_manager(train_bin):
    path, _ = train_bin
    with gpufeed.TokenLoader(
        path, seq_len=SEQ, batch_size=4, token_dtype=np.uint16, epoch=2, output="numpy"
    ) as loader:
        assert (loader.epoch, loader.position, len(loader)) == (2, 0, 16)
        assert (loader.rank, loader.world_size, loader.rows_per_batch) == (0, 1, 4)
        collect(loader, 5)
        assert loader.position == 5
        loader.set_epoch(3)
        assert (loader.epoch, loader.position) == (3, 0)
        assert "TokenLoader(63 rows of 16 tokens" in repr(loader)
    with pytest.raises(RuntimeError, match="gpufeed.TokenLoader is closed"):
        loader.stats()
    with pytest.raises(TypeError, match="TokenLoader cannot be pickled"):
        pickle.dumps(loader)


def test_dtypes_and_labels_as_asked(train_bin):
    path, tokens = train_bin
    loader = gpufeed.TokenLoader(
        path, seq_len=SEQ, batch_size=2, token_dtype="u16", input_dtype="uint16",
        label_dtype="int32", position_dtype="int32", ignore_index=-1, pad_id=7, output="numpy",
    )
    batches = collect(loader)
    b = batches[0]
    assert (b["input_ids"].dtype, b["labels"].dtype, b["position_ids"].dtype) == (
        np.uint16, np.int32, np.int32,
    )
    assert np.array_equal(b["input_ids"][0], tokens[:SEQ])
    last = batches[-1]  # 63 rows in batches of 2: the last has 1 row of 8 tokens and a padding row
    assert np.array_equal(last["input_ids"][0], np.r_[tokens[992:], np.full(8, 7)])
    assert (last["labels"][0][7:] == -1).all() and (last["input_ids"][1] == 7).all()


def test_a_trace_is_written(train_bin, tmp_path):
    path, _ = train_bin
    trace = tmp_path / "trace.json"
    with gpufeed.TokenLoader(
        path, seq_len=SEQ, batch_size=4, token_dtype="u16", output="numpy", trace=trace
    ) as loader:
        collect(loader, 2)
    events = json.loads(trace.read_text())
    assert events["traceEvents"]


def test_bad_input_names_the_argument_or_the_file(tmp_path, train_bin, megatron):
    flat, _ = train_bin
    prefix, _ = megatron
    common = dict(seq_len=SEQ, batch_size=4, output="numpy")
    missing = tmp_path / "missing.bin"
    for dtype in ("uint16", None):
        with pytest.raises(gpufeed.FileNotFound) as e:
            gpufeed.TokenLoader(missing, token_dtype=dtype, **common)
        assert e.value.path == str(missing)
    with pytest.raises(gpufeed.ConfigError, match=re.escape(str(flat))) as e:
        gpufeed.TokenLoader(flat, **common)
    assert e.value.argument == "token_dtype"
    bad = tmp_path / "bad"
    write_megatron(bad, documents(5))
    index = Path(f"{bad}.idx")
    index.write_bytes(b"NOTMEGA\x00\x00" + index.read_bytes()[9:])
    with pytest.raises(gpufeed.DataError, match="MMIDIDX") as e:
        gpufeed.TokenLoader(bad, **common)
    assert e.value.path == str(index)
    cases = [
        (dict(seq_len=0), "seq_len"),
        (dict(batch_size=0), "batch_size"),
        (dict(shard=(2, 2)), "shard"),
        (dict(window=0), "window"),
        (dict(mode="rows"), "mode"),
        (dict(token_dtype="float32"), "token_dtype"),
        (dict(input_dtype="int8"), "input_dtype"),
        (dict(label_dtype="uint16"), "label_dtype"),
        (dict(workers="many"), "workers"),
        (dict(workers=0), "workers"),
        (dict(batch_parts="auto-ish"), "batch_parts"),
        (dict(samples_per_epoch=0), "samples_per_epoch"),
    ]
    for over, argument in cases:
        with pytest.raises(gpufeed.ConfigError) as e:
            gpufeed.TokenLoader(flat, **{**common, "token_dtype": "u16", **over})
        assert e.value.argument == argument, (over, e.value)
    for sources in ([], {flat: -1.0}, [(flat, "heavy")], [(flat, 1, 2)]):
        with pytest.raises(gpufeed.ConfigError) as e:
            gpufeed.TokenLoader(sources, token_dtype="u16", **common)
        assert e.value.argument == "sources", sources
    # One source's weight follows a blend's rules: 0 leaves nothing to read.
    with pytest.raises(gpufeed.ConfigError, match=re.escape(str(flat))) as e:
        gpufeed.TokenLoader({flat: 0}, token_dtype="u16", **common)
    assert e.value.argument == "sources" and "weight 0.0" in str(e.value)
    # A dtype for sources that name their own.
    with pytest.raises(gpufeed.ConfigError, match="leave it out") as e:
        gpufeed.TokenLoader(prefix, token_dtype="u16", **common)
    assert e.value.argument == "token_dtype"
    # A Loader's state is no token loader's.
    np.save(tmp_path / "x.npy", np.zeros((8, 2), np.float32))
    plain = gpufeed.Loader(tmp_path / "x.npy", batch_size=2, output="numpy")
    loader = gpufeed.TokenLoader(flat, token_dtype="u16", **common)
    with pytest.raises(gpufeed.ConfigError) as e:
        loader.load_state_dict(plain.state_dict())
    assert e.value.argument == "state_dict"


def test_the_readme_loop_runs(tmp_path, monkeypatch, capsys):
    readme = Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    code = [b for b in blocks if "gpufeed.TokenLoader(" in b]
    assert len(code) == 1, "python/README.md has no TokenLoader block"
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    np.arange(5000, dtype=np.uint16).tofile("train.bin")
    exec(compile(code[0], str(readme), "exec"), {"__name__": "readme"})
    # Two epochs of 5,000 tokens.
    assert capsys.readouterr().out.strip() == "delivered 10000 tokens"
    # Under torchrun's variables, rank 1 of 2 takes half of every global batch.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = gpufeed.TokenLoader("train.bin", seq_len=128, batch_size=8, token_dtype="uint16",
                                 shard="env", output="numpy")
    first = next(iter(loader))
    assert first["input_ids"].shape == (4, 128)
    assert np.array_equal(first["input_ids"][0], np.arange(512, 640))


def interrupted_token_batch_is_not_in_the_state(prefix: str) -> None:
    from test_interrupt import interrupting_conversion

    settings = dict(seq_len=SEQ, batch_size=4, mode="packed", shuffle=2, output="numpy")
    reference = gpufeed.TokenLoader(prefix, **settings)
    it = iter(reference)
    next(it), next(it)
    expected = reference.state_dict()
    third = {k: v.copy() for k, v in next(it).items()}
    # Five arrays a batch: the 11th conversion is the third batch's first.
    interrupting_conversion(lambda k: "after" if k == 11 else None)
    loader = gpufeed.TokenLoader(prefix, **settings)
    it = iter(loader)
    next(it), next(it)
    try:
        next(it)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the conversion was not interrupted")
    # The batch whose hand-over failed is not counted, the stream's places included.
    assert loader.state_dict() == expected
    again = next(iter(loader))
    assert all(np.array_equal(again[k], third[k]) for k in third)


def test_a_token_batch_whose_hand_over_was_interrupted_is_not_in_the_state(megatron):
    from conftest import run_isolated

    prefix, _ = megatron
    run_isolated(interrupted_token_batch_is_not_in_the_state, str(prefix))


def test_a_state_dict_of_other_tokens_with_the_same_counts_is_refused(tmp_path, train_bin):
    flat, tokens = train_bin
    settings = dict(seq_len=SEQ, batch_size=4, token_dtype="uint16", shuffle=1, output="numpy")
    loader = gpufeed.TokenLoader(flat, **settings)
    collect(loader, limit=3)
    state = loader.state_dict()
    # The same number of tokens, other ones: refused, naming the file.
    other = tmp_path / "other.bin"
    (tokens.astype(np.uint16) ^ 1).tofile(other)
    with pytest.raises(gpufeed.ConfigError, match="fingerprint") as e:
        gpufeed.TokenLoader(other, **settings).load_state_dict(state)
    assert e.value.argument == "state_dict" and str(other) in str(e.value)
    # The same tokens in another file resume.
    copy = tmp_path / "copy.bin"
    copy.write_bytes(flat.read_bytes())
    gpufeed.TokenLoader(copy, **settings).load_state_dict(state)
