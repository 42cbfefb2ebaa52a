"""kernels/group_sum.py against torch's two-pass expression (CPU: the interpreter; GPU: bf16
at a backward-sized shape)."""
import pytest
import torch

from gdn_fused.kernels.group_sum import ROWS, group_sum


def torch_group_sum(x, H, dtype):
    B, T, HV, K = x.shape
    return x.view(B, T, H, HV // H, K).sum(3).to(dtype)


# (B, T, H, HV, K): GVA ratios 1, 2, 3; K not a power of two; rows not a multiple of ROWS
@pytest.mark.parametrize("shape", [(1, 37, 2, 2, 32), (2, 21, 2, 4, 16), (1, 13, 3, 9, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_matches_torch(shape, dtype, x_dtype):
    """The partials in fp32 or (as the backward now stores them) in 16 bits: summed in fp32
    either way, so the fp32 sum of the same values."""
    B, T, H, HV, K = shape
    assert (B * T * H) % ROWS != 0
    x = torch.randn(B, T, HV, K, generator=torch.Generator().manual_seed(0)).to(x_dtype)
    got, ref = group_sum(x, H, dtype), torch_group_sum(x.float(), H, dtype)
    assert got.dtype == dtype and got.shape == (B, T, H, K)
    torch.testing.assert_close(got, ref, rtol=1e-6 if dtype == torch.float32 else 1e-3,
                               atol=1e-6)


def test_one_head_a_group_in_the_target_dtype_is_returned_as_is():
    x = torch.randn(1, 5, 3, 16, dtype=torch.float16)
    assert group_sum(x, 3, torch.float16) is x
    y = group_sum(x, 3, torch.float32)  # a cast still runs
    assert y.dtype == torch.float32 and torch.equal(y, x.float())


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_bf16_gpu(x_dtype):
    x = torch.randn(2, 1000, 32, 128, device="cuda").to(x_dtype)
    got = group_sum(x, 16, torch.bfloat16)
    ref = torch_group_sum(x.float(), 16, torch.bfloat16)
    # the same fp32 sums of two terms, rounded once: equal to the bit
    assert torch.equal(got, ref)


def test_refuses_what_it_cannot_index():
    x = torch.zeros(1, 4, 4, 32)
    with pytest.raises(ValueError, match="contiguous"):
        group_sum(x.transpose(1, 2), 2, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        group_sum(x, 3, torch.float32)
