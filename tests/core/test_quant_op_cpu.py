"""The quantising fused op's torch side without a GPU: its schema (the contract the fusion pass
builds to), the fake implementation's shapes under FakeTensor tracing, and the argument refusals
that need no GPU (ValueError naming the argument)."""
import pytest
import torch

from yali_vllm import _ext, ops
from yali_vllm.quant_schemes import SCHEME_GROUP, SCHEME_PER_TOKEN, SCHEME_STATIC

SCHEMA = ("yali::fused_allreduce_rmsnorm_quant(int comm, Tensor input, Tensor? residual, Tensor weight, float eps, "
          "Tensor(a!) quant_out, Tensor(b!)? residual_out, Tensor(c!) scale, int scheme, int group_size, "
          "bool scale_ue8m0) -> ()")


def _library():
    if _ext.library_error():
        pytest.skip(f"no YALI library: {_ext.library_error()}")
    _ext.ops()


def test_scheme_numbers_are_the_contracts():
    assert (SCHEME_STATIC, SCHEME_PER_TOKEN, SCHEME_GROUP) == (0, 1, 2)


def test_schema_is_the_contracts():
    _library()
    assert str(torch.ops.yali.fused_allreduce_rmsnorm_quant.default._schema) == SCHEMA


def test_fake_impl_checks_shapes_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _library()
    ops.register_fakes()
    with FakeTensorMode():
        x = torch.empty(4, 2048, dtype=torch.bfloat16)
        w = torch.empty(2048, dtype=torch.bfloat16)
        q = torch.empty(4, 2048, dtype=torch.float8_e4m3fn)
        s = torch.empty(4, 16, dtype=torch.float32)
        torch.ops.yali.fused_allreduce_rmsnorm_quant(0, x, x, w, 1e-6, q, torch.empty_like(x), s, SCHEME_GROUP, 128,
                                                     False)
        torch.ops.yali.fused_allreduce_rmsnorm_quant(0, x, None, w, 1e-6, q, None, s, SCHEME_GROUP, 128, True)
        with pytest.raises(Exception, match="quant_out"):
            torch.ops.yali.fused_allreduce_rmsnorm_quant(0, x, None, w, 1e-6, torch.empty(4, 1024,
                                                         dtype=torch.float8_e4m3fn), None, s, SCHEME_GROUP, 128, False)
        with pytest.raises(Exception, match="float8_e4m3fn"):
            torch.ops.yali.fused_allreduce_rmsnorm_quant(0, x, None, w, 1e-6, torch.empty_like(x), None, s,
                                                         SCHEME_STATIC, 128, False)


X = torch.empty(4, 2048, dtype=torch.bfloat16)
W = torch.empty(2048, dtype=torch.bfloat16)
Q = torch.empty(4, 2048, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("x,q,scale,scheme,group,arg", [
    (X, Q, torch.empty(1), 3, 128, "scheme"),
    (X.float(), Q, torch.empty(1), SCHEME_STATIC, 128, "input"),
    (X, Q.view(torch.uint8), torch.empty(1), SCHEME_STATIC, 128, "quant_out"),
    (X, Q[:2], torch.empty(1), SCHEME_STATIC, 128, "quant_out"),
    (X, Q, torch.empty(2), SCHEME_STATIC, 128, "scale"),
    (X, Q, torch.empty(1, dtype=torch.float64), SCHEME_STATIC, 128, "scale"),
    (X, Q, torch.empty(3, 1), SCHEME_PER_TOKEN, 128, "scale"),
    (X, Q, torch.empty(4, 16), SCHEME_GROUP, 96, "group_size"),
    (X[:, :1920], Q[:, :1920], torch.empty(4, 7), SCHEME_GROUP, 256, "group_size"),
    (torch.empty(4, 2112, dtype=torch.bfloat16), torch.empty(4, 2112, dtype=torch.float8_e4m3fn), torch.empty(4, 16),
     SCHEME_GROUP, 128, "group_size"),
    (X, Q, torch.empty(16, 4), SCHEME_GROUP, 128, "scale"),
])
def test_arguments_are_refused_naming_them(x, q, scale, scheme, group, arg):
    with pytest.raises(ValueError, match=rf"yali: {arg}\b"):
        ops.fused_allreduce_rmsnorm_quant(0, x, None, W, 1e-6, q, None, scale, scheme, group)


def test_dynamic_scale_outputs_have_the_contracts_shapes():
    assert ops.quant_scale_out(X, SCHEME_PER_TOKEN).shape == (4, 1)
    assert ops.quant_scale_out(X, SCHEME_GROUP, 128).shape == (4, 16)
    assert ops.quant_scale_out(X, SCHEME_GROUP, 64).shape == (4, 32)
