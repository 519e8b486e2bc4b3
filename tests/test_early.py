"""helpers.Early and in_own_process, which start the suite's slowest work in the background: values and errors come
back to the test that asks, whether the work ran in the background, inline or in a process of its own."""
import pytest
import torch

from helpers import Early, in_own_process


def tensor_work():
    return {"ones": torch.ones(3, 4, dtype=torch.float64), "threads": torch.get_num_threads()}


def failing_work():
    raise ValueError("bad config: 3 heads")


def test_result_runs_the_work_inline_once_and_raises_its_error_to_every_caller():
    calls = []
    ok = Early(lambda: calls.append(1) or 42)
    bad = Early(failing_work)
    Early.registry.remove(ok), Early.registry.remove(bad)          # never started by a session
    assert ok.result() == 42 and ok.result() == 42 and calls == [1]
    for _ in range(2):
        with pytest.raises(ValueError, match="3 heads"):
            bad.result()


def test_work_started_for_the_selected_tests_only():
    started = []
    mine = Early(lambda: started.append("mine"), used_by=["test_that_uses_it"])
    try:
        Early.start_for({(__name__, "another_test")})
        assert not mine.started
        Early.start_for({(__name__, "test_that_uses_it")})
        mine.result()
        assert started == ["mine"]
    finally:
        Early.registry.remove(mine)


def test_in_own_process_returns_values_by_value_and_raises_errors():
    got = in_own_process(tensor_work)
    assert torch.equal(got["ones"], torch.ones(3, 4, dtype=torch.float64)) and got["threads"] == 1
    with pytest.raises(ValueError, match="3 heads"):
        in_own_process(failing_work)
