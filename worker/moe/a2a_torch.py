"""The torch.distributed all-to-all backend: gloo on CPU, NCCL on CUDA.

Owns `TorchDistributedBackend`, which implements `worker.moe.a2a.AllToAllBackend` over a
process group with `all_to_all_single` and uneven split sizes, and
`init_process_group_from_env`, the torchrun-compatible way a worker process joins its
EP group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

Bulk transfers are started with `async_op=True`; the returned `TorchWorkHandle` owns
the output buffer and the `Work` object and hands the buffer out on `wait`. The count
exchange is a blocking all-to-all of one int64 per rank, run on the backend's device
(NCCL only moves CUDA tensors).

Invariants: the process group is initialised before construction; all ranks of the
group issue the same collectives in the same order.
Callers: EP worker processes (`kvgate worker --enable-expert-parallel`), tests.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from worker.moe.a2a import AllToAllBackend, AllToAllHandle, CompletedHandle, check_counts


class TorchWorkHandle:
    """A started `all_to_all_single`: the output buffer is valid after `wait`."""

    __slots__ = ("_work", "_output")

    def __init__(self, work: dist.Work, output: torch.Tensor) -> None:
        self._work = work
        self._output = output

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._output


class TorchDistributedBackend(AllToAllBackend):
    """All-to-all over a torch.distributed process group (the default group if None)."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        self._group = group
        self._device = torch.device(device)
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        if len(send_counts) != self._world_size:
            raise ValueError(f"send_counts must have {self._world_size} entries, got {len(send_counts)}")
        send = torch.tensor(list(send_counts), dtype=torch.int64, device=self._device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self._group)
        return recv.tolist()

    def all_to_all(
        self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> AllToAllHandle:
        check_counts(self, rows, send_counts)
        output = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        if self._world_size == 1:
            output.copy_(rows)
            return CompletedHandle(output)
        work = dist.all_to_all_single(
            output,
            rows.contiguous(),
            output_split_sizes=list(recv_counts),
            input_split_sizes=list(send_counts),
            group=self._group,
            async_op=True,
        )
        return TorchWorkHandle(work, output)


def init_process_group_from_env(backend: str | None = None) -> TorchDistributedBackend:
    """Join the default process group from torchrun's environment variables.

    `backend` defaults to NCCL when CUDA is available, else gloo; the returned
    backend moves tensors on `cuda:LOCAL_RANK` or the CPU accordingly.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"environment lacks {', '.join(missing)} (launch with torchrun or set them)")
    use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), init_method="env://")
    return TorchDistributedBackend(device=device)
