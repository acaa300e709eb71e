"""Sharded data: ``loader(dataset, mesh, batch_size)`` and exact distributed evaluation.

Each data-parallel rank reads a strided slice of the (optionally shuffled) index list: rank ``r``
of ``n`` gets positions ``r, r + n, r + 2n, ...``. Ranks that differ only in ``tp`` (or ``pp``)
share a data-parallel index, so they read the same samples, as tensor parallelism needs.

Unlike ``DistributedSampler``, nothing is padded: with 13 samples on 4 ranks the shards hold 4, 3,
3 and 3 samples, so an evaluation summed over ranks counts every sample exactly once
(``exact_mean``). A training loop needs every rank to take the same number of steps (a rank that
stops early leaves the others waiting in a collective), so it passes ``drop_last=True``: the
index list is trimmed to a multiple of the data-parallel size, every shard the same length.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset, Sampler

from torchnitro.distributed.mesh import dp_coords, dp_dims
from torchnitro.errors import InputError

__all__ = ["ShardedSampler", "loader", "dp_sum", "exact_mean"]


class ShardedSampler(Sampler[int]):
    """The indices one data-parallel rank reads: a strided slice, no padding, same order on every rank."""

    def __init__(self, length: int, rank: int, size: int, *, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False) -> None:
        if not 0 <= rank < size:
            raise InputError(f"ShardedSampler: received rank={rank} with size={size}, expected 0 <= rank < size.")
        self.length, self.rank, self.size = length, rank, size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for a new epoch: every rank must call it with the same epoch."""
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator().manual_seed(self.seed + self.epoch)  # same seed on every rank: one permutation
        return torch.randperm(self.length, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        if self.drop_last:
            order = order[: len(order) - len(order) % self.size]
        return iter(order[self.rank::self.size])

    def __len__(self) -> int:
        n = self.length - self.length % self.size if self.drop_last else self.length
        return len(range(self.rank, n, self.size))


def loader(dataset: Dataset, mesh: DeviceMesh, batch_size: int, *, shuffle: bool = False, seed: int = 0,
           drop_last: bool = False, **kwargs: Any) -> DataLoader:
    """A DataLoader over this rank's shard of ``dataset`` (see the module docstring for the split)."""
    if batch_size < 1:
        raise InputError(f"loader: received batch_size={batch_size}, expected an integer >= 1.")
    rank, size = dp_coords(mesh)
    sampler = ShardedSampler(len(dataset), rank, size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)


def dp_sum(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum ``t`` over the data-parallel ranks (not over tp/pp, whose ranks hold copies); returns a new tensor."""
    out = t.detach().to(mesh.device_type, copy=True)
    for name in dp_dims(mesh):  # shard then replicate: together, every data-parallel rank once
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh[name].get_group())
    return out.to(t.device)


def exact_mean(total: float | torch.Tensor, count: int, mesh: DeviceMesh) -> tuple[float, int]:
    """(global mean, global count) from this rank's (sum of a metric, number of samples)."""
    t = torch.tensor([float(total), float(count)], dtype=torch.float64)
    s = dp_sum(t, mesh)
    n = int(s[1].item())
    if n == 0:
        raise InputError("exact_mean: received 0 samples over all ranks, expected at least one (is the dataset empty?).")
    return s[0].item() / n, n
