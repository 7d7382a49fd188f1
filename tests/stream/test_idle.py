"""The device-idle split of a wait (jaxstream.stream.idle), on a fake clock: deterministic."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxstream.stream import idle


class FakeClock:
    """perf_counter that advances only by the waits' timeouts."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(idle.time, "perf_counter", c.perf_counter)
    return c


def waiter(clock: FakeClock, after: float):
    done_at = clock.now + after

    def wait(timeout):
        if timeout is None or clock.now + timeout >= done_at:
            clock.now = max(clock.now, done_at)
            return True
        clock.now += timeout
        return False
    return wait


def test_busy_until_the_dispatched_work_is_ready_then_idle(clock, monkeypatch):
    token = object()
    monkeypatch.setattr(idle, "ready", lambda v: v is token and clock.now >= 0.004)
    busy, rest = idle.split_wait(waiter(clock, 0.010), lambda: token)
    assert busy == pytest.approx(0.004, abs=idle.SLICE_S)
    assert busy + rest == pytest.approx(0.010)


def test_work_never_ready_within_the_wait_is_all_busy(clock, monkeypatch):
    monkeypatch.setattr(idle, "ready", lambda v: False)
    busy, rest = idle.split_wait(waiter(clock, 0.003), lambda: "values")
    assert (busy, rest) == (pytest.approx(0.003), pytest.approx(0.0))


def test_nothing_dispatched_is_all_idle(clock):
    busy, rest = idle.split_wait(waiter(clock, 0.002), None)
    assert (busy, rest) == (0.0, pytest.approx(0.002))
    busy, rest = idle.split_wait(waiter(clock, 0.004), lambda: jnp.ones(3) + 1)
    assert busy <= idle.SLICE_S and busy + rest == pytest.approx(0.004)


def test_the_step_reports_disjoint_device_idle_causes(tmp_path):
    """A streamed step's device-idle causes are parts of its main-thread waits."""
    import jax
    import optax

    import jaxstream.grad as jg
    from jaxstream.models import mlp
    from jaxstream.stream import LayerStore, StreamConfig, StreamedExecutor

    stack = mlp(in_dim=8, width=16, depth=3, num_classes=4)
    sgd = optax.sgd(0.1)
    store = LayerStore.create(tmp_path / "s", stack.init(jax.random.key(0)), optimizer=sgd)
    ex = StreamedExecutor(stack, jg.backprop(), sgd, store,
                          StreamConfig(compute_dtype="float32"))
    batch = {"x": jax.random.normal(jax.random.key(1), (2, 4, 8)),
             "y": jnp.zeros((2, 4), jnp.int32)}
    m = ex.step(batch, jax.random.key(2))
    assert 0.0 <= m["stall_idle_s"] <= m["stall_s"]
    assert 0.0 <= m["wait_update_idle_s"] <= m["wait_update_s"]
    assert m["device_idle_s"] == pytest.approx(
        m["stall_idle_s"] + m["wait_update_idle_s"] + m["wait_commit_s"])
    assert m["device_idle_s"] <= m["idle_s"] + 1e-9
