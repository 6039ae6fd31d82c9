"""``gpufeed.TokenLoader``: language-model batches of a global token stream, the arguments
checked and spelled out for the extension module (``_gpufeed.token_core``), which builds the
library's ``TokenLoader`` and serves it through the same core as ``gpufeed.Loader``."""

from __future__ import annotations

import math
import os
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from . import _gpufeed
from ._errors import config_error
from ._loader import (
    PathLike,
    _Batches,
    _converter,
    _cuda_ordinal,
    _dtype_name,
    _int,
    _read_mode,
    _seed,
    _setting,
    _shard,
    _trace_file,
)

__all__ = ["TokenLoader"]

#: Integer dtypes by the names numpy, torch and gpufeed give them.
_INT_DTYPES = {
    "uint8": "u8",
    "u8": "u8",
    "int8": "i8",
    "i8": "i8",
    "uint16": "u16",
    "u16": "u16",
    "int16": "i16",
    "i16": "i16",
    "uint32": "u32",
    "u32": "u32",
    "int32": "i32",
    "i32": "i32",
    "uint64": "u64",
    "u64": "u64",
    "int64": "i64",
    "i64": "i64",
    "long": "i64",
}

#: What ``sources=`` takes: a path, a list of paths, or weighted paths.
Sources = Union[
    PathLike,
    Sequence[Union[PathLike, Tuple[PathLike, float]]],
    Mapping[PathLike, float],
]


def _int_dtype(argument: str, dtype: Any) -> str:
    """gpufeed's name of an integer dtype (``"uint16"``, ``"u16"``, ``numpy.uint16``,
    ``torch.int32``)."""
    name = _dtype_name(dtype, _INT_DTYPES)
    if name is None:
        raise config_error(
            argument, f"{dtype!r} is not an integer dtype (uint16, uint32, int32, int64, ...)"
        )
    return name


def _path(item: Any) -> str:
    try:
        return os.fsdecode(item)
    except TypeError:
        raise config_error(
            "sources", f"{item!r} is not a path, or a (path, weight) pair"
        ) from None


def _weight(path: str, weight: Any) -> float:
    """A source's weight: a number of at least 0 (numpy's scalars too)."""
    if isinstance(weight, (bool, str, bytes)) or not hasattr(weight, "__float__"):
        raise config_error("sources", f"{path}: the weight {weight!r} is not a number")
    value = float(weight)
    if not math.isfinite(value) or value < 0:
        raise config_error("sources", f"{path}: the weight {value} is not a number of at least 0")
    return value


def _sources(sources: Any) -> List[Tuple[str, float]]:
    """``sources=`` as (path, weight) pairs: a path (weight 1), paths (weight 1 each), a dict
    of path -> weight, or (path, weight) pairs."""
    if isinstance(sources, (str, bytes, os.PathLike)):
        return [(_path(sources), 1.0)]
    if isinstance(sources, Mapping):
        items: List[Any] = list(sources.items())
    else:
        try:
            items = list(sources)
        except TypeError:
            raise TypeError(
                "sources must be a path, a list of paths, or a dict or list of (path, weight) "
                f"pairs, not {type(sources).__name__}"
            ) from None
    pairs = []
    for item in items:
        if isinstance(item, (str, bytes, os.PathLike)):
            pairs.append((_path(item), 1.0))
            continue
        try:
            path, weight = item
        except (TypeError, ValueError):
            raise config_error(
                "sources", f"{item!r} is not a path, or a (path, weight) pair"
            ) from None
        path = _path(path)
        pairs.append((path, _weight(path, weight)))
    if not pairs:
        raise config_error("sources", "no source given")
    return pairs


def _signed(argument: str, x: Any) -> int:
    """An integer of 64 bits, negative or not."""
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(f"{argument} must be an integer, not {type(x).__name__}")
    value = int(x.__index__())
    if not -(1 << 63) <= value < 1 << 63:
        raise config_error(argument, f"{value} does not fit in 64 bits")
    return value


class TokenLoader(_Batches):
    """Language-model batches: rows of ``seq_len`` tokens from token files, concatenated or
    packed, one source or a weighted blend, each rank's share of every global batch, resumable
    exactly under any world size. Workers, prefetch, the pool of batch buffers and the
    hand-over are those of :class:`gpufeed.Loader`; so are iteration, ``set_epoch``,
    ``state_dict``, ``stats()``, ``close()`` and ``with``::

        loader = gpufeed.TokenLoader("data/train.bin", seq_len=1024, batch_size=32,
                                     token_dtype="uint16", shuffle=0, shard="env")
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:   # input_ids, labels, position_ids, document_ids, cu_seqlens
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    Sources: a Megatron-LM indexed dataset (``prefix.bin`` + ``prefix.idx``, named by the
    prefix or either file), a flat file of raw tokens (nanoGPT's ``train.bin``: give
    ``token_dtype``), or a 1-D ``.npy`` array. A Megatron dataset's documents are documents; a
    flat file or a ``.npy`` is one document.

    Rows: ``mode="concatenated"`` (Megatron's ``GPTDataset``): an epoch's documents end to end
    (their order shuffled in windows of ``window`` documents), cut into rows of ``seq_len``
    tokens, ``labels`` the next token (the inputs shifted by one, across row ends); every token
    of the epoch is an input of exactly one row, the last row padded. ``mode="packed"``: whole
    documents placed into rows by best-fit decreasing within windows of ``window`` documents
    (longer ones split into full rows), padded; ``position_ids`` restart at each document and
    ``cu_seqlens`` delimits them, so that no token need attend across documents. Rows are
    shuffled over the whole epoch (with ``shuffle``).

    Each batch is a dict of:

    - ``input_ids``, ``labels``, ``position_ids`` (``[rows, seq_len]``, of ``input_dtype``,
      ``label_dtype``, ``position_dtype``), and ``document_ids`` (int32 ``[rows, seq_len]``):
      each token's piece of document within its row, from 0, -1 for padding (a document mask
      is ``document_ids[:, :, None] == document_ids[:, None, :]``). Padding has ``pad_id``
      inputs, ``ignore_index`` labels (as has each document's last token with
      ``mask_document_ends``), position 0.
    - ``cu_seqlens``: int32 ``[sequences + 1]``, the offsets of the batch's sequences in its
      ``rows * seq_len`` tokens laid end to end, from 0 to ``rows * seq_len``, as
      flash-attention's varlen kernels take them: each piece of a document in a row is a
      sequence, and so is each row's padding. It is trimmed to the batch's sequences (a view
      of the batch buffer, no copy); the longest is ``(cu_seqlens[1:] - cu_seqlens[:-1]).max()``.

    Every rank's batch has ``ceil(batch_size / world_size)`` rows: rank ``r`` takes rows
    ``floor(r * b / w) .. floor((r + 1) * b / w)`` of each global batch of ``b`` rows; a rank
    whose share is smaller (a world size that does not divide ``batch_size``, the epoch's last
    global batch) gets padding rows at its end, every label ignored.

    Resume: the stream is a function of (seed, epoch, global position) and the settings only.
    ``state_dict()`` names the epoch and the global batches delivered in it (the same on every
    rank), with the stream's settings; a TokenLoader of the same sources, ``seq_len``,
    ``mode``, ``window``, ``batch_size``, ``shuffle``, ``samples_per_epoch`` and ``drop_last``
    takes it with ``load_state_dict`` under any rank and world size, and goes on with the next
    global batch: save one rank's state, load it on every rank of the new job. A state of
    other settings raises a ConfigError naming ``state_dict``.

    Arguments:

    - ``sources``: a path; a list of paths (a blend of weight 1 each); or a dict of path ->
      weight, or a list of (path, weight) pairs: a weighted blend, each source exactly its
      weight's share of every epoch's samples (rows), in an even interleave. Weights are shares
      of the samples, not of the files: a source whose share is more than its rows goes round
      its own epochs (each a new shuffle); one with fewer reads part of one.
    - ``seq_len``: tokens per row.
    - ``batch_size``: rows of the global batch, all ranks together.
    - ``mode``: ``"concatenated"`` (the default) or ``"packed"``.
    - ``token_dtype``: the dtype of flat files of raw tokens (``"uint16"``, ``"uint32"``,
      ``"u16"``, ``numpy.uint16``...), needed for them only: a ``.npy`` header and a Megatron
      index name their own.
    - ``shuffle``: None or False for the files' order; a seed (an int) for a new order every
      epoch, the same for the same (seed, epoch); True means seed 0.
    - ``window``: documents per window (default 1024): the unit of the document shuffle, and of
      packing (more documents pack tighter). 8 bytes of memory per window.
    - ``samples_per_epoch``: rows in an epoch (default: every source's rows, summed).
    - ``shard``: None (rank 0 of 1: the whole global batch), ``(rank, world_size)``, or
      ``"env"`` (torchrun's ``RANK``/``WORLD_SIZE``, else Slurm's).
    - ``drop_last``: drop an epoch's last global batch if it is short (default False: it is
      shared as any other).
    - ``ignore_index``: the label where there is nothing to predict (default -100, PyTorch's).
    - ``mask_document_ends``: also ignore each document's last label (default: on for packed
      rows, off for concatenated ones, as Megatron's).
    - ``pad_id``: the input token of padding (default 0).
    - ``input_dtype``: ``input_ids``' dtype, one of int64 (the default), int32, uint32, uint16;
      ``label_dtype``, ``position_dtype``: int64 (the default) or int32.
    - ``workers``, ``prefetch``, ``batch_parts``, ``pool_budget``: as :class:`gpufeed.Loader`'s,
      ``"auto"`` included (chosen from a measurement on the first batches; ``stats()["tuning"]``
      says what and why).
    - ``epoch``: the first epoch (default 0).
    - ``output``: as :class:`gpufeed.Loader`'s (default torch if installed, else numpy).
    - ``trace``: a file name: record a timeline of the loader's work, as
      :class:`gpufeed.Loader`'s ``trace``.
    - ``read_mode``: how the token files are read, as :class:`gpufeed.Loader`'s: ``"mmap"``
      (the default) or ``"pread"``, with which a file truncated under the loader raises a
      DataError naming it instead of killing the process with SIGBUS.
    - ``device``: None or ``"cpu"``: batches in host memory. ``"cuda:N"`` (or N, or a
      ``torch.device``; ``"cuda"``: the local rank's GPU): batches on GPU N as CUDA tensors,
      ordered and kept alive as :class:`gpufeed.Loader`'s are. The workers write narrow
      integers into pinned buffers (``input_ids`` as uint16 when every source stores 16-bit
      tokens, ``labels`` as int32, ``position_ids`` as uint16 for rows of at most 65,536
      tokens) and the GPU widens them to the dtypes asked for after the copy: PCIe carries
      about half the bytes.

    Text, tokenized as it is read:

    - ``tokenizer``: a ``tokenizer.json`` (or a directory in the hub's layout holding one, its
      ``tokenizer_config.json`` naming the EOS): every source that is not token ids (a
      Megatron dataset, a ``.npy``, a ``.bin``) is then data the front door opens (Parquet,
      Arrow, JSON lines, shards; local or S3) whose ``text_field`` is tokenized in the
      loader's worker threads (one encoder each, one document per call), each document's ids
      as :class:`gpufeed.Tokenizer` gives them (the EOS appended; an empty document is the
      EOS alone). Such a source may be blended with token files. Its token count is not known
      ahead: ``samples_per_epoch`` is then the epoch's length if given, else an estimate from
      its first window (``stats()["tokens"]``); a source's share of each epoch is exact in
      rows, and its passes follow each other across epochs without a row lost or repeated.
      Rows are shuffled within blocks (a packed window's rows; ``window`` consecutive
      concatenated rows), not over the pass. The first batch needs only its windows; memory
      is bounded (the cache of tokenized windows, 256 MiB, in ``pool_budget`` when given);
      ``state_dict()`` resumes without tokenizing the pass up to its place, under any world
      size and number of workers. Every rank tokenizes the whole stream.
    - ``text_field``: the field of text (default ``"text"``).

    Every bad argument raises a :class:`gpufeed.ConfigError` naming it; a file that is missing,
    unreadable or corrupt (a Megatron index without its magic, a ``.bin`` shorter than its
    index says) raises a :class:`gpufeed.FileError` or :class:`gpufeed.DataError` naming it.
    """

    def __init__(
        self,
        sources: Sources,
        seq_len: int,
        batch_size: int,
        mode: str = "concatenated",
        token_dtype: Any = None,
        shuffle: Union[None, bool, int] = None,
        window: int = 1024,
        samples_per_epoch: Optional[int] = None,
        shard: Union[None, str, Tuple[int, int]] = None,
        drop_last: bool = False,
        ignore_index: int = -100,
        mask_document_ends: Optional[bool] = None,
        pad_id: int = 0,
        input_dtype: Any = "int64",
        label_dtype: Any = "int64",
        position_dtype: Any = "int64",
        workers: Union[None, int, str] = None,
        prefetch: Union[None, int, str] = None,
        batch_parts: Union[None, int, str] = None,
        pool_budget: Optional[int] = None,
        epoch: int = 0,
        output: Optional[str] = None,
        trace: Optional[PathLike] = None,
        device: Any = None,
        read_mode: Optional[str] = None,
        tokenizer: Optional[PathLike] = None,
        text_field: Optional[str] = None,
    ) -> None:
        pairs = _sources(sources)
        if text_field is not None and not isinstance(text_field, str):
            raise TypeError(f"text_field must be a str, not {type(text_field).__name__}")
        ordinal = _cuda_ordinal(device)
        seq_len = _int("seq_len", seq_len, 1)
        batch_size = _int("batch_size", batch_size, 1)
        if mode not in ("concatenated", "packed"):
            raise config_error("mode", f"{mode!r} is not 'concatenated' or 'packed'")
        pad_id = _int("pad_id", pad_id)
        if pad_id >= 1 << 32:
            raise config_error("pad_id", f"{pad_id} is not a token id (below 2**32)")
        shard_pair, shard_env = _shard(shard)
        if samples_per_epoch is not None:
            samples_per_epoch = _int("samples_per_epoch", samples_per_epoch, 1)
        self.output, convert = _converter(output, ordinal is not None)
        self._core = _gpufeed.token_core(
            pairs,
            seq_len=seq_len,
            batch_size=batch_size,
            mode=mode,
            token_dtype=None if token_dtype is None else _int_dtype("token_dtype", token_dtype),
            shuffle=_seed(shuffle),
            window=_int("window", window, 1),
            samples_per_epoch=samples_per_epoch,
            shard=shard_pair,
            shard_env=shard_env,
            drop_last=bool(drop_last),
            ignore_index=_signed("ignore_index", ignore_index),
            mask_document_ends=None if mask_document_ends is None else bool(mask_document_ends),
            pad_id=pad_id,
            input_dtype=_int_dtype("input_dtype", input_dtype),
            label_dtype=_int_dtype("label_dtype", label_dtype),
            position_dtype=_int_dtype("position_dtype", position_dtype),
            workers=None if workers is None else _setting("workers", workers),
            prefetch=None if prefetch is None else _setting("prefetch", prefetch),
            batch_parts=None if batch_parts is None else _setting("batch_parts", batch_parts),
            pool_budget=None if pool_budget is None else _int("pool_budget", pool_budget, 1),
            epoch=_int("epoch", epoch),
            convert=convert,
            trace=_trace_file(trace),
            device=ordinal,
            read_mode=_read_mode(read_mode),
            tokenizer=None if tokenizer is None else os.fsdecode(tokenizer),
            text_field=text_field,
        )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.mode = mode

    @property
    def samples_per_epoch(self) -> int:
        """Rows in an epoch (all ranks)."""
        return self._core.order[2]

    @property
    def rows_per_batch(self) -> int:
        """Rows of this rank's every batch: ``ceil(batch_size / world_size)``."""
        return -(-self.batch_size // self.world_size)

    def __repr__(self) -> str:
        try:
            rank, world, n, batch = self._core.order
            return (
                f"gpufeed.TokenLoader({n} rows of {self.seq_len} tokens, {self.mode}, "
                f"batch_size={batch}, rank {rank} of {world}, epoch {self.epoch}, "
                f"{self.position}/{len(self)} batches, output={self.output!r})"
            )
        except Exception:
            return "gpufeed.TokenLoader(closed)"
