#!/usr/bin/env python3
"""Token files written by the real tools, and what those tools read back from them.

Writes into OUT (default: tests/fixtures/tokens):

- `megatron_u16.bin/.idx`: megatron-core's `IndexedDatasetBuilder` (uint16), documents added
  with `add_document` (one sequence each), one document of three sequences added with
  `add_item` + `end_document` (sentence-split data), and an empty document;
- `megatron_i32.bin/.idx`: the same builder with int32 tokens (ids past 65,535);
- `train.bin`: nanoGPT's `prepare.py` shape, uint16 tokens written through `numpy.memmap`;
- `tokens.npy`: a 1-D `numpy.save` of uint32 tokens;
- `expected.json`: each file's documents as megatron-core's `IndexedDataset` reads them
  (a document's sequences end to end) and the flat files as numpy reads them.

megatron-core is used whole when it imports (the GPU machine has torch:
`pip install megatron-core`). Without torch, the builder and reader of the installed or
downloaded megatron-core wheel (`--wheel`, or `pip download megatron-core --no-deps`) are run
from their own module file, `megatron/core/datasets/indexed_dataset.py`, with stubs for
`torch` (only `torch.utils.data.Dataset` and `Tensor.numpy` are touched) and for the three
megatron modules it imports for object storage and logging: the bytes come from
megatron-core's code either way. The JSON says which (`writer`).

With `--check`, also reads the files back with gpufeed's Rust test
(`cargo test --test library -- tokens::files_written_by`) pointed at OUT through
GPUFEED_TOKEN_FIXTURES, and prints its result: the comparison of what gpufeed reads with
`expected.json`.
"""

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
import zipfile

import numpy as np


def load_megatron(wheel):
    """megatron.core.datasets.indexed_dataset, and how it was loaded."""
    try:
        from megatron.core.datasets import indexed_dataset  # noqa: F401

        return indexed_dataset, "megatron-core " + _version()
    except Exception:  # torch missing, or megatron-core itself
        pass
    source = None
    if wheel is None:
        spec = importlib.util.find_spec("megatron")
        if spec is not None and spec.submodule_search_locations:
            path = os.path.join(
                list(spec.submodule_search_locations)[0], "core", "datasets", "indexed_dataset.py"
            )
            if os.path.exists(path):
                source = open(path).read()
        if source is None:
            found = glob.glob(os.path.join(tempfile.gettempdir(), "mcore", "megatron_core-*.whl"))
            wheel = found[0] if found else None
    if source is None:
        if wheel is None:
            sys.exit(
                "megatron-core does not import and no wheel was given: "
                "pip download megatron-core --no-deps -d /tmp/mcore"
            )
        with zipfile.ZipFile(wheel) as z:
            source = z.read("megatron/core/datasets/indexed_dataset.py").decode()
    _stub_imports()
    module = types.ModuleType("megatron.core.datasets.indexed_dataset")
    module.__file__ = "indexed_dataset.py"
    exec(compile(source, "megatron/core/datasets/indexed_dataset.py", "exec"), module.__dict__)
    name = os.path.basename(wheel) if wheel else "installed megatron-core"
    return module, f"{name}: indexed_dataset.py with torch stubbed"


def _version():
    try:
        from megatron.core import __version__

        return __version__
    except Exception:
        return "?"


def _stub_imports():
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class Dataset:
        pass

    torch = module("torch")
    torch.utils = module("torch.utils")
    torch.utils.data = module("torch.utils.data", Dataset=Dataset)
    torch.Tensor = np.ndarray
    for name in ["megatron", "megatron.core", "megatron.core.datasets"]:
        module(name)

    class Feature:
        @staticmethod
        def is_enabled():
            return False

    never = lambda *a, **k: False  # noqa: E731
    module(
        "megatron.core.datasets.object_storage_utils",
        S3Config=object,
        ObjectStorageConfig=object,
        cache_index_file=never,
        dataset_exists=never,
        get_index_cache_path=never,
        get_object_storage_access=never,
        is_object_storage_path=never,
        parse_s3_path=never,
    )
    module("megatron.core.msc_utils", MultiStorageClientFeature=Feature)
    module("megatron.core.utils", log_single_rank=lambda *a, **k: None)


class Item:
    """What `add_item` takes: a tensor (`.numpy()`)."""

    def __init__(self, a):
        self.a = a

    def numpy(self):
        return self.a


def documents(rng, n, high):
    lengths = rng.integers(1, 200, size=n)
    return [rng.integers(0, high, size=int(l)).astype(np.int64) for l in lengths]


def write_megatron(mi, prefix, dtype, docs):
    builder = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(d, [len(d)])
    # A sentence-split document: three sequences, one document.
    for d in docs[:3]:
        builder.add_item(Item(d))
    builder.end_document()
    builder.add_document(np.array([], dtype=np.int64), [])
    builder.finalize(prefix + ".idx")
    read = mi.IndexedDataset(prefix, mmap=True)
    index = read.document_indices
    out = []
    for k in range(len(index) - 1):
        seqs = [read[int(s)] for s in range(int(index[k]), int(index[k + 1]))]
        out.append([int(t) for s in seqs for t in s])
    return {
        "dtype_code": int(mi.DType.code_from_dtype(dtype)),
        "sequences": int(len(read)),
        "documents": out,
    }


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.normpath(os.path.join(here, "..", "..", ".."))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "tokens"))
    p.add_argument("--wheel", help="a megatron_core wheel, when megatron-core does not import")
    p.add_argument("--check", action="store_true", help="read the files back with gpufeed")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mi, writer = load_megatron(args.wheel)
    rng = np.random.default_rng(22)
    expected = {"writer": writer, "numpy": np.__version__}
    expected["megatron_u16"] = write_megatron(
        mi, os.path.join(args.out, "megatron_u16"), np.uint16, documents(rng, 40, 50_257)
    )
    expected["megatron_i32"] = write_megatron(
        mi, os.path.join(args.out, "megatron_i32"), np.int32, documents(rng, 20, 200_000)
    )
    # nanoGPT's prepare.py: np.memmap(filename, dtype=np.uint16, mode="w+", shape=(arr_len,)).
    ids = rng.integers(0, 50_257, size=3000).astype(np.uint16)
    arr = np.memmap(os.path.join(args.out, "train.bin"), dtype=np.uint16, mode="w+", shape=ids.shape)
    arr[:] = ids
    arr.flush()
    del arr
    expected["train_bin"] = [int(t) for t in np.memmap(os.path.join(args.out, "train.bin"), dtype=np.uint16, mode="r")]
    tokens = rng.integers(0, 150_000, size=1000).astype(np.uint32)
    np.save(os.path.join(args.out, "tokens.npy"), tokens)
    expected["tokens_npy"] = [int(t) for t in np.load(os.path.join(args.out, "tokens.npy"))]
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(expected, f)
        f.write("\n")
    print(json.dumps({"out": args.out, "writer": writer}))
    if args.check:
        env = dict(os.environ, GPUFEED_TOKEN_FIXTURES=os.path.abspath(args.out))
        cmd = ["cargo", "test", "--test", "library", "--", "tokens::files_written_by"]
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        tail = (r.stdout + r.stderr).strip().splitlines()[-12:]
        print(json.dumps({"gpufeed_reads_the_same": r.returncode == 0, "output": tail}))
        sys.exit(r.returncode)


if __name__ == "__main__":
    main()
