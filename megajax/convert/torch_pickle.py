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
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from megajax.errors import UserError

STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
            "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
            "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


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
        self.storage, self.offset, self.shape, self.stride = storage, offset, tuple(shape), tuple(stride)

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    def numpy(self) -> np.ndarray:
        flat = self.storage.archive.storage(self.storage.key, self.storage.dtype)
        need = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1 if all(self.shape) else 0
        if need > len(flat):
            raise UserError(f"{self.storage.archive.path}: a tensor reaches past its storage: damaged")
        view = np.lib.stride_tricks.as_strided(flat[self.offset:], self.shape,
                                               [s * flat.itemsize for s in self.stride])
        return np.array(view)


def _rebuild_tensor(storage, offset, shape, stride, *_):
    return Tensor(storage, offset, shape, stride)


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    SAFE = {("collections", "OrderedDict"): collections.OrderedDict, ("argparse", "Namespace"): argparse.Namespace,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter}

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
            raise UserError(f"{self.archive.path}: a tensor of storage type {kind!r}, which megajax does not read")
        return _Storage(self.archive, key, STORAGES[kind])


class _Archive:
    def __init__(self, path: Path):
        self.path, self._storages = path, {}
        self.zip = zipfile.ZipFile(path)
        pickles = [n for n in self.zip.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise UserError(f"{path} is a zip archive, but not one torch.save wrote (no ROOT/data.pkl)")
        self.root = pickles[0].removesuffix("data.pkl")
        order = f"{self.root}byteorder"
        if order in self.zip.namelist() and self.zip.read(order).strip() != b"little":
            raise UserError(f"{path} was saved on a big-endian machine, which megajax does not read")

    def storage(self, key: str, dtype: np.dtype) -> np.ndarray:
        if key not in self._storages:
            try:
                data = self.zip.read(f"{self.root}data/{key}")
            except KeyError:
                raise UserError(f"{self.path} lacks the storage data/{key}: damaged") from None
            self._storages[key] = np.frombuffer(data[:len(data) - len(data) % dtype.itemsize], dtype)
        return self._storages[key]


def load(path) -> object:
    """What torch.save wrote to `path`, its tensors as lazy `Tensor`s."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found")
    if not zipfile.is_zipfile(path):
        raise UserError(f"{path} is not in torch.save's zip format (PyTorch 1.6 and later): a legacy file; load and "
                        f"save it again with any recent PyTorch (torch.save(torch.load(F), F))")
    try:
        archive = _Archive(path)
        with archive.zip.open(f"{archive.root}data.pkl") as f:
            return _Unpickler(f, archive).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {str(e)[:80]}): damaged") from None
