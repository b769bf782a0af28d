"""Sequence parallelism: one packed row split across P ranks (``data.sequence_parallel``).

DeepSpeed-Ulysses' scheme, over torch's differentiable all-to-all
(``torch.distributed.nn.functional.all_to_all_single``): rank r holds rows ``r * T/P ..
(r + 1) * T/P - 1`` of the row's states and runs every projection, MLP and loss on them;
before attention one all-to-all trades sequence for heads (each rank then holds the whole row
for ``n / P`` heads), the attention runs exactly as on one rank, and a second all-to-all
trades back. Training-time test needs nothing else: the draft KV cache of every step is
per head, documents and windows are masks over the whole row, and every rank keeps the row's
token ids, positions, documents and loss mask (integers, [B, T]), so shifted tokens and
step validity are those of the whole row. The teacher of stream t at step k is row t + k + 1,
so each rank also keeps ``halo`` rows of teacher states past its own.

The loss of a rank is its rows' share of the row's loss (each token weighs 1 / the whole
row's count); ``reduce_record`` sums the shares for logging and scales the gradient by P, so
that a strategy that averages gradients over all ranks (DDP, FSDP, DeepSpeed) ends with the
average over data-parallel groups of each whole row's gradient, as one rank per row would.

Heads: ``num_heads`` must divide by P; key/value heads that do not are repeated to the query
heads first. ``torch.distributed.tensor.experimental.context_parallel`` was not used: it
rewrites SDPA calls that are causal or unmasked, and TTT attention is a document- and
window-masked prefix plus per-step diagonal keys, merged by log-sum-exp.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from draftsmith.core.errors import ConfigError
from draftsmith.drafters.attention.layers import AttendFn


def _all_to_all(x: Tensor, group) -> Tensor:
    """[P, ...] -> [P, ...]: chunk i goes to rank i, chunk i of the result came from rank i."""
    from torch.distributed.nn.functional import all_to_all_single

    x = x.contiguous()
    return all_to_all_single(torch.empty_like(x), x, group=group)


def seq_to_heads(x: Tensor, size: int, group) -> Tensor:
    """[B, n, T/P, hd] (this rank's rows, every head) -> [B, n/P, T, hd] (every row, this
    rank's heads: rank r takes heads r * n/P .. (r + 1) * n/P - 1)."""
    b, n, t, hd = x.shape
    x = x.view(b, size, n // size, t, hd).transpose(0, 1)  # [P, B, n/P, T/P, hd]
    y = _all_to_all(x, group)  # [P (source rank = row block), B, n/P, T/P, hd]
    return y.permute(1, 2, 0, 3, 4).reshape(b, n // size, size * t, hd)


def heads_to_seq(y: Tensor, size: int, group) -> Tensor:
    """The inverse of ``seq_to_heads``: [B, n/P, T, hd] -> [B, n, T/P, hd]."""
    b, m, t, hd = y.shape
    y = y.view(b, m, size, t // size, hd).permute(2, 0, 1, 3, 4)  # [P, B, n/P, T/P, hd]
    x = _all_to_all(y, group)  # [P (source rank = head block), B, n/P, T/P, hd]
    return x.transpose(0, 1).reshape(b, size * m, t // size, hd)


@dataclasses.dataclass
class SequenceShard:
    """Rank ``rank`` of ``size`` holding rows ``rows`` of a ``row_tokens`` row (module
    docstring); ``group`` the process group of the ranks sharing the row; ``halo`` extra
    teacher rows past the shard."""

    group: object
    rank: int
    size: int
    row_tokens: int
    halo: int = 0

    def __post_init__(self) -> None:
        if self.row_tokens % self.size:
            raise ConfigError(
                f"data.sequence_parallel: {self.size} does not divide data.row_tokens "
                f"{self.row_tokens}; give row_tokens a multiple of {self.size}"
            )

    @property
    def rows(self) -> slice:
        n = self.row_tokens // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def attend(self, inner: AttendFn) -> AttendFn:
        """``inner`` (an ``AttendFn`` over whole rows) run on this rank's heads: q [B, n,
        T/P, hd], k/v [B, n_kv, T/P, hd] -> [B, n, T/P, hd]."""
        p, group = self.size, self.group

        def attend(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            n, n_kv = q.shape[1], k.shape[1]
            if n % p:
                raise ConfigError(
                    f"data.sequence_parallel: {p} does not divide the head's {n} attention "
                    f"heads; give a divisor of {n}"
                )
            if n_kv % p:  # too few key/value heads to split: each rank takes its query's
                k, v = (x.repeat_interleave(n // n_kv, dim=1) for x in (k, v))
            q, k, v = (seq_to_heads(x, p, group) for x in (q, k, v))
            return heads_to_seq(inner(layer_idx, q, k, v), p, group)

        return attend

    def take(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's part of a batch (on the host, before it moves to the device):
        ``aux_states`` its rows, ``teacher_states`` its rows and ``halo`` more (zeros past the
        row's end); the [B, T] integer keys whole."""
        out = dict(batch)
        out["aux_states"] = batch["aux_states"][:, self.rows]
        out["teacher_states"] = self.with_halo(batch["teacher_states"])
        return out

    def with_halo(self, x: Tensor) -> Tensor:
        """[B, T, ...] -> [B, T/P + halo, ...]: this rank's rows and the next ``halo``."""
        start, stop = self.rows.start, self.rows.stop + self.halo
        part = x[:, start : min(stop, x.shape[1])]
        missing = stop - start - part.shape[1]
        if missing:
            pad = part.new_zeros(part.shape[0], missing, *part.shape[2:])
            part = torch.cat([part, pad], dim=1)
        return part

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the ranks sharing the row (no gradient; NCCL sums on the GPU)."""
        y = x.detach().clone()
        if y.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
            y = y.cuda()
        dist.all_reduce(y, group=self.group)
        return y.to(x.device)

    def gather_rows(self, x: Tensor) -> Tensor:
        """[B, T/P] of every rank -> [B, T] (no gradient)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def whole_loss(self, local: Tensor) -> Tensor:
        """The row's loss as the value, ``size`` times this rank's share as the gradient
        (module docstring: strategies average gradients over every rank)."""
        scaled = local * self.size
        return scaled - scaled.detach() + self.sum(local)


def make_shard(size: int, row_tokens: int, halo: int) -> SequenceShard | None:
    """This process's ``SequenceShard`` when ``size`` > 1: consecutive global ranks share a
    row (ranks 0..P-1 the first data-parallel group's); every rank creates every group, in
    order, as ``torch.distributed.new_group`` requires. None for size 1."""
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % size:
        raise ConfigError(
            f"data.sequence_parallel: {size} does not divide the {world} processes "
            f"(trainer.devices x trainer.num_nodes); give a divisor of {world}"
        )
    rank = dist.get_rank()
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceShard(mine, rank % size, size, row_tokens, halo)
