"""gpufeed feeds PyTorch training loops.

Worker threads share one memory-mapped data set and write each sample straight into its slot of
a pooled batch buffer; each batch reaches Python as tensors that view that buffer (DLPack, no
copy), and the buffer is reused once the last of them is gone. Install with
``pip install ./python`` from the repository.

- :class:`Loader`: batches of a data set, in PyTorch's vocabulary (``batch_size``,
  ``shuffle``, ``workers``, ``drop_last``, ``shard``, ``set_epoch``, ``state_dict``).
- :class:`ImageOptions`: the image pipeline (decode, RandomResizedCrop, flip, normalise).
- :class:`TokenLoader`: language-model batches of token files (Megatron ``.bin/.idx``,
  nanoGPT's ``train.bin``, ``.npy``): concatenated or packed rows, weighted blends, ranks'
  shares of global batches, resumable under any world size.
- :class:`Tokenizer`: a Hugging Face ``tokenizer.json`` and the ids gpufeed makes of a document
  (the same as ``tokenizers``', then the EOS): check that gpufeed's ids are yours.
- :func:`pack`, :func:`inspect`: write and describe packed record files (the ``gpufeed`` command's).
- :class:`Array`: gpufeed's DLPack array (``output="dlpack"``).
- :class:`Error` and its subclasses: what goes wrong, and where.
- ``gpufeed.torch.IterableDataset``: for code that expects a torch dataset (imports torch).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence, Union

from . import _gpufeed
from ._errors import (
    ConfigError,
    DataError,
    Error,
    FileError,
    FileExists,
    FileNotFound,
    GpuError,
    InternalError,
)
from ._loader import INDEX_KEY, MASK_KEY, ImageOptions, Loader
from ._tokens import TokenLoader

Array = _gpufeed.Array
Tokenizer = _gpufeed.Tokenizer

__version__ = "0.1.0"

__all__ = [
    "Loader",
    "ImageOptions",
    "TokenLoader",
    "Tokenizer",
    "Array",
    "pack",
    "inspect",
    "read_sample",
    "MASK_KEY",
    "INDEX_KEY",
    "Error",
    "ConfigError",
    "DataError",
    "FileError",
    "FileNotFound",
    "FileExists",
    "GpuError",
    "InternalError",
]

PathLike = Union[str, "os.PathLike[str]"]


def pack(
    inputs: Union[PathLike, Sequence[PathLike]],
    output: PathLike,
    *,
    kind: Optional[str] = None,
    labels: Optional[PathLike] = None,
    record_bytes: Optional[int] = None,
    force: bool = False,
) -> Dict[str, Any]:
    """Writes the packed record file ``output`` (atomically: under a temporary name, renamed
    when complete), as ``gpufeed pack`` does, and returns what it wrote: ``path``,
    ``records``, ``file_bytes``, ``input_bytes``, ``seconds``.

    An existing ``output`` is replaced only with ``force=True`` (else :class:`FileExists`, a
    ``FileExistsError``, naming it), only when it is a packed file gpufeed wrote (or an empty
    file), and never when it is one of the inputs: any other file (a ``.npy`` array, a file
    of yours) is refused, forced or not, with a :class:`ConfigError` naming ``output`` (remove
    it yourself if it is to go).

    ``kind`` says what the inputs are (by default: ``"imagefolder"`` for a directory,
    ``"raw"`` when ``record_bytes`` is given, else ``"npy"``):

    - ``"npy"``: ``.npy`` arrays, concatenated; row ``i`` is record ``i``, in the field
      ``data``. ``labels``: a ``.npy`` array with one row per record, stored as ``label``.
    - ``"raw"``: files of fixed-size records of ``record_bytes`` bytes, back to back
      (field ``data``, uint8).
    - ``"imagefolder"``: one directory of class subdirectories of JPEG/PNG files (fields
      ``image``, ``label``, ``size``, ``path``); read it with ``Loader(..., images=...)``.

    Ctrl-C stops a ``.npy`` or raw pack within 64 MiB of input (no file is left behind); an
    image folder pack stops only at its end.
    """
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    paths = [os.fsdecode(p) for p in inputs]
    if kind is None:
        if len(paths) == 1 and os.path.isdir(paths[0]):
            kind = "imagefolder"
        elif record_bytes is not None:
            kind = "raw"
        else:
            kind = "npy"
    return _gpufeed.pack(
        paths,
        os.fsdecode(output),
        kind=kind,
        labels=None if labels is None else os.fsdecode(labels),
        record_bytes=record_bytes,
        force=bool(force),
    )


def inspect(path: PathLike, *, verify: bool = False) -> Dict[str, Any]:
    """What ``path`` holds, as ``gpufeed inspect --json`` prints it: for a packed record file,
    ``format="packed"``, ``version``, ``records``, ``fields`` (name, kind, dtype, shape),
    ``file_bytes``, ``data_bytes``, ``record_bytes`` (min, mean, max); for a ``.npy`` array,
    ``format="npy"``, ``dtype``, ``shape`` and the same sizes; for an ImageFolder directory,
    ``format="imagefolder"``, ``records`` and ``classes``; for a sharded data set (a directory
    of shards, a ``.tar`` file, a brace pattern, a URL), ``format`` (``packed``, ``webdataset
    tar``, ``MDS``), ``shards``, ``samples``, ``fields``, ``samples_per_shard``,
    ``first_shard``, ``last_shard`` and ``compression`` (``None``, or e.g. ``"zstd"``).

    ``verify=True`` also checks every record (offsets, schema, checksum) and raises a
    :class:`DataError` naming the first bad one.
    """
    return _gpufeed.inspect(os.fsdecode(path), verify=bool(verify))


def read_sample(path: PathLike, index: int) -> Dict[str, Any]:
    """Sample ``index`` of the data set at ``path`` as gpufeed reads it (the fields a batch
    would hold, decoded by the writers' conventions): each tensor field a numpy array of its
    dtype and shape, each variable-size field its ``bytes`` (text, JSON, a ``.npy`` member,
    an encoded image). For looking at data and for tests; the loader is the fast path."""
    import numpy as np

    out: Dict[str, Any] = {}
    for name, (data, kind, what, shape) in _gpufeed.read_sample(os.fsdecode(path), int(index)).items():
        if kind == "tensor":
            out[name] = np.frombuffer(data, dtype=np.dtype(what).newbyteorder("<")).reshape(shape)
        else:
            out[name] = data
    return out
