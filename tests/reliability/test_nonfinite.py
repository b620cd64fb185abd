"""NonFiniteGuard: a NaN loss is caught on its step and handled by policy (fp32, one process).

- ``skip``: the final weights equal a run in which that batch took no optimizer step;
- ``rollback``: the weights go back to the last checkpoint (saved every 2 steps) and the
  run ends equal to one that skipped every batch since that checkpoint;
- ``rollback`` with ``max_rollbacks``: the rollback after the last allowed one stops training with
  ``NonFiniteError`` naming the step and the count;
- ``stop``: ``NonFiniteError`` naming the step, weights still finite;
- the flag itself: NaN / inf in the loss or any gradient, read from the queue at once on CPU.
The 2-rank behaviour (flag agreed over the ranks, rollback through sharded checkpoints) is
in ``test_crash_resume.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _harness import data, make_module, trainer

GB, SAMPLES = 4, 32  # 8 batches: one epoch


def _fit(guard=None, ckpt_dir: Path | None = None, **hooks):
    import lightning as L

    L.seed_everything(0, verbose=False)
    module = make_module(**hooks)
    t = trainer("auto", 1, steps=-1, ckpt_dir=ckpt_dir, callbacks=[guard] if guard else [], max_epochs=1)
    t.fit(module, data(GB, 1, SAMPLES))
    return module, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_flag_and_queue() -> None:
    from lightning_perf.parallel.reliability.numerics import FlagQueue, nonfinite_flag

    g = [torch.ones(3), torch.ones(2, 2, dtype=torch.bfloat16), None]
    assert nonfinite_flag(torch.tensor(1.0), g).item() == 0.0
    assert nonfinite_flag(torch.tensor(float("nan")), g).item() == 1.0
    g[1][0, 1] = float("inf")
    assert nonfinite_flag(torch.tensor(1.0), g).item() == 1.0
    assert nonfinite_flag(None, []).item() == 0.0
    q = FlagQueue()
    q.push(3, torch.tensor(1.0))
    q.push(4, torch.tensor(0.0))
    assert q.ready() == [(3, True), (4, False)] and len(q) == 0
    with pytest.raises(ValueError, match="max_pending"):
        FlagQueue(0)


def test_bad_policy_is_refused() -> None:
    from lightning_perf.callbacks import NonFiniteGuard

    with pytest.raises(ValueError, match="policy must be one of"):
        NonFiniteGuard("ignore")  # type: ignore[arg-type]


def test_skip_equals_a_run_without_that_step() -> None:
    from lightning_perf.callbacks import NonFiniteGuard

    guard = NonFiniteGuard("skip")
    with pytest.warns(UserWarning, match="global step 3: the optimizer step is skipped"):
        _, skipped = _fit(guard, nan_at={3})
    assert guard.bad_steps == [3]
    _, ref = _fit(skip_batches={3})
    _same(skipped, ref)


def test_rollback_restores_the_last_checkpoint_and_continues(tmp_path: Path) -> None:
    from lightning_perf.callbacks import NonFiniteGuard

    guard = NonFiniteGuard("rollback")
    # checkpoints after steps 2, 4, 6; NaN at step 5 -> back to step 4's weights and optimizer state
    with pytest.warns(UserWarning, match="global step 5: rolling back"):
        module, rolled = _fit(guard, ckpt_dir=tmp_path, nan_at={5})
    assert guard.bad_steps == [5]
    assert guard.rollbacks == [(5, str(tmp_path / "last.ckpt"))]
    # batches 4 (undone by the rollback) and 5 (NaN) leave no trace
    _, ref = _fit(skip_batches={4, 5})
    _same(rolled, ref)


def test_rollbacks_stop_after_max_rollbacks(tmp_path: Path) -> None:
    from lightning_perf.callbacks import NonFiniteError, NonFiniteGuard

    assert NonFiniteGuard("rollback").max_rollbacks == 3
    guard = NonFiniteGuard("rollback", max_rollbacks=2)
    # checkpoints after steps 2, 4, 6; NaN at 3 and 5: two rollbacks; NaN at 7: the third would exceed the limit
    with pytest.raises(NonFiniteError, match=r"global step 7 after 2 rollbacks \(max_rollbacks=2; at global steps "
                                             r"3, 5\): training stops instead of rolling back again") as info:
        with pytest.warns(UserWarning, match="rolling back"):
            _fit(guard, ckpt_dir=tmp_path, nan_at={3, 5, 7})
    assert info.value.step == 7
    assert [step for step, _ in guard.rollbacks] == [3, 5] and guard.bad_steps == [3, 5, 7]

    guard = NonFiniteGuard("rollback", max_rollbacks=0)
    with pytest.raises(NonFiniteError, match=r"global step 3 after 0 rollbacks \(max_rollbacks=0\)"):
        _fit(guard, ckpt_dir=tmp_path / "none", nan_at={3})
    assert guard.rollbacks == []
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_rollbacks must be an integer >= 0 or None"):
            NonFiniteGuard("rollback", max_rollbacks=bad)


def test_rollback_without_checkpoint_stops_with_a_message() -> None:
    from lightning_perf.callbacks import NonFiniteError, NonFiniteGuard

    with pytest.raises(NonFiniteError, match="global step 1 and no checkpoint to roll back to"):
        _fit(NonFiniteGuard("rollback"), nan_at={1})


def test_stop_names_the_step_before_the_update() -> None:
    from lightning_perf.callbacks import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard("stop")
    module = None
    with pytest.raises(NonFiniteError, match="global step 2 .policy 'stop'") as info:
        import lightning as L

        L.seed_everything(0, verbose=False)
        module = make_module(nan_at={2})
        trainer("auto", 1, steps=8, callbacks=[guard]).fit(module, data(GB, 1, SAMPLES))
    assert info.value.step == 2 and guard.bad_steps == [2]
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the NaN step never reached the weights
