"""gpufeed's exceptions.

Every error gpufeed raises is a :class:`gpufeed.Error` with gpufeed's message (which names the
file, record, sample or argument at fault) and a ``kind``; its subclasses also derive from the
Python exception a caller would expect:

======================  ==========================  ==============================================
class                   also a                      raised for (``kind``)
======================  ==========================  ==============================================
``ConfigError``         ``ValueError``              a bad argument (``invalid_config``); ``argument``
                                                    names it as you typed it (``images['size']``)
``DataError``           ``ValueError``              data that is not what it should be: a malformed
                                                    or truncated file, a bad record, a checksum, an
                                                    image that cannot be decoded, inputs that
                                                    disagree, a file that changed while in use
                                                    (``malformed``, ``unsupported_version``,
                                                    ``bad_record``, ``checksum``, ``unsupported_npy``,
                                                    ``unsupported_table``, ``image``, ``mismatch``,
                                                    ``out_of_range``, ``file_changed``)
``FileError``           ``OSError``                 the operating system refused (``io``); ``errno``,
                                                    ``filename``
``FileNotFound``        ``FileNotFoundError``       the same, for a file that does not exist
``FileExists``          ``FileExistsError``         the same, for a file that a call would replace
                                                    (``pack`` without ``force=True``)
``GpuError``            ``RuntimeError``            no usable GPU, or a CUDA call failed
                                                    (``no_gpu``, ``cuda``)
``InternalError``       ``RuntimeError``            a bug in gpufeed (``internal``): please report it
``Error``                                           anything else (``user``, ``shutdown``, ``other``)
======================  ==========================  ==============================================

An error in one sample of a batch is of its cause's class, with ``sample`` (the index in the
data set) and ``batch`` (the batch's number in the epoch) set; the loader stays usable and the
next iteration yields the next batch.
"""

from __future__ import annotations

import errno as _errno
from typing import Any, Optional

__all__ = [
    "Error",
    "ConfigError",
    "DataError",
    "FileError",
    "FileNotFound",
    "FileExists",
    "GpuError",
    "InternalError",
]


class Error(Exception):
    """A gpufeed error: ``str(e)`` is gpufeed's message, ``e.kind`` what went wrong.

    Attributes (None when they do not apply): ``kind``, ``path`` (the file concerned),
    ``record`` (a record of that file), ``sample`` and ``batch`` (the sample that failed and
    its batch in the epoch), ``argument`` (the argument at fault).
    """

    kind: str
    path: Optional[str]
    record: Optional[int]
    sample: Optional[int]
    batch: Optional[int]
    argument: Optional[str]

    def __init__(self, message: str, kind: str = "other", **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.path = details.get("path")
        self.record = details.get("record")
        self.sample = details.get("sample")
        self.batch = details.get("batch")
        self.argument = details.get("argument")

    def __str__(self) -> str:
        return self.message


class ConfigError(Error, ValueError):
    """A bad argument; ``argument`` names it as typed in Python."""


class DataError(Error, ValueError):
    """Data that is not what it should be (a malformed file, a bad record or image)."""


class FileError(Error, OSError):
    """The operating system refused an operation on a file; ``errno`` and ``filename`` say
    which error and which file, as for any ``OSError``."""

    def __init__(self, message: str, kind: str = "io", **details: Any) -> None:
        Error.__init__(self, message, kind, **details)
        self.errno = details.get("errno")
        self.strerror = message
        self.filename = details.get("path")
        self.op = details.get("op")

    def __str__(self) -> str:
        return self.message


class FileNotFound(FileError, FileNotFoundError):
    """A file or directory that does not exist."""


class FileExists(FileError, FileExistsError):
    """A file that exists and that a call would replace (``gpufeed.pack`` without
    ``force=True``); ``filename`` is the file, ``argument`` the argument that names it."""


class GpuError(Error, RuntimeError):
    """No usable GPU, or a CUDA call failed."""


class InternalError(Error, RuntimeError):
    """A bug in gpufeed, caught before it could crash the interpreter: please report it."""


_DATA_KINDS = {
    "malformed",
    "unsupported_version",
    "bad_record",
    "checksum",
    "unsupported_npy",
    "unsupported_table",
    "image",
    "mismatch",
    "out_of_range",
    "file_changed",
}


def _from_rust(kind: str, message: str, details: dict) -> Error:
    """The exception for an error of ``kind`` (called by the extension module)."""
    details = {k: v for k, v in details.items() if v is not None}
    cls: type
    if kind == "invalid_config":
        cls = ConfigError
    elif kind in _DATA_KINDS:
        cls = DataError
    elif kind == "io":
        found = details.get("errno")
        cls = (
            FileNotFound
            if found == _errno.ENOENT
            else FileExists
            if found == _errno.EEXIST
            else FileError
        )
    elif kind in ("no_gpu", "cuda"):
        cls = GpuError
    elif kind == "internal":
        cls = InternalError
    else:
        cls = Error
    return cls(message, kind, **details)


def config_error(argument: str, what: str) -> ConfigError:
    """A ConfigError naming ``argument``, worded as the extension module words them."""
    return config_said(argument, f"invalid argument {argument}: {what}")


def config_said(argument: str, message: str) -> ConfigError:
    """A ConfigError about ``argument`` (the one that changes it) whose message says what the
    call did or lacks: for a call that is missing an argument, not giving a bad one."""
    return ConfigError(message, "invalid_config", argument=argument)
