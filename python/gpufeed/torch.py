"""gpufeed for code that expects a ``torch.utils.data`` dataset.

:class:`IterableDataset` wraps a :class:`gpufeed.Loader` (it yields the loader's batches,
already collated) so that it plugs into ``torch.utils.data.DataLoader(ds, batch_size=None)``,
or torchdata's ``StatefulDataLoader``::

    from torch.utils.data import DataLoader
    import gpufeed.torch

    ds = gpufeed.torch.IterableDataset("train.gfd", batch_size=256, shuffle=0, workers=8)
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        for batch in DataLoader(ds, batch_size=None):     # num_workers=0, the default
            ...

``num_workers`` must stay 0: the loader already runs its own worker threads over one shared
mapping, which is what gpufeed is for; worker processes would each need a loader of their own
(and read the data set once each). With ``num_workers > 0`` iteration raises a RuntimeError
(with the ``fork`` start method, in the worker) or pickling the dataset raises a TypeError
(``spawn``, ``forkserver``). ``pin_memory=True`` is allowed but copies every batch: leave it off.

The dataset is stateful (``state_dict`` / ``load_state_dict``, the loader's), which is what
``StatefulDataLoader`` looks for.

With ``device="cuda:N"`` (or ``"cuda"``) the batches are CUDA tensors, made on the stream
current where the ``DataLoader`` is iterated; torch's ``DataLoader(ds, batch_size=None)``
passes them through unchanged (leave ``pin_memory`` off: only CPU tensors can be pinned).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, Union

import torch.utils.data

from ._loader import Loader

__all__ = ["IterableDataset"]


class IterableDataset(torch.utils.data.IterableDataset):
    """A torch ``IterableDataset`` over a :class:`gpufeed.Loader`: each item is one batch (a
    dict of field name -> ``torch.Tensor``), so use it with ``DataLoader(ds, batch_size=None)``.

    ``IterableDataset(loader)`` wraps a loader; ``IterableDataset(path, **kwargs)`` makes one
    with ``gpufeed.Loader(path, output="torch", **kwargs)``, every argument of the loader
    included (``read_mode="pread"`` for files that may be truncated under the job,
    ``verify=True``). See the module docs on ``num_workers``.
    """

    def __init__(self, path_or_loader: Union[Loader, Any], **loader_kwargs: Any) -> None:
        super().__init__()
        if isinstance(path_or_loader, Loader):
            if loader_kwargs:
                raise TypeError(
                    "IterableDataset(loader) takes no loader arguments: they are the loader's"
                )
            self.loader = path_or_loader
        else:
            loader_kwargs.setdefault("output", "torch")
            self.loader = Loader(path_or_loader, **loader_kwargs)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "gpufeed.torch.IterableDataset cannot run in a DataLoader worker process: "
                "gpufeed has its own worker threads; use DataLoader(ds, batch_size=None) "
                "with num_workers=0"
            )
        return iter(self.loader)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch``."""
        self.loader.set_epoch(epoch)

    def state_dict(self) -> Dict[str, Any]:
        """The loader's ``state_dict``."""
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """The loader's ``load_state_dict``."""
        self.loader.load_state_dict(state_dict)

    def __reduce__(self) -> Any:
        raise TypeError(
            "gpufeed.torch.IterableDataset cannot be pickled into DataLoader worker processes: "
            "gpufeed has its own worker threads; use num_workers=0"
        )
