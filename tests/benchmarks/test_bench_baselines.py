"""The plain PyTorch loop both single-GPU harnesses time as their baseline (``_baselines.plain_training_loop``,
used by ``bench_gpt.py`` and ``bench_recipes.py``): it trains exactly as a hand-written loop over the
same batches does (clipping and schedule included), and its window holds the last ``steps`` steps."""

import pytest
import torch
from _baselines import plain_training_loop

STEPS, WARMUP, B, T, V = 3, 2, 4, 8, 17


class _LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, 16)
        self.head = torch.nn.Linear(16, V)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())


def _setup():
    torch.manual_seed(0)
    model = _LM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen))
               for _ in range(WARMUP + STEPS)]
    return model, opt, schedule, batches


def test_plain_loop_trains_as_a_hand_written_loop_and_times_the_last_steps():
    model, opt, schedule, batches = _setup()
    result = plain_training_loop(model, opt, iter(batches), steps=STEPS, warmup=WARMUP, device=torch.device("cpu"),
                                 tokens_per_step=B * T, amp=False, clip=0.1, schedule=schedule, profile_steps=1)

    ref, ref_opt, ref_schedule, _ = _setup()
    for x, y in batches:
        ref(x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_schedule.step()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 / (WARMUP + STEPS + 1))  # stepped after every step
    assert result["steps_timed"] == STEPS and result["tokens"] == STEPS * B * T
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["wall_s"], rel=1e-12)
    assert {s["step"] for s in result["slowest_steps"]} == set(range(WARMUP, WARMUP + STEPS))
    assert result["profile"]["steps"] == 1  # the last step, under torch.profiler


def test_plain_loop_without_clip_differs_and_refuses_an_empty_window():
    model, opt, _, batches = _setup()
    plain_training_loop(model, opt, iter(batches), steps=STEPS, warmup=WARMUP, device=torch.device("cpu"),
                        tokens_per_step=B * T, amp=False)
    clipped, clipped_opt, _, _ = _setup()
    plain_training_loop(clipped, clipped_opt, iter(batches), steps=STEPS, warmup=WARMUP,
                        device=torch.device("cpu"), tokens_per_step=B * T, amp=False, clip=1e-3)
    assert not torch.equal(model.head.weight, clipped.head.weight)
    with pytest.raises(ValueError, match="at least one timed step"):
        plain_training_loop(model, opt, iter(batches), steps=0, warmup=1, device=torch.device("cpu"),
                            tokens_per_step=1)
    with pytest.raises(ValueError, match="at most that many profiled"):
        plain_training_loop(model, opt, iter(batches), steps=2, warmup=0, device=torch.device("cpu"),
                            tokens_per_step=1, profile_steps=3)
