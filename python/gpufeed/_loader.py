"""``gpufeed.Loader`` and ``gpufeed.ImageOptions``: the arguments, checked and spelled out for
the extension module, which does the work; and what every gpufeed loader shares (iteration,
state, epochs, figures, closing: ``_Batches``, the base of ``Loader`` and ``TokenLoader``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

from . import _gpufeed
from ._errors import config_error, config_said

__all__ = ["Loader", "ImageOptions", "MASK_KEY", "INDEX_KEY"]

#: The key of the padding mask in an evaluation loader's batches.
MASK_KEY: str = _gpufeed.MASK_KEY
#: The key of the sample indices in the batches of a loader made with ``indices=True``.
INDEX_KEY: str = _gpufeed.INDEX_KEY

PathLike = Union[str, "os.PathLike[str]"]

_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

_DTYPES = {
    "uint8": "u8",
    "u8": "u8",
    "float16": "f16",
    "half": "f16",
    "f16": "f16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float32": "f32",
    "float": "f32",
    "f32": "f32",
}


def _dtype_name(dtype: Any, names: Mapping[str, str] = _DTYPES) -> Optional[str]:
    """gpufeed's name of a dtype given as a string, a numpy or a torch dtype, as ``names``
    spells them (by default the image dtypes); None for another."""
    name = getattr(dtype, "__name__", None) if isinstance(dtype, type) else None
    text = name if name is not None else str(dtype)
    text = text.replace("torch.", "").replace("numpy.", "").lower()
    return names.get(text)


def _is_int(x: Any) -> bool:
    """An int, or an integer scalar (numpy, torch), but not a bool."""
    return not isinstance(x, (bool, float)) and hasattr(x, "__index__")


def _int(argument: str, x: Any, low: int = 0) -> int:
    if not _is_int(x):
        raise TypeError(f"{argument} must be an integer, not {type(x).__name__}")
    value = int(x.__index__())
    if value < low:
        raise config_error(argument, f"{value} must be at least {low}")
    if value >= 1 << 64:
        raise config_error(argument, f"{value} does not fit in 64 bits")
    return value


def _setting(argument: str, x: Any) -> Union[int, str]:
    """A count of at least 1, or ``"auto"``: chosen by gpufeed."""
    if isinstance(x, str):
        if x == "auto":
            return x
        raise config_error(argument, f"{x!r} is neither a whole number nor 'auto'")
    return _int(argument, x, 1)


def _seed(shuffle: Union[None, bool, int]) -> Optional[int]:
    """``shuffle=``: None or False for the files' order, an int seed, True for seed 0."""
    if shuffle is None or shuffle is False:
        return None
    if shuffle is True:
        return 0
    return _int("shuffle", shuffle)


def _shard(shard: Union[None, str, Tuple[int, int]]) -> Tuple[Optional[Tuple[int, int]], bool]:
    """``shard=``: ((rank, world) or None, whether to read them from the environment)."""
    if isinstance(shard, str):
        if shard != "env":
            raise config_error("shard", f"{shard!r} is not 'env' or (rank, world_size)")
        return None, True
    if shard is None:
        return None, False
    try:
        rank, world = shard
    except (TypeError, ValueError):
        raise config_error("shard", f"{shard!r} is not 'env' or (rank, world_size)") from None
    return (_int("shard", rank), _int("shard", world, 1)), False


def _trace_file(trace: Optional[PathLike]) -> Optional[str]:
    """``trace=``: the file the timeline is written to, or None."""
    if trace is None:
        return None
    try:
        return os.fspath(trace)
    except TypeError:
        raise config_error("trace", f"{trace!r} is not a file name") from None


def _split(split: Optional[str]) -> Optional[str]:
    """``split=``: the split of a ``DatasetDict`` saved by ``datasets`` (``"train"``)."""
    if split is None:
        return None
    if not isinstance(split, str) or not split:
        raise config_error("split", f"{split!r} is not the name of a split, such as 'train'")
    return split


def _fill(fill: Optional[Mapping[str, Any]]) -> Optional[List[Tuple[str, Any]]]:
    """``fill=``: a value for the nulls of each field named (an int, a float, a str, bytes)."""
    if fill is None:
        return None
    if not isinstance(fill, Mapping):
        raise config_error("fill", f"{fill!r} is not a dict of field name -> value")
    out = []
    for name, value in fill.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str, bytes)):
            raise config_error(
                "fill",
                f"the value for {name!r} is {value!r}: give an int, a float, a str or bytes",
            )
        out.append((str(name), value))
    return out


def _read_mode(read_mode: Optional[str]) -> Optional[str]:
    """``read_mode=``: ``"mmap"``, ``"pread"``, or None (not given: a mapping)."""
    if read_mode is None:
        return None
    if not isinstance(read_mode, str) or read_mode.lower() not in ("mmap", "pread"):
        raise config_error("read_mode", f"{read_mode!r} is not 'mmap' or 'pread'")
    return read_mode.lower()


def _pair(argument: str, x: Any) -> Tuple[float, float]:
    try:
        lo, hi = x
        return float(lo), float(hi)
    except (TypeError, ValueError):
        raise config_error(argument, f"{x!r} is not a (low, high) pair of numbers") from None


@dataclasses.dataclass
class ImageOptions:
    """The image pipeline: decode JPEG/PNG, crop and resize as torchvision does, flip,
    convert and normalise, written straight into the batch. Pass it, or a dict of the same
    keys, as ``Loader(..., images=...)``.

    Batches then have two fields: ``image`` (``[N, 3, H, W]`` with ``layout="chw"``, or
    ``[N, H, W, 3]``) and, unless ``label_field`` is None, ``label`` (int64).

    - ``size``: output side, or (height, width) (default 224).
    - ``train``: True for ``RandomResizedCrop(size, scale, ratio)`` + ``RandomHorizontalFlip(flip)``;
      False for ``Resize(resize)`` + ``CenterCrop(size)``. None (default): ``not evaluation``.
    - ``scale``, ``ratio``, ``flip``: RandomResizedCrop's and the flip's (train only; defaults
      ``(0.08, 1.0)``, ``(3/4, 4/3)``, 0.5).
    - ``resize``: the shorter side before the centre crop (eval only; default ``size * 256 / 224``).
    - ``dtype``: ``"uint8"`` (pixels, the default), ``"float16"``, ``"bfloat16"`` or ``"float32"``
      (``v / 255``, then normalised); numpy and torch dtypes work too.
    - ``normalize`` (or ``normalise``): None, ``"imagenet"`` (or True), or ``(mean, std)`` of 3
      values each, on the ``[0, 1]`` scale (torchvision's ``Normalize``). Float dtypes only.
    - ``layout``: ``"chw"`` (PyTorch's, the default) or ``"hwc"``.
    - ``image_field``, ``label_field``: the data set's fields of encoded images (default
      ``"image"``) and integer labels (default ``"label"``; None for unlabelled data).
    - ``skip_bad_images``: instead of failing the batch, an image that cannot be decoded is
      zeroed, its label set to -1, and counted in ``stats()["images"]`` (default False).
    - ``max_pixels``: the most pixels an image may declare (default 89,478,485, PIL's
      ``Image.MAX_IMAGE_PIXELS``): a larger one is a bad image, refused before anything is
      allocated for it (a decompression bomb).

    Every random choice is a function of (seed, epoch, sample index) only.
    """

    size: Union[int, Tuple[int, int]] = 224
    train: Optional[bool] = None
    scale: Tuple[float, float] = (0.08, 1.0)
    ratio: Tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    flip: float = 0.5
    resize: Optional[int] = None
    dtype: Any = "uint8"
    normalize: Any = None
    layout: str = "chw"
    image_field: str = "image"
    label_field: Optional[str] = "label"
    skip_bad_images: bool = False
    #: Where JPEGs are decoded: ``"cpu"`` (the workers), ``"gpu"`` (nvJPEG on the loader's
    #: ``device``, with the crop, resize and normalisation there) or ``"auto"``.
    decode: str = "cpu"
    max_pixels: Optional[int] = None
    normalise: dataclasses.InitVar[Any] = None

    def __post_init__(self, normalise: Any) -> None:
        if normalise is not None:
            if self.normalize is not None:
                raise config_error("images['normalise']", "give normalize or normalise, not both")
            self.normalize = normalise

    @classmethod
    def of(cls, images: Union["ImageOptions", Mapping[str, Any]]) -> "ImageOptions":
        """``images`` as ImageOptions: a copy of one, or one made from a dict of its keys."""
        if isinstance(images, ImageOptions):
            return dataclasses.replace(images)
        if not isinstance(images, Mapping):
            raise TypeError(
                f"images must be a dict or gpufeed.ImageOptions, not {type(images).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)} | {"normalise"}
        given = dict(images)
        unknown = sorted(set(given) - names)
        if unknown:
            raise config_error(
                f"images[{unknown[0]!r}]",
                f"not an image option (the options are {', '.join(sorted(names))})",
            )
        return cls(**given)

    def _spelled(self, evaluation: bool) -> Dict[str, Any]:
        """The options as the extension module reads them."""
        if isinstance(self.size, (tuple, list)):
            if len(self.size) != 2:
                raise config_error("images['size']", f"{self.size!r} is not a side or (height, width)")
            size = (_int("images['size']", self.size[0], 1), _int("images['size']", self.size[1], 1))
        else:
            side = _int("images['size']", self.size, 1)
            size = (side, side)
        if size[0] >= 1 << 32 or size[1] >= 1 << 32:
            raise config_error("images['size']", f"{size} is too large")
        dtype = _dtype_name(self.dtype)
        if dtype is None:
            raise config_error(
                "images['dtype']",
                f"{self.dtype!r} is not one of uint8, float16, bfloat16, float32",
            )
        normalize = self.normalize
        if normalize is True or (isinstance(normalize, str) and normalize.lower() == "imagenet"):
            normalize = _IMAGENET
        elif normalize is False:
            normalize = None
        if isinstance(normalize, Mapping):
            normalize = (normalize.get("mean"), normalize.get("std"))
        if normalize is not None:
            try:
                mean, std = normalize
                mean = tuple(float(v) for v in mean)
                std = tuple(float(v) for v in std)
                if len(mean) != 3 or len(std) != 3:
                    raise ValueError
            except (TypeError, ValueError):
                raise config_error(
                    "images['normalize']",
                    f"{self.normalize!r} is not 'imagenet' or (mean, std) of 3 values each",
                ) from None
            normalize = (mean, std)
        layout = str(self.layout).lower()
        if layout not in ("chw", "hwc"):
            raise config_error("images['layout']", f"{self.layout!r} is not 'chw' or 'hwc'")
        if not isinstance(self.image_field, str):
            raise TypeError("images['image_field'] must be a string")
        if self.label_field is not None and not isinstance(self.label_field, str):
            raise TypeError("images['label_field'] must be a string or None")
        max_pixels = self.max_pixels
        if max_pixels is not None:
            max_pixels = _int("images['max_pixels']", max_pixels, 1)
        return {
            "size": size,
            "train": (not evaluation) if self.train is None else bool(self.train),
            "scale": _pair("images['scale']", self.scale),
            "ratio": _pair("images['ratio']", self.ratio),
            "flip": float(self.flip),
            "resize": None if self.resize is None else _int("images['resize']", self.resize, 1),
            "dtype": dtype,
            "normalize": normalize,
            "layout": layout,
            "image_field": self.image_field,
            "label_field": self.label_field,
            "skip_bad_images": bool(self.skip_bad_images),
            "decode": _decode("images['decode']", self.decode),
            "max_pixels": max_pixels,
        }


def _decode(argument: str, value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in ("cpu", "gpu", "auto"):
        raise config_error(argument, f"{value!r} is not 'cpu', 'gpu' or 'auto'")
    return value.lower()


def _local_rank() -> int:
    """This process's GPU under a launcher: ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID``,
    else 0 (the rule of the library's ``Device::from_env``)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value.strip())
            except ValueError:
                raise config_error(
                    "device", f"environment variable {name}={value!r} is not a device ordinal"
                ) from None
    return 0


def _device_ordinal(device: Any) -> Optional[int]:
    """The GPU ordinal that ``device`` names, or None for host batches: None or ``"cpu"``;
    ``"cuda"`` (this process's local rank), ``"cuda:N"``, an int N, or a ``torch.device``."""
    if device is None:
        return None
    if _is_int(device):
        return _int("device", device)
    text = str(device).strip().lower()
    if text == "cpu":
        return None
    if text == "cuda":
        return _local_rank()
    if text.startswith("cuda:"):
        number = text[len("cuda:") :]
        if number.isdigit():
            return int(number)
    raise config_error(
        "device", f"{device!r} is not None, 'cpu', 'cuda' (the local rank's GPU) or 'cuda:N'"
    )


def _cuda_ordinal(device: Any) -> Optional[int]:
    """``device=`` as a GPU ordinal (None: host batches), refused if this build has no CUDA."""
    ordinal = _device_ordinal(device)
    if ordinal is not None and not _gpufeed.HAS_CUDA:
        raise config_error(
            "device",
            f"{device!r}: this gpufeed was built without its cuda feature: reinstall with "
            "`pip install ./python` (cuda is a default feature)",
        )
    return ordinal


def _jax_from_dlpack(array: Any) -> Any:
    import jax.numpy as jnp

    return jnp.from_dlpack(array)


def _converter(
    output: Optional[str], on_device: bool = False
) -> Tuple[str, Optional[Callable[[Any], Any]]]:
    """The output kind and the callable that turns a gpufeed.Array into it."""
    if output is None:
        if importlib.util.find_spec("torch") is not None:
            output = "torch"
        elif on_device and importlib.util.find_spec("cupy") is not None:
            output = "cupy"
        elif on_device:
            output = "dlpack"
        elif importlib.util.find_spec("numpy") is not None:
            output = "numpy"
        else:
            raise config_said(
                "output",
                "output= was not given, and neither torch nor numpy is installed to give the "
                "batches as their arrays: install one, or pass output='dlpack' for "
                "gpufeed.Array objects (any DLPack consumer takes them)",
            )
    if on_device and output == "numpy":
        raise config_error(
            "output",
            "numpy cannot hold GPU memory: with device='cuda...' use output='torch', 'cupy', "
            "'jax' or 'dlpack'",
        )
    if output == "cupy":
        try:
            import cupy
        except ImportError as e:
            raise config_error("output", f"output='cupy' needs cupy: {e}") from None
        return output, cupy.from_dlpack
    if output == "jax":
        try:
            import jax.numpy  # noqa: F401
        except ImportError as e:
            raise config_error("output", f"output='jax' needs jax: {e}") from None
        return output, _jax_from_dlpack
    if output == "torch":
        try:
            import torch
        except ImportError as e:
            raise config_error("output", f"output='torch' needs torch: {e}") from None
        return output, torch.from_dlpack
    if output == "numpy":
        try:
            import numpy
        except ImportError as e:
            raise config_error("output", f"output='numpy' needs numpy: {e}") from None
        return output, numpy.from_dlpack
    if output == "dlpack":
        return output, None
    raise config_error(
        "output", f"{output!r} is not one of 'torch', 'numpy', 'cupy', 'jax', 'dlpack'"
    )


def _paths(path_or_paths: Any) -> List[str]:
    if isinstance(path_or_paths, (str, bytes, os.PathLike)):
        return [os.fsdecode(path_or_paths)]
    try:
        paths = [os.fsdecode(p) for p in path_or_paths]
    except TypeError:
        raise TypeError(
            "path_or_paths must be a path or a list of paths, "
            f"not {type(path_or_paths).__name__}"
        ) from None
    if not paths:
        raise config_error("path_or_paths", "the list of files is empty")
    return paths


_B = TypeVar("_B", bound="_Batches")


class _Batches:
    """What every gpufeed loader shares: iteration, epochs, state, figures, closing. Its
    subclasses (``Loader``, ``TokenLoader``) check their arguments and make ``self._core``,
    the extension module's ``LoaderCore``, which does the work."""

    _core: Any

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        """The batches of the epoch (see the class docs for which epoch)."""
        return self._core.iter_epoch()

    def __len__(self) -> int:
        """Batches per epoch for this rank (for a TokenLoader, the global batches: each rank
        gets its share of every one)."""
        return len(self._core)

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` from its first batch (PyTorch's ``DistributedSampler.set_epoch``).

        Right after ``load_state_dict`` (or a fresh loader made with that epoch), asking for
        the loader's own epoch keeps the position: the rest of that epoch comes next. Once an
        epoch has been delivered to its end, gpufeed is already making the next epoch's first
        batches; asking for that epoch keeps them.
        """
        self._core.set_epoch(_int("epoch", epoch))

    def state_dict(self) -> Dict[str, Any]:
        """Where the loader stands: the epoch, the batches delivered in it, and the settings
        that decide the order; plain Python values (torchdata's ``StatefulDataLoader`` and
        ``torch.distributed.checkpoint`` protocol). Take it after the step that used the last
        batch: batches you still hold count as delivered."""
        return self._core.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Puts the loader where ``state_dict`` says: the next batches are the rest of that
        epoch, then the following epochs. Raises a ConfigError naming ``state_dict`` if it was
        saved with other order settings (see the class docs)."""
        self._core.load_state_dict(state_dict)

    def stats(self) -> Dict[str, Any]:
        """Figures so far: batches, samples and bytes delivered, time waited for data
        (``wait_fraction``), worker time per stage, the pool's bytes (``pool``: host buffers,
        pinned on the GPU path), and ``text``, a printable table.

        With the image pipeline, ``images``: ``skipped`` (bad images in the batches delivered
        to you), ``decoded`` and ``last_skipped`` (the message of the last image the workers
        skipped) of what the workers did, batches made ahead of you included.

        A sharded data set's ``shards``: ``count`` (shards in the data set), ``opens`` (shards
        opened, each first use and each reopening after an eviction), ``evictions``,
        ``open_now`` and ``open_limit`` (the most kept open at once); None for other data sets.
        From a URL, ``store``, what the store fetched and cached, as ``gpufeed bench``'s
        ``store:`` line says it (which ``text`` ends with then): ``bytes_fetched``,
        ``requests``, ``retries``, ``cache_hits``, ``cache_misses``, ``shared_downloads``,
        ``cache_evictions``, ``cache_full``, ``checksum_failures``, ``unverified`` (shards
        checked by their size only), ``prefetched``, ``waited_s`` (readers' time waiting for
        bytes); None for local files.

        On the GPU also ``device``: ``ordinal``,
        ``name``, the copy stage (``h2d_bytes``, ``h2d_copies``, ``h2d_busy_s``,
        ``h2d_bytes_per_s``), the device pool (``pool``), ``leaked_buffers`` (buffers whose
        release the driver could not fence: never reused; 0 unless the driver failed) and
        ``reserved_bytes_all_pools`` (GPU memory all of gpufeed's device pools hold). A
        TokenLoader's also ``tokens``: ``batches``, ``rows`` (padding rows included),
        ``tokens`` (of documents), ``padding`` (tokens), ``padding_fraction``,
        ``rows_per_source`` and ``shares`` (each source's share of the rows from sources)."""
        return self._core.stats()

    @property
    def epoch(self) -> int:
        """The epoch being delivered."""
        return self._core.epoch

    @property
    def position(self) -> int:
        """Batches delivered in this epoch."""
        return self._core.position

    @property
    def rank(self) -> int:
        """This loader's rank."""
        return self._core.order[0]

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._core.order[1]

    def write_trace(self, path: Optional[PathLike] = None) -> str:
        """Writes the timeline recorded so far (``trace=``) to ``path``, or to the file
        ``trace=`` named, as Chrome trace-event JSON; returns the file's name."""
        return os.fspath(self._core.write_trace(None if path is None else os.fspath(path)))

    def close(self) -> None:
        """Stops the worker threads now. Batches you hold stay valid; later calls raise.

        Closing (or dropping the last reference) waits, with the GIL released, for each worker
        to stop; one stuck in a read that does not return (a named pipe, a hung network file
        system) is left running after 2 seconds, with a RuntimeWarning, and ends when its read
        returns."""
        self._core.close()

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a gpufeed.{type(self).__name__} cannot be pickled (it owns worker threads and a "
            "memory mapping): make it in the process that uses it; with torch's DataLoader, "
            "use num_workers=0"
        )


class Loader(_Batches):
    """Batches of a data set, made by worker threads that share one memory-mapped copy of it,
    in PyTorch's vocabulary. Replaces ``torch.utils.data.DataLoader`` for the files gpufeed
    reads: packed record files (``gpufeed.pack``), ``.npy`` arrays, several files of one schema
    (shards), ImageFolder directories (with ``images=``).

    Iterating yields the batches of one epoch, each a dict of field name -> tensor (a view of
    gpufeed's batch buffer, no copy). A new ``for`` loop goes on where the last one stopped;
    once an epoch has been delivered to its end, the next loop is the next epoch, unless
    ``set_epoch`` or ``load_state_dict`` said which. So both usual loops work::

        for epoch in range(start, epochs):
            loader.set_epoch(epoch)        # optional; keeps the position right after a resume
            for batch in loader:
                step(batch["image"], batch["label"])

    Resume: ``state_dict()`` names the epoch and the batches delivered in it; a loader of the
    same order settings (data set length, batch size, seed, shard, drop_last, evaluation) takes
    it with ``load_state_dict``, and goes on with the next batch.

    Arguments:

    - ``path_or_paths``: a file, a directory of images, or a list of files with one schema.
    - ``batch_size``: samples per batch (default 1).
    - ``shuffle``: None or False for the files' order; a seed (an int) for a new order every
      epoch, the same for the same (seed, epoch); True means seed 0.
    - ``workers``: worker threads (default: the CPUs, at most 16; two fewer on a GPU, for the copy
      thread and your loop). ``prefetch``: batches in
      flight (default: the workers + 2, more for small batches; for batches made in parts,
      2 + twice the workers / the parts).
    - ``batch_parts``: make each batch in this many parts, written by as many workers at once
      (default: one per worker for batches of 4 MiB or more, else 1). Fewer batches in flight,
      a smaller pool, a sooner first batch; the batches are the same.
    - ``workers="auto"`` (and ``prefetch="auto"``, ``batch_parts="auto"``): gpufeed chooses,
      from a short measurement on the first batches (a few seconds at most), the fewest workers
      within 3% of the fastest it measured and of what your loop takes, within the CPUs this
      process may use; prefetch and parts follow the rule above for the workers chosen.
      ``stats()["tuning"]`` says what it chose and why.
    - ``trace``: a file name: record a timeline of the loader's work (a track per worker, your
      loop's waits, the copy thread and copy stream on a GPU), written as Chrome trace-event
      JSON by ``close()`` (or the end of a ``with`` block, or when the loader is dropped) and by
      ``write_trace()``; open it in https://ui.perfetto.dev.
    - ``drop_last``: drop the samples that do not fill a rank's share or a whole batch (default
      False: the last batch is short and ranks' shares are padded by wrapping around).
    - ``shard``: None (the whole data set, also under torchrun), ``(rank, world_size)``, or
      ``"env"`` (torchrun's ``RANK``/``WORLD_SIZE``, else Slurm's).
    - ``evaluation``: every sample exactly once across ranks, every rank the same number of
      batches; padding slots are marked in each batch's ``"__mask__"`` (bool, True for real
      samples, always the last slots). Not with ``drop_last``.
    - ``device``: None or ``"cpu"``: batches in host memory, as CPU tensors. ``"cuda:N"`` (or
      N, or a ``torch.device``): batches on GPU N, as CUDA tensors; ``"cuda"``: this process's
      local rank's GPU (``LOCAL_RANK``, else ``SLURM_LOCALID``, else 0). See "The GPU" below.
    - ``images``: decode images with the image pipeline (:class:`ImageOptions` or a dict).
    - ``fields``: the fields to load (default all; a field of encoded images needs ``images=``
      unless named here, when it arrives as its bytes).
    - ``ragged``: how a variable-size field (text, tokens, any bytes; see "Ragged fields"
      below) arrives: ``"offsets"`` (default) as a pair ``(values, offsets)``, or ``"list"``
      as a list of one tensor per sample.
    - ``ragged_budget``: bytes of values a batch may hold in each ragged field: an int for
      every one, or a dict of field name -> bytes (default: measured from the first samples,
      twice the mean batch or more).
    - ``epoch``: the first epoch (default 0).
    - ``output``: ``"torch"`` (torch.Tensor), ``"numpy"`` (numpy.ndarray), ``"cupy"``,
      ``"jax"`` or ``"dlpack"`` (:class:`gpufeed.Array`, for any DLPack consumer); default
      torch if installed, else numpy (on the GPU: else cupy, else dlpack). Every one views the
      batch buffer; numpy before 2.1 makes its views read-only; numpy cannot hold GPU memory.
    - ``indices``: also give each batch's sample indices (int64) under ``"__index__"``.
    - ``pool_budget``: bytes of batch buffers, in flight and held by you together (default:
      ``prefetch + 2`` batches).
    - ``read_mode``: how a packed file or a ``.npy`` array is read: ``"mmap"`` (the default,
      the fastest: one shared memory mapping) or ``"pread"`` (reads at offsets). A file
      truncated while a mapping reads it kills the process with SIGBUS; with ``"pread"`` it
      raises a :class:`gpufeed.DataError` naming the file (``kind`` ``"file_changed"``). Use
      it on network file systems and for files a job may rewrite. Image folders (read whole)
      and sharded data sets (mapped by their store) refuse it.
    - ``verify``: check every record read against its checksum (packed files; a ``.npy``
      array takes its own at open, one pass over it): a record whose bytes changed or were
      corrupted raises a DataError naming the file and record, never data. Costs one hash pass
      per record.
    - ``split``: for a directory that ``datasets``' ``DatasetDict.save_to_disk`` wrote, the
      split to read (``"train"``, ``"test"``, ...).
    - ``fill``: tables (Parquet, Arrow, JSON lines): a value for the nulls (and, in JSON lines,
      missing keys) of each field named, ``{"label": -1, "caption": ""}``; a null in a field
      without one raises a DataError naming the file, the row and the column.

    Ragged fields: a field whose samples differ in size (a WebDataset ``txt`` or ``cls``
    member, an MDS ``bytes``/``str`` column, a packed file's bytes field) is batched as the
    items of its samples back to back, ``values`` (uint8 for bytes; the dtype of the values for
    a field of typed values, such as tokens), and ``offsets``, int64 ``[batch + 1]``: sample
    ``i`` is ``values[offsets[i]:offsets[i + 1]]``, the layout of ``torch.nested``'s jagged
    tensors (``torch.nested.nested_tensor_from_jagged(values, offsets)``) and of
    flash-attention's ``cu_seqlens``. Both are views of the batch buffer, as every field is;
    with ``ragged="list"`` each sample's tensor is a view too. A batch whose values exceed
    ``ragged_budget`` raises a ConfigError naming the field, the batch and ``ragged_budget``
    (never a truncated batch); the next iteration goes on. On the GPU, the batch is copied only
    as far as its values go.

    Memory: a batch's buffer is reused only when every tensor of the batch is gone. Holding
    more batches than the pool's budget allows makes the next iteration raise a ConfigError
    naming ``pool_budget`` (no batch is lost: drop some and iterate again); keep copies
    (``tensor.clone()``) of what you keep across steps.

    Errors are :class:`gpufeed.Error` subclasses with gpufeed's message. A batch with a bad
    sample raises when its turn comes, and the next iteration yields the next batch. Ctrl-C
    while waiting for a batch raises KeyboardInterrupt within a few tens of milliseconds; the
    loader can still be used. A batch counts as delivered (``position``, ``state_dict``) once
    the iteration has returned it: an interrupt (or any exception) while it is converted
    (``torch.from_dlpack``), or a Ctrl-C that came while it was waited for, leaves it to the
    next iteration, whatever the loop's form (``for``, ``next(it)``, ``it.__next__()``).

    Threads: the loader may be used from several Python threads (the GIL is released while it
    waits), but it cannot cross a ``fork``: make it in the process that iterates it.

    The GPU (``device="cuda:N"``): the workers fill pinned host buffers, a copy thread copies
    each batch to the GPU ahead of you (``cuMemcpyHtoDAsync`` on a copy stream of gpufeed's)
    and, with the image pipeline to a float dtype, converts it there (the workers stop at uint8
    CHW, half the bytes of float16; the GPU scales, normalises and rounds). Each field is a
    CUDA tensor in the device's primary context (PyTorch's). No call synchronises the host:

    - Ordering: when a tensor is made (``torch.from_dlpack`` inside the iteration, so on the
      stream current there), that stream waits for gpufeed's copy on the device
      (``cuStreamWaitEvent``). Iterate under the stream you compute on
      (``with torch.cuda.stream(s): for batch in loader: ...``), or export again with
      ``output="dlpack"`` and ``torch.from_dlpack`` on another stream.
    - Reuse: a batch's GPU memory goes back to gpufeed's pool only when the last tensor of the
      batch is gone, and only once every stream it was exported to has passed the point where
      that happened (PyTorch's ``record_stream`` rule): work you queued on those streams reads
      the right bytes even if the host has moved on. Work on a stream the batch was never
      exported to is not covered: order that stream after the exporting one first. A stream a
      batch was exported to must live until the batch is gone (PyTorch's streams always do).
    - ``evaluation`` and ``indices``: ``"__mask__"`` (bool) and ``"__index__"`` (int64) are GPU
      tensors too, copied with the batch.
    - ``stats()["device"]``: the copy stage (bytes, copies, copy-engine time) and the device
      pool; memory returns to the GPU when the loader and its last batch are gone.
    """

    def __init__(
        self,
        path_or_paths: Union[PathLike, Sequence[PathLike]],
        batch_size: int = 1,
        shuffle: Union[None, bool, int] = None,
        workers: Union[None, int, str] = None,
        prefetch: Union[None, int, str] = None,
        batch_parts: Union[None, int, str] = None,
        drop_last: bool = False,
        shard: Union[None, str, Tuple[int, int]] = None,
        evaluation: bool = False,
        device: Any = None,
        images: Union[None, ImageOptions, Mapping[str, Any]] = None,
        fields: Optional[Sequence[str]] = None,
        epoch: int = 0,
        output: Optional[str] = None,
        indices: bool = False,
        pool_budget: Optional[int] = None,
        ragged: str = "offsets",
        ragged_budget: Union[None, int, Mapping[str, int]] = None,
        decode: Optional[str] = None,
        trace: Optional[PathLike] = None,
        read_mode: Optional[str] = None,
        verify: bool = False,
        split: Optional[str] = None,
        fill: Optional[Mapping[str, Union[int, float, str, bytes]]] = None,
    ) -> None:
        paths = _paths(path_or_paths)
        output_given = output is not None
        batch_size = _int("batch_size", batch_size, 1)
        seed = _seed(shuffle)
        workers = None if workers is None else _setting("workers", workers)
        prefetch = None if prefetch is None else _setting("prefetch", prefetch)
        batch_parts = None if batch_parts is None else _setting("batch_parts", batch_parts)
        trace_file = _trace_file(trace)
        shard_pair, shard_env = _shard(shard)
        ordinal = _cuda_ordinal(device)
        spelled_images = None
        if decode is not None and images is None:
            raise config_error(
                "decode", "decode= is where the image pipeline decodes: give images= too"
            )
        if images is not None:
            if fields is not None:
                raise config_error(
                    "fields", "the image pipeline decides the fields (image, label): drop fields="
                )
            options = ImageOptions.of(images)
            if decode is not None:
                options = dataclasses.replace(options, decode=_decode("decode", decode))
            spelled_images = options._spelled(bool(evaluation))
        if fields is not None:
            if isinstance(fields, str):
                fields = [fields]
            fields = [str(f) for f in fields]
            if not fields:
                raise config_error("fields", "the list of fields is empty")
        epoch = _int("epoch", epoch)
        pool_budget = None if pool_budget is None else _int("pool_budget", pool_budget, 1)
        if ragged not in ("offsets", "list"):
            raise config_error("ragged", f"{ragged!r} is not 'offsets' or 'list'")
        budget_each, budgets = None, None
        if isinstance(ragged_budget, Mapping):
            budgets = [
                (str(name), _int(f"ragged_budget[{name!r}]", b, 1))
                for name, b in ragged_budget.items()
            ]
        elif ragged_budget is not None:
            budget_each = _int("ragged_budget", ragged_budget, 1)
        self.output, convert = _converter(output, ordinal is not None)
        self._core = _gpufeed.LoaderCore(
            paths,
            batch_size=batch_size,
            shuffle=seed,
            workers=workers,
            prefetch=prefetch,
            batch_parts=batch_parts,
            drop_last=bool(drop_last),
            shard=shard_pair,
            shard_env=shard_env,
            evaluation=bool(evaluation),
            images=spelled_images,
            fields=fields,
            epoch=epoch,
            pool_budget=pool_budget,
            indices=bool(indices),
            convert=convert,
            device=ordinal,
            ragged_budget_each=budget_each,
            ragged_budgets=budgets,
            ragged_list=ragged == "list",
            trace=trace_file,
            read_mode=_read_mode(read_mode),
            verify=bool(verify),
            split=_split(split),
            fill=_fill(fill),
        )
        if self.output == "numpy":
            bf16 = [name for name, dtype, _, _ in self._core.fields if dtype == "bfloat16"]
            if bf16:
                self._core.close()
                if output_given:
                    raise config_error(
                        "output",
                        f"numpy has no bfloat16 (field {bf16[0]!r}): use output='torch', or a "
                        "float16/float32 image dtype",
                    )
                raise config_said(
                    "output",
                    f"the batches would be numpy arrays (output= was not given, and torch is "
                    f"not installed), and numpy has no bfloat16 (field {bf16[0]!r}): install "
                    "torch, pass output='dlpack', or choose a float16/float32 image dtype",
                )
        self.batch_size = batch_size
        self.evaluation = bool(evaluation)

    @property
    def num_samples(self) -> int:
        """Samples in the data set (all ranks)."""
        return self._core.order[2]

    @property
    def device(self) -> str:
        """Where the batches are: ``"cpu"`` or ``"cuda:N"``."""
        ordinal = self._core.device
        return "cpu" if ordinal is None else f"cuda:{ordinal}"

    @property
    def fields(self) -> Dict[str, Tuple[str, Tuple[Optional[int], ...]]]:
        """Each field's dtype name and per-sample shape (on the GPU: as converted there); a
        ragged field's shape starts with None, its samples' varying number of items."""
        return {
            name: (dtype, ((None,) if ragged else ()) + tuple(shape))
            for name, dtype, shape, ragged in self._core.fields
        }

    def __repr__(self) -> str:
        try:
            rank, world, n, batch = self._core.order
            return (
                f"gpufeed.Loader({n} samples, batch_size={batch}, rank {rank} of {world}, "
                f"epoch {self.epoch}, {self.position}/{len(self)} batches, output={self.output!r}, "
                f"device={self.device!r})"
            )
        except Exception:
            return "gpufeed.Loader(closed)"
