"""DDP's gradient-compression hooks as the simulator computes them (one process): fp16 and PowerSGD."""

import math
from types import SimpleNamespace

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_dist.algorithms.gradient_compression import PowerSGD, compressible, fp16_mean


def hook_compressed(gradient, world_size, monkeypatch):
    """What torch's ``fp16_compress_hook`` all-reduces for one rank's ``gradient`` bucket in a group of ``world_size``:
    its own code, run with ``all_reduce`` caught (and answered with the tensor it was given)."""
    caught = []

    class Work:
        def get_future(self):
            future = torch.futures.Future()
            future.set_result([caught[-1]])
            return future

    def all_reduce(tensor, group, async_op):
        caught.append(tensor)
        return Work()

    monkeypatch.setattr(default_hooks.dist, "all_reduce", all_reduce)
    group = SimpleNamespace(size=lambda: world_size)
    bucket = (gradient.clone(),)
    default_hooks.fp16_compress_hook(group, bucket)
    return caught[-1]


def test_fp16_casts_then_divides_in_float16_as_torchs_hook(monkeypatch):
    """torch's hook casts the bucket to float16, then divides it by the group's size (in float16), all-reduces the
    float16 sum and casts it back: the simulator's mean is that, bit for bit, on random gradients of many magnitudes
    (2 ranks: their float16 sum does not depend on the order), and per rank on more ranks."""
    generator = torch.Generator().manual_seed(0)
    for workers in (2, 3, 7):
        scales = [10.0 ** torch.randint(-8, 5, (4096,), generator=generator) for _ in range(workers)]
        gradients = [[torch.randn(4096, generator=generator) * scale] for scale in scales]
        compressed = [hook_compressed(gradient[0], workers, monkeypatch) for gradient in gradients]
        assert all(tensor.dtype == torch.float16 for tensor in compressed)
        total = torch.zeros(4096, dtype=torch.float16)
        for tensor in compressed:
            total += tensor
        (mean,) = fp16_mean(gradients)
        assert mean.dtype == torch.float32 and torch.equal(mean, total.float())


def test_an_fp16_gradient_above_65504_is_infinite_as_in_torchs_hook(monkeypatch):
    """70000 has no float16: cast first, it is inf before the division, as the hook makes it (divided first it was
    35000, finite)."""
    gradients = [[torch.tensor([1.0, 1e-5, 3.0])], [torch.tensor([2.0, 1e-5, 70000.0])]]
    (mean,) = fp16_mean(gradients)
    hooked = sum(hook_compressed(gradient[0], 2, monkeypatch) for gradient in gradients)
    assert torch.equal(mean, hooked.float())
    assert mean[2] == math.inf and torch.isfinite(mean[:2]).all()


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
