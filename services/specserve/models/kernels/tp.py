"""Tensor parallelism for the pooled forward: a target's layers split over the ranks of a group.

The split is Megatron's, as vLLM and gpt-fast's `tp.py` make it: q|k|v and gate|up column-parallel (each rank
computes its own heads and its slice of the MLP), o and down row-parallel (each rank multiplies its own
columns, then ONE all-reduce of the hidden state after each), the LM head vocabulary-parallel and gathered
to rank 0, where acceptance runs; norms and the embedding are replicated. Heads go to ranks by key/value
group, as evenly as the groups allow (the embedded target's 3 KV heads split 2 + 1 over two ranks), so each
rank's KV pool holds only its own groups' keys and values.

Rank 0 owns the step scheduler and the pool's allocator. Each step it broadcasts what the step is (the
sequences' blocks, lengths, new tokens and logits kept, and any block moved since the last step) on a CPU
group, and every rank runs the same forward on its shard (`KVPool.follow`). Tensors cross a gloo group on
CPUs, an NCCL one on GPUs. This module knows nothing of Ray: `workers/` places the ranks and hands each its
`Shard` and a store to meet at.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specserve.models.kernels.quant import Blocks, Int4Groups, Int8Rows

TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class Shard:
    """Which part of every layer a rank holds: rank `rank` of `world`."""

    rank: int = 0
    world: int = 1

    def kv_groups(self, kv_heads: int) -> range:
        """The key/value heads (and so the query groups) this rank computes: consecutive, as even as they go."""
        base, extra = divmod(kv_heads, self.world)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def part(self, n: int) -> slice:
        """This rank's equal share of n (n divisible by the world size)."""
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def vocab(self, n: int) -> slice:
        """This rank's rows of a vocabulary of n: ceil(n / world) each, the last rank's short (its logits padded)."""
        size = -(-n // self.world)
        return slice(min(n, self.rank * size), min(n, (self.rank + 1) * size))


def linear_parts(shard: Shard, config) -> dict[str, tuple[slice | None, slice | None]]:
    """(rows, columns) of each layer's linear weights [out, in] that `shard` holds, by role: its heads' rows of
    q, k, v, its slice of gate and up, and the matching columns of o and down (None: all of them)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    groups, per_group = shard.kv_groups(kv_heads), heads // kv_heads
    query = slice(groups.start * per_group * d, groups.stop * per_group * d)
    kv, mlp = slice(groups.start * d, groups.stop * d), shard.part(config.intermediate_size)
    return {"q": (query, None), "k": (kv, None), "v": (kv, None), "gate": (mlp, None), "up": (mlp, None),
            "o": (None, query), "down": (None, mlp)}


def check(config, world: int) -> None:
    """ValueError naming `tensor_parallel` when `config`'s model cannot be split over `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {world}")
    kv_heads = config.num_key_value_heads
    if world > kv_heads:
        raise ValueError(f"tensor_parallel: {world} ranks need at least {world} key/value heads; the model has "
                         f"{kv_heads}")
    if config.intermediate_size % world:
        raise ValueError(f"tensor_parallel: {world} ranks must divide the MLP's {config.intermediate_size} "
                         "intermediate features")


def take(weight, rows: slice | None = None, cols: slice | None = None):
    """A shard of one linear weight [N, K]: a dense tensor, `Int8Rows`, `Int4Groups` or `Blocks`."""
    if isinstance(weight, (Int8Rows, Int4Groups, Blocks)):
        if rows is not None:
            weight = weight.rows(torch.arange(rows.start, rows.stop))
        return weight if cols is None else weight.cols(cols.start, cols.stop)
    if rows is not None:
        weight = weight[rows]
    return weight if cols is None else weight[:, cols]


HEADER = 5  # a step description's first broadcast: go, moves, sequences, body length, hidden width


class Collective:
    """The communication of one rank of a tensor-parallel group, counted.

    data: the process group tensors of the forward cross (gloo on CPUs, NCCL on GPUs); control: a CPU (gloo)
    group for the step descriptions rank 0 broadcasts (the data group where that is gloo already)."""

    def __init__(self, shard: Shard, data, control=None):
        self.shard = shard
        self.data = data
        self.control = control if control is not None else data
        self.all_reduces = 0
        self.all_reduce_bytes = 0
        self.gathers = 0
        self.gather_bytes = 0
        self.steps = 0
        self.lost: Callable[[BaseException], None] | None = None  # told when a collective fails (a rank is gone)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world(self) -> int:
        return self.shard.world

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place."""
        self._wait(self.data.allreduce([t]))
        self.all_reduces += 1
        self.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def gather_columns(self, t: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's t [rows, ceil(width / world)] side by side on rank 0 ([rows, width]); t itself elsewhere."""
        share = -(-width // self.world)
        if t.shape[1] < share:
            t = torch.nn.functional.pad(t, (0, share - t.shape[1]))
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.gathers += 1
        self.gather_bytes += t.numel() * t.element_size()
        if self.rank != 0:
            self._wait(self.data.gather([], [t.contiguous()], opts))
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._wait(self.data.gather([parts], [t.contiguous()], opts))
        return torch.cat(parts, 1)[:, :width]

    def stats(self) -> dict:
        """What this rank has communicated: steps, all-reduces and gathers with their bytes."""
        return {"tensor_parallel": self.world, "tp_steps": self.steps, "tp_all_reduces": self.all_reduces,
                "tp_all_reduce_bytes": self.all_reduce_bytes, "tp_gathers": self.gathers,
                "tp_gather_bytes": self.gather_bytes}

    # -- step descriptions, rank 0 → the others ----------------------------------------------------------------
    def send_step(self, moves: list[tuple[int, int, int]], blocks: list[tuple[int, int]], starts: list[int],
                  new_tokens: list[list[int]], keeps: list[int], hidden: torch.Tensor | None = None) -> None:
        """Rank 0: tell the others the step it is about to run (moves: (from, to, positions) block copies;
        hidden: a pipeline stage's input from the stage before, [new tokens, hidden size] on this rank's device)."""
        body = [v for move in moves for v in move]
        body += [v for block in blocks for v in block] + starts + [len(t) for t in new_tokens] + keeps
        body += [t for ts in new_tokens for t in ts]
        width = 0 if hidden is None else hidden.shape[1]
        self._broadcast(torch.tensor([1, len(moves), len(blocks), len(body), width], dtype=torch.int64))
        self._broadcast(torch.tensor(body, dtype=torch.int64))
        if hidden is not None:  # over the data group: device to device (NCCL) on GPUs
            self._wait(self.data.broadcast(hidden.contiguous(), 0))
        self.steps += 1

    def stop(self) -> None:
        """Rank 0: end the others' `KVPool.follow` loops."""
        self._broadcast(torch.zeros(HEADER, dtype=torch.int64))

    def receive_step(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        """A follower: (moves, blocks, starts, new_tokens, keeps, hidden) of rank 0's next step, or None at `stop`;
        hidden (a pipeline stage's input, in `dtype` on `device`) or None."""
        header = self._broadcast(torch.empty(HEADER, dtype=torch.int64))
        go, n_moves, n_seqs, length, width = header.tolist()
        if not go:
            return None
        body = self._broadcast(torch.empty(length, dtype=torch.int64)).tolist()
        at = 3 * n_moves
        moves = [tuple(body[i : i + 3]) for i in range(0, at, 3)]
        blocks = [tuple(body[at + 2 * j : at + 2 * j + 2]) for j in range(n_seqs)]
        at += 2 * n_seqs
        starts, sizes, keeps = (body[at + i * n_seqs : at + (i + 1) * n_seqs] for i in range(3))
        at += 3 * n_seqs
        new_tokens = []
        for n in sizes:
            new_tokens.append(body[at : at + n])
            at += n
        hidden = None
        if width:
            hidden = torch.empty(sum(sizes), width, dtype=dtype, device=device)
            self._wait(self.data.broadcast(hidden, 0))
        self.steps += 1
        return moves, blocks, starts, new_tokens, keeps, hidden

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self._wait(self.control.broadcast(t, 0))
        return t

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException as exc:
            if self.lost is not None:
                self.lost(exc)
            raise


def connect(shard: Shard, store, device: torch.device | str = "cpu", timeout: datetime.timedelta = TIMEOUT
            ) -> Collective:
    """Rank `shard.rank`'s groups, met through `store` (a torch.distributed Store every rank shares: a TCPStore
    across processes, a HashStore between threads)."""
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("specserve-tp-cpu", store), shard.rank, shard.world, timeout)
    if torch.device(device).type != "cuda":
        return Collective(shard, gloo)
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("specserve-tp-nccl", store), shard.rank, shard.world)
    return Collective(shard, nccl, gloo)
