"""A restricted unpickler for CIFAR python batches (dicts of lists, bytes and numpy arrays).

CIFAR-10/100 "python version" batches are pickles. A pickle can name any importable callable
and have it called while loading, so the files are read with an unpickler whose
``find_class`` resolves only the handful of names that plain numpy arrays need. Anything
else is refused with a :class:`DataError` before it is imported or called.
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from capsctl.errors import DataError

__all__ = ["ALLOWED_GLOBALS", "SafeUnpickler", "safe_load"]


def _numpy_multiarray_attr(name: str) -> Any:
    # numpy >= 2 keeps the C module at numpy._core; numpy 1.x at numpy.core. Resolving it
    # here (instead of importing the name the pickle gives) avoids numpy 2's deprecation
    # warning for the old path that py2-era CIFAR pickles use.
    try:
        from numpy._core import multiarray
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    return getattr(multiarray, name)


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_multiarray_attr("_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): _numpy_multiarray_attr("_reconstruct"),
    ("numpy.core.multiarray", "scalar"): _numpy_multiarray_attr("scalar"),
    ("numpy._core.multiarray", "scalar"): _numpy_multiarray_attr("scalar"),
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    # Python 3 writes bytes into protocol-2 pickles as _codecs.encode(str, "latin1").
    ("_codecs", "encode"): codecs.encode,
    ("codecs", "encode"): codecs.encode,
}
"""(module, name) pairs the restricted unpickler resolves; nothing else is ever imported."""


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that only resolves :data:`ALLOWED_GLOBALS`."""

    def __init__(self, file: Any, *, source: str = "<pickle>", encoding: str = "latin1") -> None:
        super().__init__(file, encoding=encoding)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - see class docstring
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise DataError(
                f"capsctl refuses to load {self._source}: it asks for {module}.{name}, which plain "
                "data never needs; the file is not a genuine CIFAR batch, so delete it and "
                "download the dataset again"
            ) from None


def safe_load(path: str | Path) -> Any:
    """Unpickle ``path`` with :class:`SafeUnpickler` (``encoding="latin1"``, as py2 files need).

    Raises :class:`DataError` for forbidden globals and for corrupt or truncated files.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            return SafeUnpickler(f, source=str(path)).load()
    except DataError:
        raise
    except OSError as e:
        raise DataError(
            f"cannot read {path}: {e.strerror or e}; check the file and its permissions"
        ) from None
    except Exception as e:  # corrupt pickle: UnpicklingError, EOFError, ValueError, ...
        raise DataError(
            f"{path} is not a readable pickle ({type(e).__name__}: {e}); delete it and download "
            "the dataset again"
        ) from None
