"""DDP's gradient-compression hooks as the simulator computes them (one process): fp16 and PowerSGD."""

import torch

from lightning_dist.algorithms.gradient_compression import PowerSGD, compressible, fp16_mean


def test_fp16_divides_casts_and_sums_in_float16():
    gradients = [[torch.tensor([1.0, 1e-5, 3.0])], [torch.tensor([2.0, 1e-5, 70000.0])]]
    (mean,) = fp16_mean(gradients)
    expected = (torch.tensor([0.5, 5e-6, 1.5]).half() + torch.tensor([1.0, 5e-6, 35000.0]).half()).float()
    assert torch.equal(mean, expected) and mean.dtype == torch.float32


def test_which_gradients_powersgd_compresses():
    assert compressible(torch.Size([64, 64]), 1) and compressible(torch.Size([160, 4, 4]), 4)
    assert not compressible(torch.Size([160]), 1)  # a vector
    assert not compressible(torch.Size([4, 4]), 2)  # (4 + 4) * 2 * 2 = 32 >= 16: no gain


def test_plain_steps_first_then_a_rank_one_gradient_is_recovered_exactly():
    """Two plain all-reduces (start_iter=2), then rank 1: a mean gradient that is itself rank 1 is reproduced
    (P spans its column space), and a bias vector is always averaged as it is."""
    u, v = torch.randn(8), torch.randn(5)
    gradients = [[scale * torch.outer(u, v), torch.full((8,), scale)] for scale in (1.0, 3.0)]
    powersgd = PowerSGD([torch.Size([8, 5]), torch.Size([8])], workers=2, rank=1, start_iter=2)
    for _ in range(3):
        matrix, bias = powersgd.mean(gradients)
        assert torch.allclose(matrix, 2.0 * torch.outer(u, v), atol=1e-5) and torch.equal(bias, torch.full((8,), 2.0))
    assert powersgd.nbytes() == (8 + 5) * 1 * 4 + 8 * 4


def test_error_feedback_keeps_every_gradient_up_to_the_final_errors():
    """Full-rank gradients of 3 workers over 5 compressed steps: the applied means plus the workers' mean error equal
    the sum of the true mean gradients (each step's error is added to the next step's matrix)."""
    generator = torch.Generator().manual_seed(0)
    powersgd = PowerSGD([torch.Size([12, 10])], workers=3, rank=2, start_iter=0)
    applied, true = torch.zeros(12, 10), torch.zeros(12, 10)
    for _ in range(5):
        gradients = [[torch.randn(12, 10, generator=generator) * scale] for scale in (0.1, 1.0, 5.0)]
        (mean,) = powersgd.mean(gradients)
        applied += mean
        true += sum(g[0] for g in gradients) / 3
        assert not torch.allclose(mean, sum(g[0] for g in gradients) / 3, atol=1e-3)  # rank 2 of 10: lossy
    errors = sum(powersgd.errors[0, worker] for worker in range(3)) / 3
    assert torch.allclose(applied + errors, true, atol=1e-4)
