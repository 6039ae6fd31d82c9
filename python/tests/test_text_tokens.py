"""gpufeed.TokenLoader over text tokenized on the fly (``tokenizer=``, ``text_field=``): without
shuffle, the concatenated rows are exactly the corpus's documents' ids end to end in file
order, each document's ids those of Python's ``tokenizers`` then the EOS, over JSON lines and
Parquet; a resumed loader goes on with the uninterrupted stream; bad arguments name
themselves. Reuses the tokenizer tests' fixtures (test_tokenizer.py: real tokenizer.json files
and a multilingual corpus, made once under target/tokenizer-tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import numpy as np
import pytest

import gpufeed

from test_tokenizer import corpus, fixtures  # noqa: F401  (pytest fixtures, reused)

import tokenizers  # noqa: E402  (test_tokenizer skips the module where it is missing)

SEQ_LEN = 64


def expected_ids(tokenizer_dir: Path, docs: List[str], eos: int) -> List[int]:
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out: List[int] = []
    for d in docs:
        out.extend(tok.encode(d).ids)
        out.append(eos)
    return out


def write_jsonl(path: Path, docs: List[str]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "id": i}, ensure_ascii=False) + "\n")
    return path


def stream(loader) -> List[int]:
    out: List[int] = []
    for batch in loader:
        ids = np.asarray(batch["input_ids"]).reshape(-1)
        docs = np.asarray(batch["document_ids"]).reshape(-1)
        out.extend(ids[docs != -1].tolist())
    return out


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_unshuffled_rows_are_python_s_ids_end_to_end_in_file_order(fixtures, corpus, tmp_path, kind):
    docs = corpus[:150] + corpus[-18:]
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "corpus.jsonl", docs)
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        path = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=40)
    gpt2 = fixtures / "gpt2"
    eos = gpufeed.Tokenizer(gpt2).eos_id
    want = expected_ids(gpt2, docs, eos)
    rows = -(-len(want) // SEQ_LEN)
    loader = gpufeed.TokenLoader(
        {path: 1.0},
        tokenizer=gpt2,
        text_field="text",
        seq_len=SEQ_LEN,
        batch_size=4,
        samples_per_epoch=rows,
        window=16,
        workers=2,
        output="numpy",
    )
    got = stream(loader)
    assert len(got) == len(want)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None, f"first difference at token {first}"


def test_a_state_resumes_into_the_uninterrupted_stream(fixtures, corpus, tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", corpus[:120])
    args = dict(
        tokenizer=fixtures / "gpt2",
        seq_len=SEQ_LEN,
        batch_size=6,
        shuffle=3,
        window=8,
        samples_per_epoch=300,
        output="numpy",
    )
    whole = stream(gpufeed.TokenLoader(path, workers=3, **args))
    first = gpufeed.TokenLoader(path, workers=3, **args)
    head: List[int] = []
    batches = iter(first)
    for _ in range(20):
        batch = next(batches)
        ids = np.asarray(batch["input_ids"]).reshape(-1)
        head.extend(ids[np.asarray(batch["document_ids"]).reshape(-1) != -1].tolist())
    state = first.state_dict()
    first.close()
    resumed = gpufeed.TokenLoader(path, workers=1, **args)
    resumed.load_state_dict(state)
    assert head + stream(resumed) == whole


def test_bad_text_arguments_name_themselves(fixtures, tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", ["a", "b"])
    gpt2 = fixtures / "gpt2"
    with pytest.raises(gpufeed.ConfigError, match="text_field"):
        gpufeed.TokenLoader(path, tokenizer=gpt2, text_field="id", seq_len=8, batch_size=2)
    with pytest.raises(gpufeed.ConfigError, match="text_field"):
        gpufeed.TokenLoader(path, text_field="text", seq_len=8, batch_size=2)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(gpufeed.ConfigError, match="tokenizer"):
        gpufeed.TokenLoader(path, tokenizer=bad, seq_len=8, batch_size=2)
