"""PyTorch checkpoint files (`torch.save`'s zip format) read without PyTorch, and without
running anything they contain.

A .pt file is a zip archive: ROOT/data.pkl, a pickle whose tensors refer to storages stored
as ROOT/data/KEY (raw little-endian bytes). The unpickler here builds only what megajax needs
and trusts: dicts and lists, argparse.Namespace, and tensors, as `Tensor`s that read their
storage from the archive when asked (an optimizer state or RNG state is never read). Any other
class a file names (an enum, a torch dtype, a NumPy RNG state) becomes an inert `Opaque`:
pickle's usual hazard, a file that calls arbitrary code on load, cannot happen.
"""

from __future__ import annotations

import argparse
import collections
import math
import pickle
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from megajax.errors import UserError

STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class Opaque:
    """Whatever a checkpoint names that megajax does not read: accepts any construction."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __call__(self, *args, **kwargs):
        return Opaque(*args)


class _Storage:
    def __init__(self, archive: "_Archive", key: str, dtype):
        self.archive, self.key, self.dtype = archive, key, np.dtype(dtype)


class Tensor:
    """A tensor of the checkpoint, read from its storage by `numpy()`."""

    def __init__(self, storage: _Storage, offset: int, shape: tuple, stride: tuple):
        self.storage, self.offset, self.shape, self.stride = (
            storage,
            offset,
            tuple(shape),
            tuple(stride),
        )

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    def numpy(self) -> np.ndarray:
        flat = self.storage.archive.storage(self.storage.key, self.storage.dtype)
        strides = _checked_strides(
            self.offset, self.shape, self.stride, len(flat), self.storage.archive.path
        )
        if math.prod(self.shape) == 0:
            return np.zeros(self.shape, flat.dtype)
        view = np.lib.stride_tricks.as_strided(
            flat[self.offset :], self.shape, [s * flat.itemsize for s in strides]
        )
        return np.array(view)


def _checked_strides(offset, shape, stride, length: int, path) -> list[int]:
    """The strides of a view that lies wholly inside a storage of `length` elements, or one line
    saying why the file's view does not. A file is untrusted: an offset or stride below zero, a
    lowest or highest element outside the storage, or more elements than the storage holds (a
    broadcast view, which no weight is, and which would make a small file claim any size) is
    damage. Python's integers do not overflow, so the bounds are exact however large the claims."""

    def whole(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not (
        whole(offset)
        and all(map(whole, shape))
        and all(map(whole, stride))
        and len(shape) == len(stride)
    ):
        raise UserError(
            f"{path}: a tensor with shape {shape!r}, strides {stride!r} and offset {offset!r} is "
            "not a view torch.save writes: damaged"
        )
    what = f"{path}: a tensor of shape {tuple(shape)}, strides {tuple(stride)} and offset {offset}"
    if offset < 0 or min(shape, default=0) < 0 or min(stride, default=0) < 0:
        raise UserError(f"{what} has a negative offset, size or stride: damaged")
    # no array of any dtype has so many, even empty
    if math.prod(max(n, 1) for n in shape) >= 2**62:
        raise UserError(f"{what} claims an impossible size: damaged")
    count = math.prod(shape)
    if count == 0:
        return [0] * len(shape)
    strides = [s if n > 1 else 0 for n, s in zip(shape, stride)]  # a dimension of one never steps
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    if last >= length:
        raise UserError(f"{what} reaches element {last} of a storage of {length}: damaged")
    if count > length:
        raise UserError(
            f"{what} has {count} elements over a storage of {length} (overlapping strides): damaged"
        )
    return strides


def _rebuild_tensor(storage, offset, shape, stride, *_):
    # a damaged pickle's arguments: its view is checked when read
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    return Tensor(storage, offset, shape, stride)


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    SAFE = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("argparse", "Namespace"): argparse.Namespace,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    }

    def __init__(self, file, archive: "_Archive"):
        super().__init__(file)
        self.archive = archive

    def find_class(self, module, name):
        if (module, name) in self.SAFE:
            return self.SAFE[module, name]
        if module == "torch" and name in STORAGES:
            return name
        return Opaque

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise UserError(f"{self.archive.path}: an unknown persistent record {pid[:1]!r}")
        kind, key = pid[1], str(pid[2])
        if kind not in STORAGES:
            raise UserError(
                f"{self.archive.path}: a tensor of storage type {kind!r}, which megajax does not "
                "read"
            )
        return _Storage(self.archive, key, STORAGES[kind])


class _Archive:
    def __init__(self, path: Path):
        self.path, self._storages = path, {}
        self.zip = zipfile.ZipFile(path)
        pickles = [n for n in self.zip.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise UserError(
                f"{path} is a zip archive, but not one torch.save wrote (no ROOT/data.pkl)"
            )
        self.root = pickles[0].removesuffix("data.pkl")
        order = f"{self.root}byteorder"
        if order in self.zip.namelist() and self.zip.read(order).strip() != b"little":
            raise UserError(
                f"{path} was saved on a big-endian machine, which megajax does not read"
            )

    def storage(self, key: str, dtype: np.dtype) -> np.ndarray:
        if key not in self._storages:
            try:
                data = self.zip.read(f"{self.root}data/{key}")
            except KeyError:
                raise UserError(f"{self.path} lacks the storage data/{key}: damaged") from None
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
                raise UserError(
                    f"{self.path}: the storage data/{key} cannot be read ({type(e).__name__}: "
                    f"{str(e)[:80]}): damaged"
                ) from None
            self._storages[key] = np.frombuffer(
                data[: len(data) - len(data) % dtype.itemsize], dtype
            )
        return self._storages[key]


# torch.save's format before PyTorch 1.6: a bare pickle (protocol 2) whose first object is this
# number.
LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _not_a_zip(path: Path) -> str:
    """Why a file without a zip archive's directory is not read: a zip whose end is missing (a
    copy or download cut short), PyTorch's format before 1.6, or not a PyTorch file at all."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(b"PK\x03\x04"):
        return (
            f"{path} is a zip archive without its end (its directory of contents is missing): "
            "truncated or damaged, for example by a copy that did not finish"
        )
    if head.startswith(b"\x80") and LEGACY_MAGIC in head:
        return (
            f"{path} is in torch.save's format before PyTorch 1.6 (a legacy file); load and save "
            "it again with any recent PyTorch (torch.save(torch.load(F), F))"
        )
    return (
        f"{path} is not a PyTorch checkpoint (neither torch.save's zip format nor its legacy one)"
    )


def load(path) -> object:
    """What torch.save wrote to `path`, its tensors as lazy `Tensor`s."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found")
    if not zipfile.is_zipfile(path):
        raise UserError(_not_a_zip(path))
    try:
        archive = _Archive(path)
        with archive.zip.open(f"{archive.root}data.pkl") as f:
            return _Unpickler(f, archive).load()
    except UserError:
        raise
    # The unpickler runs no code: whatever it raises, the file is damaged.
    except Exception as e:  # noqa: BLE001
        raise UserError(
            f"{path} cannot be read ({type(e).__name__}: {str(e)[:80]}): damaged"
        ) from None
