"""The communication stream (`worker.moe.a2a_stream.CommStreamBackend`) in one process:
submission order, where each call runs, errors, and DBO through it.

Over real gloo ranks it runs in tests/integration/test_dbo.py and
tests/integration/test_expert_parallel.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from worker.models.config import ModelConfig
from worker.models.moe import MoE
from worker.moe import ExpertParallelMoE, SingleProcessBackend
from worker.moe.a2a_stream import CommStreamBackend
from worker.moe.dbo import UBatchSplit, dbo_forward
from worker.moe.ubatch import run_ubatches

CONFIG = ModelConfig(hidden_size=32, num_experts=5, moe_intermediate_size=24, shared_expert_intermediate_size=16)


class _GatedBackend(SingleProcessBackend):
    """Logs (call, thread) and holds every count exchange until `release` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.release = threading.Event()
        self.release.set()
        self.fail_next = False

    def exchange_counts(self, send_counts):
        self.calls.append(("counts", threading.current_thread().name))
        assert self.release.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("peer lost")
        return super().exchange_counts(send_counts)

    def all_to_all(self, rows, send_counts, recv_counts):
        self.calls.append(("rows", threading.current_thread().name))
        return super().all_to_all(rows, send_counts, recv_counts)


def _stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("comm-stream")]


def test_outside_dbo_an_idle_stream_runs_calls_on_the_caller() -> None:
    before = _stream_threads()
    inner = _GatedBackend()
    stream = CommStreamBackend(inner)
    rows = torch.arange(6.0).reshape(3, 2)
    handle = stream.start_all_to_all_v(rows, [3])
    assert handle.recv_counts() == [3] and torch.equal(handle.wait(), rows)
    assert stream.exchange_counts([2]) == [2]
    assert torch.equal(stream.all_to_all(rows, [3], [3]).wait(), rows)
    assert inner.calls == [("counts", "MainThread"), ("rows", "MainThread"), ("counts", "MainThread"),
                           ("rows", "MainThread")]
    assert _stream_threads() == before  # no stream thread was started


def test_a_micro_batch_gets_its_handle_before_the_counts_are_exchanged() -> None:
    before = _stream_threads()
    inner = _GatedBackend()
    stream = CommStreamBackend(inner)
    rows = torch.ones(4, 2)
    seen: dict[str, object] = {}

    def body() -> None:
        inner.release.clear()
        handle = stream.start_all_to_all_v(rows, [4])
        seen["completed_at_start"] = handle.is_completed()
        # Submitted behind the held dispatch, so it must wait its turn on the stream.
        later = stream.all_to_all(rows * 2, [4], [4])
        inner.release.set()
        seen["counts"] = handle.recv_counts()
        seen["rows"] = (handle.wait(), later.wait())

    run_ubatches([body, lambda: None])
    assert seen["completed_at_start"] is False and seen["counts"] == [4]
    assert torch.equal(seen["rows"][0], rows) and torch.equal(seen["rows"][1], rows * 2)
    assert inner.calls == [("counts", "comm-stream-0"), ("rows", "comm-stream-0"), ("rows", "comm-stream-0")]
    stream.close()
    assert _stream_threads() == before


def test_a_failed_job_fails_its_handle_and_the_stream_goes_on() -> None:
    inner = _GatedBackend()
    stream = CommStreamBackend(inner)
    rows = torch.ones(2, 2)
    outs: list[object] = []

    def body() -> None:
        inner.fail_next = True
        failed = stream.start_all_to_all_v(rows, [2])
        ok = stream.start_all_to_all_v(rows, [2])
        with pytest.raises(ConnectionError, match="peer lost"):
            failed.wait()
        outs.append(ok.wait())

    run_ubatches([body, lambda: None])
    assert torch.equal(outs[0], rows)
    with pytest.raises(ValueError, match="do not split"):
        stream.start_all_to_all_v(rows, [3])
    stream.close()


@torch.no_grad()
def test_dbo_through_the_stream_equals_the_single_rank_moe() -> None:
    torch.manual_seed(0)
    moe = MoE(CONFIG)
    stream = CommStreamBackend(SingleProcessBackend())
    layer = ExpertParallelMoE.from_moe(CONFIG, moe, stream)
    x = torch.randn(9, CONFIG.hidden_size)
    for _ in range(50):
        torch.testing.assert_close(dbo_forward(layer, x, UBatchSplit(10, 5)), moe(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(layer(x), moe(x), atol=1e-5, rtol=0)
    stream.close()
