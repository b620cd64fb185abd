"""The tests' CPU kernel of ``torch._scaled_mm`` (``tests/_cpu_fp8.py``) against PyTorch's own, and the
GPU kernel's refusals it adds."""

from __future__ import annotations

import pytest
import torch
from _cpu_fp8 import scaled_mm
from _warm import python

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (M, K, N, mat1 dtype, mat2 dtype, rowwise, bias, out dtype): the forms the pack and torchao call
CASES = [
    (48, 64, 32, E4M3, E4M3, False, False, torch.bfloat16),
    (40, 256, 48, E4M3, E4M3, False, False, torch.float32),
    (17, 128, 64, E4M3, E4M3, False, True, torch.bfloat16),
    (64, 96, 16, E4M3, E4M3, False, True, torch.float16),
    (32, 512, 32, E5M2, E4M3, False, False, torch.bfloat16),  # dL/dy (e5m2) @ W: the gradient matmuls
    (24, 64, 80, E4M3, E5M2, False, False, torch.float32),
    (48, 128, 32, E4M3, E4M3, True, False, torch.bfloat16),    # rowwise
    (33, 64, 48, E4M3, E4M3, True, True, torch.bfloat16),
]

_REAL = """
import sys, torch
cases = torch.load(sys.argv[1])
out = []
for c in cases:
    try:
        out.append(torch._scaled_mm(c["a"], c["b"], scale_a=c["sa"], scale_b=c["sb"], bias=c["bias"],
                                    out_dtype=c["dtype"]))
    except RuntimeError as e:  # torch 2.11's CPU kernel takes per-tensor scales only
        if c["sa"].numel() == 1 or "per-tensor" not in str(e):
            raise
        out.append(None)
torch.save(out, sys.argv[2])
"""


def _case(m, k, n, da, db, rowwise, bias, dtype, gen):
    a = (torch.randn(m, k, generator=gen) * 4).to(da)
    b = (torch.randn(n, k, generator=gen) * 2).to(db).t()  # column-major, as the GPU kernel wants it
    if rowwise:
        sa, sb = torch.rand(m, 1, generator=gen) + 0.01, torch.rand(1, n, generator=gen) + 0.01
    else:  # scales that are not powers of two, so their rounding shows
        sa, sb = torch.tensor(0.0123456), torch.tensor(0.0345678)
    return {"a": a, "b": b, "sa": sa, "sb": sb, "dtype": dtype,
            "bias": torch.randn(n, generator=gen).to(dtype) if bias else None}


def test_equals_pytorchs_cpu_kernel_to_rounding(tmp_path):
    """The same products as PyTorch's CPU kernel (run in an interpreter without the replacement), to fp32
    accumulation order: within about ten fp32 ulps of the sum of |products| (the two accumulate in
    different orders), and for a 16-bit output within one ulp, nearly every element equal."""
    gen = torch.Generator().manual_seed(0)
    cases = [_case(*c, gen) for c in CASES]
    torch.save(cases, tmp_path / "cases.pt")
    (tmp_path / "real.py").write_text(_REAL)
    proc = python([tmp_path / "real.py", tmp_path / "cases.pt", tmp_path / "real.pt"], cwd=tmp_path, timeout=300,
                  fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = torch.load(tmp_path / "real.pt")
    compared = 0
    for spec, c, want in zip(CASES, cases, real):
        if want is None:  # rowwise scales: PyTorch's CPU kernel has them from 2.13 on
            assert spec[5] and torch.__version__ < (2, 13), spec
            continue
        compared += 1
        got = scaled_mm(c["a"], c["b"], c["sa"], c["sb"], bias=c["bias"], out_dtype=c["dtype"])
        assert got.dtype == want.dtype == c["dtype"] and got.shape == want.shape, spec
        size = (c["a"].float().abs() * c["sa"]) @ (c["b"].float().abs() * c["sb"])  # sum of |products|
        if c["dtype"] == torch.float32:
            bound = 1e-6 * size + 1e-30
        else:  # one unit in the last place of the 16-bit result, plus the fp32 rounding under it
            bound = want.float().abs() * torch.finfo(c["dtype"]).eps + 1e-6 * size + 1e-30
        err = (got.float() - want.float()).abs()
        assert (err <= bound).all(), (spec, err.max().item())
        if c["dtype"] != torch.float32:  # the same products: rounded to 16 bits, nearly all are equal
            assert (err > 0).float().mean() < 0.05, spec
    assert compared >= sum(not spec[5] for spec in CASES)


def test_the_tests_run_it_in_place_of_pytorchs():
    """``torch._scaled_mm`` on CPU tensors is this kernel here (it refuses a row-major second operand,
    which PyTorch's CPU kernel accepts), and the operator is still ``aten._scaled_mm``."""
    a, b = torch.randn(32, 32).to(E4M3), torch.randn(32, 32).to(E4M3)
    one = torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="mat2 must be column-major"):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    assert counter.get_total_flops() == 2 * 32 * 32 * 32


@pytest.mark.parametrize("change,message", [
    (dict(b="row-major"), "mat2 must be column-major"),
    (dict(a="column-major"), "mat1 must be row-major"),
    (dict(k=24), "divisible by 16"),
    (dict(n=24), "divisible by 16"),
    (dict(da=E5M2, db=E5M2), "two Float8_e5m2"),
    (dict(da=torch.bfloat16), "expected Float8 operands"),
    (dict(scale_dtype=torch.bfloat16), "scales must be float32"),
    (dict(scale_shape="vector"), "invalid scaling configuration"),
    (dict(rowwise=True, dtype=torch.float32), "row-wise scaling writes bfloat16 only"),
    (dict(bias=torch.float32, dtype=torch.float32), "bias is not supported with a float32 output"),
    (dict(bias=torch.float16, dtype=torch.bfloat16), "the bias must have the output's dtype"),
])
def test_refuses_what_the_gpu_kernel_refuses(change, message):
    m, k, n = 32, change.get("k", 32), change.get("n", 32)
    a = torch.randn(m, k).to(change.get("da", E4M3))
    if change.get("a") == "column-major":
        a = a.t().contiguous().t()
    b = torch.randn(n, k).to(change.get("db", E4M3))
    b = b.t().contiguous() if change.get("b") == "row-major" else b.t()
    dtype = change.get("dtype", torch.bfloat16)
    if change.get("rowwise"):
        sa, sb = torch.ones(m, 1), torch.ones(1, n)
    elif change.get("scale_shape") == "vector":
        sa, sb = torch.ones(m), torch.ones(n)
    else:
        sa = sb = torch.tensor(1.0, dtype=change.get("scale_dtype", torch.float32))
    bias = torch.ones(n, dtype=change["bias"]) if "bias" in change else None
    with pytest.raises(RuntimeError, match=message):
        scaled_mm(a, b, sa, sb, bias=bias, out_dtype=dtype)
