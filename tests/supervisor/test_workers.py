"""A worker's state moves only along the allowed transitions."""

from __future__ import annotations

import pytest

from modelpool.supervisor.workers import IllegalTransition, WorkerHandle, WorkerState

S = WorkerState


def handle(state: WorkerState) -> WorkerHandle:
    worker = WorkerHandle(worker_id=1, model_key="m", started_at=0.0)
    worker.state = state
    return worker


@pytest.mark.parametrize(("start", "end"), [
    (S.STARTING, S.LOADING), (S.LOADING, S.IDLE), (S.IDLE, S.BUSY), (S.BUSY, S.IDLE),
    (S.LOADING, S.HOLDING), (S.BUSY, S.STOPPING), (S.STOPPING, S.DEAD), (S.STARTING, S.DEAD),
])
def test_allowed_moves(start: WorkerState, end: WorkerState) -> None:
    worker = handle(start)
    worker.move_to(end)
    assert worker.state is end


@pytest.mark.parametrize(("start", "end"), [
    (S.DEAD, S.IDLE), (S.STOPPING, S.IDLE), (S.IDLE, S.LOADING), (S.HOLDING, S.BUSY),
    (S.STARTING, S.BUSY), (S.IDLE, S.IDLE), (S.DEAD, S.DEAD),
])
def test_impossible_moves_are_refused(start: WorkerState, end: WorkerState) -> None:
    worker = handle(start)
    with pytest.raises(IllegalTransition):
        worker.move_to(end)
    assert worker.state is start
