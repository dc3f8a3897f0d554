"""megajax/convert/torch_pickle.py against untrusted files: any view a file can claim (offsets,
strides and sizes at random, negative, overlapping or past 2^63) reads exactly the elements an
independent element-by-element indexing reads, or is refused in one line; any truncation or
damaged byte of every committed .pt fixture is read or refused in one line. Before the bounds
checks, an offset of -1 read memory before the storage and negative strides with a large shape
ended the process with SIGSEGV."""

import argparse
import itertools
import random

import numpy as np
import pytest
from conftest import ROOT

from megajax.convert import torch_pickle
from megajax.errors import UserError

FIXTURES = sorted((ROOT / "tests/fixtures/megatron").rglob("*.pt"))


def _reference(flat: np.ndarray, offset, shape, stride):
    """The view's elements by indexing one at a time, or None where torch.save could not have
    written it: a negative offset, size or stride, an element outside the storage, or more
    elements than the storage holds (overlapping strides)."""
    if offset < 0 or min(shape, default=0) < 0 or min(stride, default=0) < 0:
        return None
    # more than any array holds, even empty
    if np.prod([max(n, 1) for n in shape], dtype=object) >= 2**62:
        return None
    count = int(np.prod(shape, dtype=object)) if shape else 1
    if count == 0:
        return np.zeros(shape, flat.dtype)
    if count > len(flat):
        return None
    out = np.empty(shape, flat.dtype)
    for index in itertools.product(*(range(n) for n in shape)):
        at = offset + sum(i * s for i, s in zip(index, stride))
        if at >= len(flat):
            return None
        out[index] = flat[at]
    return out


def _random_view(rng: random.Random, length: int):
    sizes = [0, 1, 2, 3, 5, 2**31, 2**62, -1]
    strides = [0, 1, 2, 3, 7, length, 2**40, 2**63, -1, -2]
    ndim = rng.randint(0, 3)
    shape = tuple(
        rng.choice(sizes[:5]) if rng.random() < 0.8 else rng.choice(sizes) for _ in range(ndim)
    )
    stride = tuple(
        rng.choice(strides[:6]) if rng.random() < 0.8 else rng.choice(strides) for _ in range(ndim)
    )
    offset = rng.choice([0, 1, rng.randrange(length + 3), length - 1, length, -1, -length, 2**62])
    return offset, shape, stride


def test_any_claimed_view_reads_what_indexing_reads_or_is_refused():
    loaded = torch_pickle.load(ROOT / "tests/fixtures/megatron/tensors.pt")
    rng, refused, read = random.Random(0), 0, 0
    for tensor in loaded["model"].values():
        flat = tensor.storage.archive.storage(tensor.storage.key, tensor.storage.dtype)
        for _ in range(300):
            offset, shape, stride = _random_view(rng, len(flat))
            want = _reference(flat, offset, shape, stride)
            view = torch_pickle.Tensor(tensor.storage, offset, shape, stride)
            if want is None:
                with pytest.raises(UserError, match="damaged"):
                    view.numpy()
                refused += 1
            else:
                np.testing.assert_array_equal(view.numpy(), want)
                read += 1
    assert refused > 500 and read > 500  # both sides of the rule were exercised


@pytest.mark.parametrize(
    "offset,shape,stride,message",
    [
        (-1, (4,), (1,), "negative offset, size or stride"),  # the sweep's offset -1
        (100, (2**31, 2**31), (-1, -1), "negative offset, size or stride"),  # the sweep's SIGSEGV
        # a small file claiming any size
        (0, (2**40,), (0,), "elements over a storage"),
        (0, (0, 2**62), (1, 1), "claims an impossible size"),
        (0, (2, 2), (1,), "is not a view torch.save writes"),
        (0.5, (2,), (1,), "is not a view torch.save writes"),
    ],
)
def test_the_sweeps_views_are_one_line(offset, shape, stride, message):
    loaded = torch_pickle.load(ROOT / "tests/fixtures/megatron/tensors.pt")
    storage = next(iter(loaded["model"].values())).storage
    with pytest.raises(UserError, match=message):
        torch_pickle.Tensor(storage, offset, shape, stride).numpy()


def _tensors(value):
    if isinstance(value, torch_pickle.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, argparse.Namespace):
        yield from _tensors(vars(value))


@pytest.mark.parametrize(
    "fixture", FIXTURES, ids=lambda p: str(p.relative_to(ROOT / "tests/fixtures/megatron"))
)
def test_truncated_or_damaged_files_are_read_or_refused_in_one_line(fixture, tmp_path):
    data = fixture.read_bytes()
    rng = random.Random(fixture.name)
    damaged = [data[:n] for n in sorted(rng.sample(range(1, len(data)), 12))]
    for _ in range(12):
        b = bytearray(data)
        for at in rng.sample(range(len(b)), 3):
            b[at] = rng.randrange(256)
        damaged.append(bytes(b))
    refused = []
    for i, content in enumerate(damaged):
        path = tmp_path / f"{i}.pt"
        path.write_bytes(content)
        try:
            for tensor in _tensors(torch_pickle.load(path)):
                tensor.numpy()
        except UserError as e:
            assert "\n" not in str(e) and str(path) in str(e)
            refused.append(i)
    assert set(range(12)) <= set(refused)  # no truncated archive reads as whole


def test_a_truncated_file_is_called_truncated_not_legacy(tmp_path):
    data = FIXTURES[0].read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="a zip archive without its end .*: truncated or damaged"):
        torch_pickle.load(tmp_path / "cut.pt")
    (tmp_path / "other.pt").write_bytes(b"hello")
    with pytest.raises(UserError, match="is not a PyTorch checkpoint"):
        torch_pickle.load(tmp_path / "other.pt")
