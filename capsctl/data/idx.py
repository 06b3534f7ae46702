"""Reader for the IDX format of MNIST and Fashion-MNIST (gzip-compressed or plain)."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from capsctl.errors import DataError

__all__ = ["read_idx"]

# IDX type codes -> big-endian numpy dtypes.
_IDX_DTYPES: dict[int, str] = {
    0x08: "u1",
    0x09: "i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file into a numpy array (native byte order).

    A name ending in ``.gz`` (or a file starting with the gzip magic) is decompressed.
    Any format problem raises :class:`DataError` naming the file.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except OSError as e:  # includes gzip.BadGzipFile
        raise DataError(f"cannot read IDX file {path}: {e}; replace it with a good copy") from None
    except (EOFError, zlib.error) as e:
        raise DataError(
            f"IDX file {path} is truncated or corrupt ({e}); replace it with a good copy"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(
            f"{path} is not an IDX file (bad magic number); replace it with a good copy"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"IDX file {path} is truncated in its header; replace it with a good copy")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(raw) - header != count * dtype.itemsize:
        raise DataError(
            f"IDX file {path} has {len(raw) - header} data bytes but its header {shape} needs "
            f"{count * dtype.itemsize}; replace it with a good copy"
        )
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)
