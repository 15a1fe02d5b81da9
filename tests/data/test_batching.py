"""Re-batching (tensorshare.data.batching): batches of one size in, another size out, in
sample order, for every shape of batch a DataLoader yields."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from tensorshare.data import Rebatcher, sample_count
from tensorshare.data.batching import concat, split


def batches(sizes: list[int], make: Any) -> list[Any]:
    out, start = [], 0
    for n in sizes:
        out.append(make(torch.arange(start, start + n)))
        start += n
    return out


def run(rb: Rebatcher, ins: list[Any]) -> list[Any]:
    out = []
    for b in ins:
        rb.add(b)
        while rb.ready:
            out.append(rb.pop())
    tail = rb.flush()
    return out + ([] if tail is None else [tail])


Pair = namedtuple("Pair", "x y")
SHAPES = {
    "tensor": lambda idx: idx.float().unsqueeze(1).repeat(1, 3),
    "tuple": lambda idx: (idx.float(), idx * 2),
    "list": lambda idx: [idx.float(), idx],
    "dict": lambda idx: {"image": idx.float().reshape(-1, 1, 1), "label": idx},
    "nested": lambda idx: {"a": (idx, [idx + 1]), "b": idx.double()},
    "namedtuple": lambda idx: Pair(idx.float(), idx),
}


def first_leaf(b: Any) -> torch.Tensor:
    while not isinstance(b, torch.Tensor):
        b = next(iter(b.values())) if isinstance(b, dict) else b[0]
    return b


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("size", [1, 5, 16, 40])
def test_every_sample_comes_out_once_in_order_in_batches_of_the_asked_size(
        shape: str, size: int) -> None:
    ins = batches([16, 16, 16, 7], SHAPES[shape])
    out = run(Rebatcher(size), ins)
    counts = [sample_count(b) for b in out]
    assert counts[:-1] == [size] * (len(counts) - 1)
    assert sum(counts) == 55 and len(out) == -(-55 // size)  # ceil: the last may be partial
    samples = torch.cat([first_leaf(b).reshape(len(first_leaf(b)), -1)[:, 0] for b in out])
    assert samples.tolist() == list(range(55))
    assert type(out[0]) is type(ins[0])


def test_the_structure_is_kept_and_every_tensor_is_cut_alike() -> None:
    ins = batches([10, 10], SHAPES["nested"])
    out = run(Rebatcher(4), ins)
    b = out[2]  # samples 8..11: across the two inputs
    assert b["a"][0].tolist() == [8, 9, 10, 11] and b["a"][1][0].tolist() == [9, 10, 11, 12]
    assert b["b"].dtype == torch.float64 and b["b"].tolist() == [8, 9, 10, 11]


def test_batches_that_already_fit_pass_through_without_a_copy() -> None:
    ins = batches([8, 8], SHAPES["tensor"])
    out = run(Rebatcher(8), ins)
    assert out[0] is ins[0] and out[1] is ins[1]
    halves = run(Rebatcher(4), ins)
    assert halves[0].data_ptr() == ins[0].data_ptr()  # a split is a view


def test_drop_last_and_keeping_the_producers_batches() -> None:
    ins = batches([16, 16, 7], SHAPES["tuple"])
    assert [sample_count(b) for b in run(Rebatcher(10, drop_last=True), ins)] == [10] * 3
    same = run(Rebatcher(None), ins)
    assert same == ins


def test_numpy_arrays_re_batch_too() -> None:
    ins = [np.arange(0, 6), np.arange(6, 10)]
    out = run(Rebatcher(4), ins)
    assert [o.tolist() for o in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_what_cannot_be_re_batched_says_so() -> None:
    with pytest.raises(TypeError, match="cannot be re-batched"):
        Rebatcher(4).add(["a", "b"])
    with pytest.raises(TypeError, match=r"batch\[1\] is a str"):
        split((torch.zeros(2), "x"), 1)
    with pytest.raises(TypeError, match="different keys"):
        concat([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="positive int"):
        Rebatcher(0)
    assert sample_count({"a": "no tensor"}) is None
    assert sample_count(torch.tensor(3.0)) is None
    assert Rebatcher(4).flush() is None
