"""Expert parallelism: routed experts sharded over EP ranks, tokens moved by all-to-all.

Layout: `placement` (which rank holds which expert), `a2a` (the backend interface and
the single-process backend), `a2a_torch` (torch.distributed: gloo on CPU, NCCL on
CUDA), `a2a_stream` (a wrapper issuing every collective in order from one thread, so
a dispatch's count exchange runs behind its handle), `a2a_emulated` (a wrapper adding
link time), `payload` (packing a dispatch's fields into one transfer), `dispatch`
(dispatch/combine over a backend, with handles to wait on later), `layer`
(`ExpertParallelMoE`, one rank's share of `worker.models.moe.MoE`), `ubatch` and `dbo`
(Dual Batch Overlap).
`a2a_torch` is not imported here so that the package loads without initialising
torch.distributed.
"""

from worker.moe.a2a import (
    AllToAllBackend,
    AllToAllHandle,
    CompletedHandle,
    CountedHandle,
    KnownCountsHandle,
    SingleProcessBackend,
)
from worker.moe.a2a_stream import CommStreamBackend
from worker.moe.dispatch import (
    DispatchedTokens,
    DispatchPlan,
    ExpertDispatcher,
    PendingCombine,
    PendingDispatch,
    plan_dispatch,
)
from worker.moe.layer import ExpertParallelMoE
from worker.moe.placement import ExpertPlacement

__all__ = [
    "AllToAllBackend",
    "AllToAllHandle",
    "CommStreamBackend",
    "CompletedHandle",
    "CountedHandle",
    "DispatchPlan",
    "DispatchedTokens",
    "ExpertDispatcher",
    "ExpertParallelMoE",
    "ExpertPlacement",
    "KnownCountsHandle",
    "PendingCombine",
    "PendingDispatch",
    "SingleProcessBackend",
    "plan_dispatch",
]
