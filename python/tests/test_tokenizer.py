"""gpufeed.Tokenizer against Python's `tokenizers` on real tokenizer.json files and real text.

Four fixtures made from PyPI packages (tokenizer_fixtures/make_fixtures.py: GPT-2 from
whisper's gpt2.tiktoken, a Llama-3-style one from mistral-common's Tekken ranks, Mistral's
SentencePiece v1 and v3 through transformers' converter) and a multilingual corpus of Debian
man pages (tokenizer_fixtures/make_corpus.py: English, Japanese, Chinese, Russian, Ukrainian,
Greek, Vietnamese, Turkish, German, Polish), both made once under target/tokenizer-tests; every
document's ids from gpufeed, on each engine, equal `Tokenizer.from_file(path).encode(text).ids`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import gpufeed
from conftest import gpufeed_command

if sys.version_info < (3, 11):
    pytest.skip(
        "the tokenizer fixtures need transformers 5, which needs Python 3.11",
        allow_module_level=True,
    )

import tokenizers  # noqa: E402

from tokenizer_fixtures import make_corpus, make_fixtures  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: Where the fixtures and the corpus are made, once (GPUFEED_TOKENIZER_TESTS moves it).
CACHE = Path(os.environ.get("GPUFEED_TOKENIZER_TESTS", ROOT / "target" / "tokenizer-tests"))

BYTE_LEVEL = ["gpt2", "llama3-style"]
SENTENCEPIECE = ["mistral-v1", "mistral-v3"]

#: Texts written here for the cases the splits and the special tokens must get right.
EDGES = [
    "Hello world's  end\n\n x",
    "I'M HERE'S 'ſ 'Ll 'RE I'ſx and 'Sx",
    "日本語のテキスト、です。",
    "Größe\u00a0über\u3000Straße  \t\n\r\n",
    "12345678 ½ ² Ⅻ ٣٤٥",
    "<|endoftext|>foo<|begin_of_text|>bar<|eot_id|> <s>x</s>",
    "emoji 👍🏽 and ZWJ 👨\u200d👩\u200d👧",
    "   ",
    "",
    "'",
    " \n ",
    "x\r\ny",
    "कि हिन्दी",
    "ﬁ ligature Ǆ ǅ ﬅ",
    "x " + "─" * 300 + " y",
    "=" * 300,
    "字" * 500,
    "a" * 2000,
]


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return Path(make_fixtures.make(str(CACHE / "fixtures")))


@pytest.fixture(scope="session")
def corpus() -> List[str]:
    docs = make_corpus.documents(make_corpus.make(str(CACHE / "corpus")))
    assert len(docs) > 200 and sum(len(d) for d in docs) > 1_000_000
    return docs + EDGES


@pytest.fixture(scope="session")
def python_ids(fixtures, corpus) -> Dict[str, List[List[int]]]:
    """Python's ids of every document, per fixture (`encode_batch`: the reference, on all cores)."""
    out = {}
    for name in BYTE_LEVEL + SENTENCEPIECE:
        tok = tokenizers.Tokenizer.from_file(str(fixtures / name / "tokenizer.json"))
        out[name] = [e.ids for e in tok.encode_batch(corpus)]
    return out


@pytest.fixture(scope="session")
def transformers_reads(fixtures) -> Dict[str, dict]:
    """What transformers' AutoTokenizer reads of each fixture's directory: the special tokens
    and the vocabulary's size. In a fresh interpreter: test_real_writers.py stands empty
    modules in for `transformers` in this one once its tests have run."""
    code = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "out = {}\n"
        "for d in sys.argv[1:]:\n"
        "    t = AutoTokenizer.from_pretrained(d)\n"
        "    out[d] = dict(eos_id=t.eos_token_id, bos_id=t.bos_token_id, eos=t.eos_token,\n"
        "                  bos=t.bos_token, size=len(t))\n"
        "print(json.dumps(out))\n"
    )
    dirs = [str(fixtures / n) for n in BYTE_LEVEL + SENTENCEPIECE]
    done = subprocess.run([sys.executable, "-c", code, *dirs], capture_output=True, text=True,
                          check=True)
    read = json.loads(done.stdout.strip().splitlines()[-1])
    return {Path(d).name: v for d, v in read.items()}


def first_difference(corpus, got, want) -> str:
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if not bad:
        return ""
    i = bad[0]
    a, b = got[i], want[i]
    k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (
        f"{len(bad)} of {len(corpus)} documents differ; document {i} ({corpus[i][:60]!r}) at id "
        f"{k}: gpufeed {a[max(0, k - 2):k + 4]} vs Python {b[max(0, k - 2):k + 4]}"
    )


@pytest.mark.parametrize(
    "name,engine",
    [(n, "auto") for n in BYTE_LEVEL + SENTENCEPIECE] + [(n, "crate") for n in BYTE_LEVEL],
)
def test_every_document_s_ids_equal_python_s(fixtures, corpus, python_ids, name, engine):
    tok = gpufeed.Tokenizer(fixtures / name, append_eos=False, engine=engine)
    if engine == "crate":
        assert tok.engine == "tokenizers crate (not the fast path: the crate was asked for)"
    elif name in BYTE_LEVEL:
        assert tok.engine.startswith("fast byte-level BPE"), tok.engine
    else:
        # SentencePiece's kind: a normalizer (Replace), Metaspace, byte fallback.
        assert tok.engine == "tokenizers crate (not the fast path: the normalizer is Sequence)"
    got = [tok.encode(text) for text in corpus]
    want = python_ids[name]
    assert got == want, first_difference(corpus, got, want)
    assert sum(map(len, got)) > 500_000


def test_the_default_is_python_s_ids_then_the_eos_named_by_the_config(
    fixtures, corpus, transformers_reads
):
    for name in BYTE_LEVEL + SENTENCEPIECE:
        tok = gpufeed.Tokenizer(fixtures / name)
        hf = tokenizers.Tokenizer.from_file(str(fixtures / name / "tokenizer.json"))
        auto = transformers_reads[name]
        # The special tokens as transformers reads the directory.
        assert (tok.eos_id, tok.bos_id) == (auto["eos_id"], auto["bos_id"]), name
        assert (tok.eos_token, tok.bos_token) == (auto["eos"], auto["bos"]), name
        assert tok.vocab_size == auto["size"], name
        for text in corpus[:20] + EDGES:
            assert tok.encode(text) == hf.encode(text).ids + [tok.eos_id], (name, text[:40])
        # An empty document: the template (Llama 3's and Mistral's BOS) and the EOS.
        assert tok.encode("") == hf.encode("").ids + [tok.eos_id]
    assert gpufeed.Tokenizer(fixtures / "gpt2").encode("") == [50256]
    assert gpufeed.Tokenizer(fixtures / "gpt2").megatron_dtype == "uint16"
    assert gpufeed.Tokenizer(fixtures / "llama3-style").megatron_dtype == "int32"


def test_bos_and_special_tokens_as_asked(fixtures):
    llama = fixtures / "llama3-style"
    hf = tokenizers.Tokenizer.from_file(str(llama / "tokenizer.json"))
    text = "Hello world"
    # The template's BOS is not doubled by prepend_bos.
    tok = gpufeed.Tokenizer(llama, prepend_bos=True)
    assert tok.encode(text) == hf.encode(text).ids + [tok.eos_id]
    assert tok.encode(text).count(tok.bos_id) == 1
    # Without the template, gpufeed puts it.
    plain = gpufeed.Tokenizer(llama, prepend_bos=True, add_special_tokens=False)
    assert plain.encode(text) == [tok.bos_id] + hf.encode(text, add_special_tokens=False).ids + [
        tok.eos_id
    ]
    # Another EOS by name.
    eot = gpufeed.Tokenizer(llama, eos_token="<|eot_id|>")
    assert eot.encode(text)[-1] == hf.token_to_id("<|eot_id|>")
    assert gpufeed.Tokenizer(fixtures / "gpt2" / "tokenizer.json", append_eos=False).encode(
        "a<|endoftext|>b"
    ) == hf_ids(fixtures / "gpt2", "a<|endoftext|>b")


def hf_ids(directory: Path, text: str) -> List[int]:
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids


def test_bad_input_raises_gpufeed_s_errors(fixtures, tmp_path):
    with pytest.raises(gpufeed.FileNotFound):
        gpufeed.Tokenizer(tmp_path / "nope.json")
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(gpufeed.ConfigError, match="without a tokenizer.json") as e:
        gpufeed.Tokenizer(tmp_path)
    assert e.value.argument == "path"
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": ')
    with pytest.raises(gpufeed.DataError, match="not JSON") as e:
        gpufeed.Tokenizer(bad)
    assert e.value.path == str(bad)
    with pytest.raises(gpufeed.ConfigError, match="the normalizer is Sequence") as e:
        gpufeed.Tokenizer(fixtures / "mistral-v1", engine="fast")
    assert e.value.argument == "engine"
    with pytest.raises(gpufeed.ConfigError, match="engine"):
        gpufeed.Tokenizer(fixtures / "gpt2", engine="quick")
    with pytest.raises(gpufeed.ConfigError, match="eos_token") as e:
        gpufeed.Tokenizer(fixtures / "gpt2", eos_token="</s>")
    assert e.value.argument == "eos_token"
    tok = gpufeed.Tokenizer(fixtures / "gpt2")
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    # A str that is not valid text (a lone surrogate) cannot become UTF-8: Python says so.
    with pytest.raises(UnicodeEncodeError):
        tok.encode("a\ud800b")
    assert "gpt2" in repr(tok) and "fast byte-level BPE" in repr(tok)


def read_megatron(prefix: Path) -> Tuple[List[List[int]], str]:
    """Every document of PREFIX.bin/.idx, read as megatron-core's IndexedDataset reads them
    (indexed_dataset.py's _IndexReader and IndexedDataset.get, in numpy: megatron-core needs
    torch to import): the header, then sequence lengths (int32), pointers (int64) and the
    document index (int64) from byte 34, a document being its sequences
    document_indices[d] .. document_indices[d + 1]."""
    import struct

    import numpy as np

    dtypes = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
              7: np.float32, 8: np.uint16}
    idx = Path(str(prefix) + ".idx")
    with open(idx, "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        assert struct.unpack("<Q", f.read(8)) == (1,)
        dtype = dtypes[struct.unpack("<B", f.read(1))[0]]
        sequence_count = struct.unpack("<Q", f.read(8))[0]
        document_count = struct.unpack("<Q", f.read(8))[0]
        offset = f.tell()
    view = memoryview(np.memmap(idx, mode="r", order="C"))
    lengths = np.frombuffer(view, dtype=np.int32, count=sequence_count, offset=offset)
    pointers = np.frombuffer(view, dtype=np.int64, count=sequence_count,
                             offset=offset + lengths.nbytes)
    documents = np.frombuffer(view, dtype=np.int64, count=document_count,
                              offset=offset + lengths.nbytes + pointers.nbytes)
    data = memoryview(np.memmap(str(prefix) + ".bin", mode="r", order="C"))
    out = []
    for d in range(document_count - 1):
        ids: List[int] = []
        for s in range(documents[d], documents[d + 1]):
            ids.extend(np.frombuffer(data, dtype=dtype, count=int(lengths[s]),
                                     offset=int(pointers[s])).tolist())
        out.append(ids)
    return out, np.dtype(dtype).name


@pytest.mark.parametrize("name", BYTE_LEVEL + ["mistral-v1"])
def test_the_tokenize_command_writes_what_megatron_s_preprocessing_writes(
    fixtures, corpus, tmp_path, name
):
    """`gpufeed tokenize` against Megatron's tools/preprocess_data.py --append-eod with
    --tokenizer-type HuggingFaceTokenizer, whose rules are applied here with transformers (in
    a fresh interpreter): a document's ids are `tokenizer(text).input_ids`, then the EOS if
    there are any; the dtype is uint16 below 65,500 tokens (`len(tokenizer)`), else int32.

    The ids come from the tokenizer.json as transformers loads it
    (`PreTrainedTokenizerFast(tokenizer_file=...)`, what AutoTokenizer gives in transformers
    4): transformers 5's AutoTokenizer rebuilds a `LlamaTokenizer` from its vocabulary instead,
    and for Mistral's file drops the dummy prefix before a leading space (" x": [1, 1318],
    where the tokenizer.json, Python's `tokenizers` and sentencepiece give [1, 28705, 1318]).
    The EOS and the vocabulary's size are AutoTokenizer's."""
    docs = corpus + ["", "   "]
    source = tmp_path / "corpus.jsonl"
    with open(source, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "n": len(d)}, ensure_ascii=False) + "\n")
    code = (
        "import json, sys\n"
        "from transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
        "auto = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "t = PreTrainedTokenizerFast(tokenizer_file=sys.argv[1] + '/tokenizer.json')\n"
        "out = []\n"
        "for line in open(sys.argv[2], encoding='utf-8'):\n"
        "    ids = t(json.loads(line)['text']).input_ids\n"
        "    out.append(ids + [auto.eos_token_id] if ids else [])\n"
        "dtype = 'uint16' if len(auto) < 65500 else 'int32'\n"
        "json.dump({'docs': out, 'dtype': dtype}, open(sys.argv[3], 'w'))\n"
    )
    reference = tmp_path / "megatron.json"
    subprocess.run([sys.executable, "-c", code, str(fixtures / name), str(source),
                    str(reference)], check=True)
    want = json.loads(reference.read_text())
    prefix = tmp_path / "out"
    done = subprocess.run([str(gpufeed_command()), "tokenize", str(source), "--tokenizer",
                           str(fixtures / name), "-o", str(prefix)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    got, dtype = read_megatron(prefix)
    assert dtype == want["dtype"]
    assert got == want["docs"], first_difference(docs, got, want["docs"])
    # An empty text: no document's tokens for GPT-2 (an empty document, as Megatron writes it);
    # the template's BOS and the EOS for the others.
    assert (got[-2] == []) == (name == "gpt2")
