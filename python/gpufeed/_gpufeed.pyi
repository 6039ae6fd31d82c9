"""Types of the extension module (gpufeed._gpufeed); use the public names of ``gpufeed``."""

import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

POLL_SECONDS: float
MASK_KEY: str
INDEX_KEY: str
HAS_CUDA: bool

class Array:
    """A dense, C-ordered array viewing gpufeed memory, exported through DLPack."""

    shape: Tuple[int, ...]
    dtype: str
    ndim: int
    nbytes: int
    device: str
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __len__(self) -> int: ...
    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> Any: ...

class Tokenizer:
    """A Hugging Face tokenizer.json (or hub directory) and the ids gpufeed makes of a document."""

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]"],
        *,
        eos_token: Optional[str] = None,
        bos_token: Optional[str] = None,
        append_eos: bool = True,
        prepend_bos: bool = False,
        add_special_tokens: bool = True,
        engine: Optional[str] = None,
    ) -> None: ...
    def encode(self, text: str) -> List[int]: ...
    eos_id: Optional[int]
    bos_id: Optional[int]
    eos_token: Optional[str]
    bos_token: Optional[str]
    vocab_size: int
    megatron_dtype: str
    engine: str
    path: str

class LoaderCore:
    def __init__(
        self,
        paths: Sequence[str],
        *,
        batch_size: int,
        shuffle: Optional[int],
        workers: Union[None, int, str],
        prefetch: Union[None, int, str],
        batch_parts: Union[None, int, str],
        drop_last: bool,
        shard: Optional[Tuple[int, int]],
        shard_env: bool,
        evaluation: bool,
        images: Optional[Dict[str, Any]],
        fields: Optional[List[str]],
        epoch: int,
        pool_budget: Optional[int],
        indices: bool,
        convert: Optional[Callable[[Array], Any]],
        device: Optional[int] = None,
        ragged_budget_each: Optional[int] = None,
        ragged_budgets: Optional[List[Tuple[str, int]]] = None,
        ragged_list: bool = False,
        trace: Optional[str] = None,
        read_mode: Optional[str] = None,
        verify: bool = False,
        split: Optional[str] = None,
        fill: Optional[List[Tuple[str, Union[int, float, str, bytes]]]] = None,
    ) -> None: ...
    def iter_epoch(self) -> "LoaderCore": ...
    def __iter__(self) -> "LoaderCore": ...
    def __next__(self) -> Dict[str, Any]: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Any) -> None: ...
    def stats(self) -> Dict[str, Any]: ...
    def write_trace(self, path: Optional[str] = None) -> str: ...
    epoch: int
    position: int
    order: Tuple[int, int, int, int]
    device: Optional[int]
    fields: List[Tuple[str, str, List[int], bool]]
    def close(self) -> None: ...

def token_core(
    sources: Sequence[Tuple[str, float]],
    *,
    seq_len: int,
    batch_size: int,
    mode: str,
    token_dtype: Optional[str],
    shuffle: Optional[int],
    window: int,
    samples_per_epoch: Optional[int],
    shard: Optional[Tuple[int, int]],
    shard_env: bool,
    drop_last: bool,
    ignore_index: int,
    mask_document_ends: Optional[bool],
    pad_id: int,
    input_dtype: str,
    label_dtype: str,
    position_dtype: str,
    workers: Optional[int],
    prefetch: Optional[int],
    batch_parts: Optional[int],
    pool_budget: Optional[int],
    epoch: int,
    convert: Optional[Callable[[Array], Any]],
    trace: Optional[str] = None,
    device: Optional[int] = None,
    read_mode: Optional[str] = None,
    tokenizer: Optional[str] = None,
    text_field: Optional[str] = None,
) -> LoaderCore: ...
def pack(
    inputs: Sequence[str],
    output: str,
    *,
    kind: str,
    labels: Optional[str] = None,
    record_bytes: Optional[int] = None,
    force: bool = False,
) -> Dict[str, Any]: ...
def inspect(path: str, *, verify: bool = False) -> Dict[str, Any]: ...
def _live() -> Tuple[int, int]: ...
def _device_memory() -> Tuple[int, int]: ...
