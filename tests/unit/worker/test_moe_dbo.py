"""Dual Batch Overlap in one process: the micro-batch hand-off, receive hooks, the split
rule and the emulated link.

Multi-rank behaviour (gloo, 2 processes: agreement, DBO == plain, a 2000-step soak)
is in tests/integration/test_dbo.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from worker.models.config import ModelConfig
from worker.models.moe import MoE
from worker.moe import CompletedHandle, ExpertParallelMoE, SingleProcessBackend
from worker.moe.a2a_emulated import EmulatedLinkBackend
from worker.moe.dbo import DboConfig, UBatchSplit, agree_split, can_split, dbo_forward, maybe_dbo_forward
from worker.moe.ubatch import (
    UBatchAborted,
    current_ubatch,
    dbo_maybe_run_recv_hooks,
    dbo_register_recv_hook,
    dbo_yield,
    run_ubatches,
)

CONFIG = ModelConfig(hidden_size=32, num_experts=5, moe_intermediate_size=24, shared_expert_intermediate_size=16)


def _steps(trace: list[str], name: str, num_yields: int):
    def fn() -> str:
        for i in range(num_yields):
            trace.append(f"{name}{i}")
            dbo_yield()
        trace.append(f"{name}-end")
        return name

    return fn


def test_threads_alternate_strictly_from_ubatch_0() -> None:
    trace: list[str] = []
    outs, ctx = run_ubatches([_steps(trace, "a", 3), _steps(trace, "b", 3)])
    assert outs == ["a", "b"]
    assert trace == ["a0", "b0", "a1", "b1", "a2", "b2", "a-end", "b-end"]
    assert ctx.num_switches == 6


def test_uneven_yields_and_no_yields_do_not_deadlock() -> None:
    trace: list[str] = []
    run_ubatches([_steps(trace, "a", 0), _steps(trace, "b", 4)])
    assert trace == ["a-end", "b0", "b1", "b2", "b3", "b-end"]
    trace.clear()
    run_ubatches([_steps(trace, "a", 3), _steps(trace, "b", 1)])
    assert trace == ["a0", "b0", "a1", "b-end", "a2", "a-end"]


def test_outside_dbo_yield_is_a_no_op_and_hooks_run_at_once() -> None:
    ran: list[int] = []
    assert current_ubatch() is None
    dbo_yield()
    dbo_maybe_run_recv_hooks()
    dbo_register_recv_hook(lambda: ran.append(1))
    assert ran == [1]


@pytest.mark.parametrize("failing", [0, 1])
def test_exception_in_either_thread_propagates(failing: int) -> None:
    trace: list[str] = []

    def boom() -> None:
        dbo_yield()
        raise KeyError("boom")

    fns = [_steps(trace, "a", 5), _steps(trace, "b", 5)]
    fns[failing] = boom
    with pytest.raises(KeyError, match="boom"):
        run_ubatches(fns)
    # The survivor stops at its next yield instead of running on alone.
    assert trace == [["b0"], ["a0", "a1"]][failing]


def test_abort_is_raised_when_nothing_else_failed() -> None:
    def abort() -> None:
        raise UBatchAborted("stop")

    with pytest.raises(UBatchAborted, match="stop"):
        run_ubatches([abort, abort])


def test_recv_hooks_run_on_the_other_thread() -> None:
    ran_on: list[tuple[str, str]] = []

    def fn(name: str):
        def body() -> None:
            dbo_register_recv_hook(lambda: ran_on.append((name, threading.current_thread().name)))
            dbo_yield()
            dbo_yield()

        return body

    run_ubatches([fn("a"), fn("b")])
    assert ran_on == [("a", "ubatch-1"), ("b", "ubatch-0")]


def test_grad_mode_is_inherited_and_nesting_is_refused() -> None:
    with torch.no_grad():
        outs, _ = run_ubatches([torch.is_grad_enabled, torch.is_grad_enabled])
    assert outs == [False, False]

    def nested() -> None:
        run_ubatches([lambda: None, lambda: None])

    with pytest.raises(RuntimeError, match="cannot nest"):
        run_ubatches([nested, lambda: None])


def test_threads_are_reused_and_concurrent_callers_both_run() -> None:
    def ident() -> int:
        dbo_yield()
        return threading.get_ident()

    first, _ = run_ubatches([ident, ident])
    again, _ = run_ubatches([ident, ident])
    assert first == again and first[0] != first[1]
    # Two callers at once (two engines in one process): one gets the long-lived
    # threads, the other fresh ones; both alternate correctly.
    results: dict[int, list[str]] = {}

    def caller(n: int) -> None:
        trace: list[str] = []
        run_ubatches([_steps(trace, "a", 50), _steps(trace, "b", 50)])
        results[n] = trace

    callers = [threading.Thread(target=caller, args=(n,)) for n in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    want = [f"{name}{i}" for i in range(50) for name in "ab"] + ["a-end", "b-end"]
    assert results == {0: want, 1: want}


# ---- split rule ---------------------------------------------------------------------


def test_can_split_uses_the_threshold_of_the_batch_kind() -> None:
    on = DboConfig(enable_dbo=True)
    assert (can_split(31, False, on), can_split(32, False, on)) == (False, True)
    assert (can_split(511, True, on), can_split(512, True, on)) == (False, True)
    assert can_split(10_000, True, DboConfig()) is False
    assert agree_split(33, False, on) == UBatchSplit(num_tokens_padded=33, split_at=16)
    assert agree_split(31, False, on) is None


def test_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="dbo_prefill_token_threshold"):
        DboConfig(dbo_prefill_token_threshold=1)


# ---- the MoE layer with yield points ---------------------------------------------------


class _HookedHandle:
    """A handle shaped like DeepEP's low-latency ones: a separate receive step."""

    def __init__(self, result: torch.Tensor, log: list[str]) -> None:
        self._result, self._log, self._received = result, log, False

    def recv_hook(self) -> None:
        self._log.append(threading.current_thread().name)
        self._received = True

    def is_completed(self) -> bool:
        return self._received

    def wait(self) -> torch.Tensor:
        assert self._received, "waited before the receive hook ran"
        return self._result


class _HookedBackend(SingleProcessBackend):
    def __init__(self) -> None:
        self.log: list[str] = []

    def all_to_all(self, rows, send_counts, recv_counts):
        return _HookedHandle(super().all_to_all(rows, send_counts, recv_counts).wait(), self.log)


def _layer(backend) -> tuple[ExpertParallelMoE, MoE]:
    torch.manual_seed(0)
    moe = MoE(CONFIG)
    return ExpertParallelMoE.from_moe(CONFIG, moe, backend), moe


@torch.no_grad()
def test_dbo_forward_equals_plain_and_pads() -> None:
    layer, moe = _layer(SingleProcessBackend())
    x = torch.randn(9, CONFIG.hidden_size)
    out = dbo_forward(layer, x, UBatchSplit(num_tokens_padded=12, split_at=6))
    torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(out, moe(x), atol=1e-5, rtol=0)
    out, split = maybe_dbo_forward(layer, x, False, DboConfig(enable_dbo=True, dbo_decode_token_threshold=8))
    assert split is True
    torch.testing.assert_close(out, moe(x), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="more than the agreed 4"):
        dbo_forward(layer, x, UBatchSplit(4, 2))


@torch.no_grad()
def test_layer_hands_recv_hooks_to_the_other_micro_batch() -> None:
    backend = _HookedBackend()
    layer, moe = _layer(backend)
    x = torch.randn(6, CONFIG.hidden_size)
    torch.testing.assert_close(dbo_forward(layer, x, UBatchSplit(6, 3)), moe(x), atol=1e-5, rtol=0)
    # One packed dispatch, then one combine per micro-batch, each received by the peer.
    assert backend.log == ["ubatch-1", "ubatch-0", "ubatch-1", "ubatch-0"]
    backend.log.clear()
    torch.testing.assert_close(layer(x), moe(x), atol=1e-5, rtol=0)
    assert backend.log == ["MainThread"] * 2


# ---- emulated link ------------------------------------------------------------------


def test_emulated_link_charges_bytes_to_other_ranks_serially() -> None:
    link = EmulatedLinkBackend(SingleProcessBackend(), bytes_per_s=1e6, latency_s=0.001)
    rows = torch.zeros(4, 8)
    handle = link.all_to_all(rows, [4], [4])
    # EP size 1: every row stays local, so only the latency is charged.
    assert (link.stats.num_bytes, link.stats.busy_s) == (0, 0.001)
    t0 = time.monotonic()
    assert handle.wait() is rows
    assert time.monotonic() - t0 <= 0.001 + 0.05
    assert link.reset_stats().num_transfers == 1 and link.stats.num_transfers == 0
    assert isinstance(link.inner.all_to_all(rows, [4], [4]), CompletedHandle)
    with pytest.raises(ValueError, match="bytes_per_s"):
        EmulatedLinkBackend(SingleProcessBackend(), bytes_per_s=0)
