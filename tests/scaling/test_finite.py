"""Finiteness checks and unscaling: dense, sparse and mixed-dtype gradients, the read-only
check at scale 1 on CPU against the kernel path, and the dtype of the flag."""

from __future__ import annotations

import pytest
import torch

import mixprec as mp
from mixprec.scaling import finite as finite_module
from mixprec.scaling.finite import unscale_grads_


def test_unscale_grads_dense_sparse_and_mixed_dtypes():
    dense32 = torch.tensor([4.0, -8.0])
    dense_bf16 = torch.tensor([2.0, 6.0], dtype=torch.bfloat16)
    sparse = torch.sparse_coo_tensor([[0, 2]], torch.tensor([8.0, 16.0]), (4,)).coalesce()
    found = unscale_grads_([dense32, None, dense_bf16, sparse], 0.5)
    assert found.item() == 0.0 and found.dim() == 0
    assert dense32.tolist() == [2.0, -4.0]
    assert dense_bf16.tolist() == [1.0, 3.0]
    assert sparse.to_dense().tolist() == [4.0, 0.0, 8.0, 0.0]
    bad = torch.sparse_coo_tensor([[1]], torch.tensor([float("nan")]), (4,)).coalesce()
    assert unscale_grads_([dense32, bad], 1.0).item() == 1.0
    assert unscale_grads_([], 1.0).item() == 0.0


def test_all_finite():
    good = [torch.ones(3), torch.ones(2, dtype=torch.float16), None, torch.zeros(0)]
    assert bool(mp.all_finite(good))
    assert not bool(mp.all_finite([*good, torch.tensor([1.0, float("inf")])]))
    assert not bool(mp.all_finite([torch.tensor([float("nan")], dtype=torch.bfloat16)]))
    sparse = torch.sparse_coo_tensor([[0]], torch.tensor([float("inf")]), (3,))
    assert not bool(mp.all_finite([sparse]))
    assert mp.all_finite([torch.tensor([1, 2])]).dtype == torch.bool  # integers are finite


BIG = torch.finfo(torch.float32).max


@pytest.mark.parametrize("on_host", [True, False], ids=["cpu-read", "kernel"])
@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([[1.0, -2.0], [3.0]], True),
        ([[1.0, float("nan")], [3.0]], False),
        ([[1.0], [float("-inf"), 2.0]], False),
        ([[float("inf"), float("-inf")]], False),  # sums to NaN: still non-finite
        ([[BIG, BIG], [BIG]], True),  # finite values whose sum overflows float32
        ([[-BIG, -BIG]], True),
        ([[], [5.0]], True),
    ],
)
def test_scale_one_checks_read_only_and_exact(monkeypatch, values, finite, on_host):
    # At scale 1 on CPU the check reads per-tensor sums (no multiply-by-1 write); a sum
    # that overflows is confirmed value by value, so finite values are never a false alarm.
    if not on_host:
        monkeypatch.setattr(finite_module, "checks_on_host", lambda tensors: False)
    grads = [torch.tensor(v, dtype=torch.float32) for v in values]
    before = [g.clone() for g in grads]
    found = unscale_grads_(grads, 1.0)
    assert found.dtype == torch.float32 and found.dim() == 0
    assert found.item() == (0.0 if finite else 1.0)
    assert bool(mp.all_finite(grads)) is finite
    halves = [g.to(torch.float16) for g in grads]  # BIG becomes inf here
    assert bool(mp.all_finite(halves)) is all(bool(h.isfinite().all()) for h in halves)
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g.nan_to_num(), b.nan_to_num())  # not written


def test_the_cpu_check_flag_is_float32_whatever_the_default_dtype():
    # GradScaler's fused optimizer step takes a float32 flag only: the flag stays float32
    # under torch.set_default_dtype(float64).
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        found = unscale_grads_([torch.ones(3, dtype=torch.float32)], 1.0)
        assert found.dtype == torch.float32 and found.item() == 0.0
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("bad", [None, float("nan"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_groups_the_amp_kernel_refuses_are_checked_and_unscaled_as_it_would(
    monkeypatch, dtype, bad
):
    # CUDA's amp kernel refuses bfloat16 (an O3 model's gradients): the two-kernel fallback
    # must flag and unscale exactly as the kernel does, run here on CPU against it.
    def grads():
        g = torch.Generator().manual_seed(0)
        out = [torch.randn(5, 3, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype)]
        out.append(torch.empty(0, dtype=dtype))  # an FSDP2 shard can be empty
        if bad is not None:
            out[1][2] = bad
        return out

    kernel, fallback = grads(), grads()
    found_kernel = unscale_grads_(kernel, 1 / 96, device="cpu")
    monkeypatch.setattr(finite_module, "amp_kernel_takes", lambda device, dtype: False)
    found_fallback = unscale_grads_(fallback, 1 / 96, device="cpu")
    assert found_fallback.dtype == torch.float32 and found_fallback.dim() == 0
    assert found_fallback.item() == found_kernel.item() == (0.0 if bad is None else 1.0)
    for a, b in zip(fallback, kernel, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())  # the same rounding, bit for bit


def test_the_fallback_at_scale_one_flags_without_writing(monkeypatch):
    # bfloat16 on CUDA at scale 1 (O3's): the check alone, no multiply by 1 over every
    # gradient. Run on CPU with the host read and the amp kernel both ruled out.
    grads = [torch.randn(5, 3).bfloat16(), torch.randn(7).bfloat16()]
    grads[1][2] = float("inf")
    monkeypatch.setattr(finite_module, "checks_on_host", lambda tensors: False)
    monkeypatch.setattr(finite_module, "amp_kernel_takes", lambda device, dtype: False)
    multiplied = []
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *args: multiplied.append(args))
    before = [g.clone() for g in grads]
    assert unscale_grads_(grads, 1.0, device="cpu").item() == 1.0
    assert unscale_grads_(grads[:1], 1.0, device="cpu").item() == 0.0
    assert multiplied == [] and all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
    unscale_grads_(grads, 0.5, device="cpu")
    assert len(multiplied) == 1  # any other scale still multiplies


@pytest.mark.parametrize(
    ("values", "dtype", "finite"),
    [
        ([1e300, -2.0], torch.float64, True),  # finite in float64, inf once cast to float32
        ([1e300, float("inf")], torch.float64, False),
        ([3.3e38, -3.3e38], torch.bfloat16, True),  # near bfloat16's largest value
        ([1.0, float("nan")], torch.bfloat16, False),
        ([65504.0, -65504.0], torch.float16, True),
        ([1.0, float("-inf")], torch.float16, False),
    ],
)
def test_the_device_check_is_exact_in_every_dtype(monkeypatch, values, dtype, finite):
    # The path a GPU (or torch.compile) takes, run on CPU: the inf-norms. A float64 value
    # past float32's range was reported non-finite, as the norms were cast to float32.
    monkeypatch.setattr(finite_module, "checks_on_host", lambda tensors: False)
    grads = [torch.tensor(values, dtype=dtype), torch.ones(3, dtype=dtype)]
    assert bool(mp.all_finite(grads)) is finite
    monkeypatch.setattr(finite_module, "amp_kernel_takes", lambda device, dtype: False)
    assert unscale_grads_(grads, 1.0, device="cpu").item() == (0.0 if finite else 1.0)


def test_the_fallback_check_costs_the_same_whatever_the_number_of_gradients(monkeypatch):
    # O3's bfloat16 gradients on CUDA (the amp kernel refuses them): the check is a fixed
    # number of multi-tensor calls, not a cast, a stack and tests per gradient. It took
    # 49 kernels a step against autocast's 38 on an H200 (mlp-b64).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):  # the aten ops that run: one kernel each
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(finite_module, "checks_on_host", lambda tensors: False)
    monkeypatch.setattr(finite_module, "amp_kernel_takes", lambda device, dtype: False)
    counts = []
    for n in (2, 8):
        grads = [torch.randn(4, 3).bfloat16() for _ in range(n)]
        with Count() as mode:
            found = unscale_grads_(grads, 1.0, device="cpu")
        assert found.item() == 0.0
        counts.append(mode.calls)
    assert counts[0] == counts[1], counts
    assert len(counts[0]) <= 4, counts[0]  # the flag, the scale, the norms, the amp kernel
    # all_finite (O2 float16's check of its weights each step): the norms, a stack, one
    # comparison, all(); isfinite alone was four kernels.
    weights = [torch.randn(4, 3).half() for _ in range(8)]
    with Count() as mode:
        flag = mp.all_finite(weights)
    assert bool(flag) and len(mode.calls) <= 4, mode.calls
