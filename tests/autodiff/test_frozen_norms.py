"""Layer and RMS normalisations with their Jacobian frozen (the linearised GGN's kept
graphs) against the modules' own values and derivatives."""

from __future__ import annotations

import pytest
import torch
from conftest import first_derivatives, graph_node_names
from torch import nn

from laplace_glas.autodiff import frozen_activations
from laplace_glas.autodiff.frozen_activations import frozen_first_derivatives
from laplace_glas.autodiff.frozen_norms import is_frozen_norm
from laplace_glas.curvature.operators.graph_bytes import SavedBytes
from laplace_glas.curvature.operators.linearized import LinearizedGGN, linearize_batch

F64 = torch.float64

NORMS = {
    "layer": lambda: nn.LayerNorm(6),
    "layer-2-axes": lambda: nn.LayerNorm((3, 6)),
    "layer-no-affine": lambda: nn.LayerNorm(6, elementwise_affine=False),
    "layer-no-bias": lambda: nn.LayerNorm(6, bias=False),
    "rms": lambda: nn.RMSNorm(6),
    "rms-2-axes-default-eps": lambda: nn.RMSNorm((3, 6)),
    "rms-no-affine": lambda: nn.RMSNorm(6, eps=1e-3, elementwise_affine=False),
}


def _norm(name: str) -> nn.Module:
    torch.manual_seed(0)
    norm = NORMS[name]().to(F64)
    with torch.no_grad():  # off the ones / zeros start, so that gamma and beta count
        for p in norm.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return norm


@pytest.mark.parametrize("batch", [(2, 4), ()], ids=["batched", "no-batch-axis"])
@pytest.mark.parametrize("name", list(NORMS))
def test_frozen_norms_keep_values_and_first_derivatives(name, batch):
    """Inside the block the module gives its own values, and vector-Jacobian products
    (plain and recorded) and double-backward Jacobian-vector products equal to
    torch.func.jvp of the module itself, through one frozen node in place of torch's
    normalisation kernels; also for an input without a batch axis (the parameters'
    gradients are then not summed)."""
    norm = _norm(name)
    g = torch.Generator().manual_seed(1)
    shape = (*batch, 3, 6) if batch else tuple(norm.normalized_shape)
    x = (3.0 + torch.randn(shape, generator=g, dtype=F64)).requires_grad_(True)
    params = [x, *norm.parameters()]
    u = torch.randn(shape, generator=g, dtype=F64)
    v = [torch.randn(p.shape, generator=g, dtype=F64) for p in params]

    def module_of(*inputs):
        values = dict(zip([n for n, _ in norm.named_parameters()], inputs[1:], strict=True))
        return torch.func.functional_call(norm, values, (inputs[0],))

    reference = norm(x)
    reference_vjp = torch.autograd.grad(reference, params, u)
    _, reference_jvp = torch.func.jvp(module_of, tuple(p.detach() for p in params), tuple(v))
    with frozen_first_derivatives(norm) as switched:
        out = norm(x)
        names = graph_node_names(out)
        # recorded_vjp: a recorded pass at a nonzero cotangent, the elementary ops, not
        # the fused kernel
        vjp, jvp, recorded_vjp, _ = first_derivatives(out, params, u, v)
    assert switched == 1
    assert "_FrozenNormalizationBackward" in names
    assert not any(n.startswith("NativeLayerNorm") or "RmsNorm" in n for n in names)
    assert torch.equal(out, reference)
    for got, want in zip(vjp, reference_vjp, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    for got, want in zip(recorded_vjp, reference_vjp, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(jvp, reference_jvp, rtol=1e-12, atol=1e-13)
    assert "forward" not in vars(norm)
    assert "_FrozenNormalizationBackward" not in graph_node_names(norm(x))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("norm", [nn.LayerNorm(6), nn.RMSNorm(6)], ids=["layer", "rms"])
def test_half_precision_and_mixed_dtype_norms_keep_their_own_kernels(norm):
    """A bfloat16 input, with bfloat16 or float32 parameters (autocast's case): torch's
    kernels compute the statistics in float32; the module is left as it is."""
    x = torch.randn(4, 6).to(torch.bfloat16).requires_grad_(True)
    for params_dtype in (torch.bfloat16, torch.float32):
        norm = norm.to(params_dtype)
        u = torch.randn(4, 6).to(torch.bfloat16)
        reference = torch.autograd.grad(norm(x), [x, *norm.parameters()], u)
        with frozen_first_derivatives(norm):
            out = norm(x)
            grads = torch.autograd.grad(out, [x, *norm.parameters()], u)
        assert "_FrozenNormalizationBackward" not in graph_node_names(out)
        for got, want in zip(grads, reference, strict=True):
            assert torch.equal(got, want)


def test_frozen_norms_leave_other_calls_and_types_alone():
    """No graph, extra arguments or a subclass: the module's own forward."""
    norm = _norm("layer")
    x = torch.randn(3, 6, dtype=F64)

    class Shifted(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) + 1

    assert is_frozen_norm(norm) and is_frozen_norm(nn.RMSNorm(4))
    assert not is_frozen_norm(Shifted(6)) and not is_frozen_norm(nn.GroupNorm(2, 6))
    for p in norm.parameters():
        p.requires_grad_(False)
    with frozen_first_derivatives(norm):
        assert norm(x).grad_fn is None  # nothing needs a graph
        names = graph_node_names(norm(x.requires_grad_(True)))
    assert "_FrozenNormalizationBackward" in names


class NormedMLP(nn.Module):
    """Linear -> LayerNorm -> tanh -> Linear -> RMSNorm -> Linear (2 outputs)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(3, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.RMSNorm(16),
            nn.Linear(16, 2),
        )  # fmt: skip

    def forward(self, x):
        return self.body(x)


def test_kept_graphs_with_frozen_norms_give_the_same_products_in_no_more_memory(monkeypatch):
    """The linearised operator's products with frozen normalisations equal the ones
    through torch's kernels, and its kept graphs take no more bytes."""
    torch.manual_seed(0)
    model = NormedMLP().to(F64)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(64, 3, generator=g, dtype=F64), torch.randn(64, 2, generator=g, dtype=F64)

    def kept(freeze_norms: bool):
        if not freeze_norms:
            monkeypatch.setattr(frozen_activations, "is_frozen_norm", lambda module: False)
        counter = SavedBytes.beside(model)
        lin = linearize_batch(
            model, nn.MSELoss(reduction="sum"), params, X, y, num_data=64, counter=counter
        )
        monkeypatch.undo()
        names = graph_node_names(lin.outputs) | graph_node_names(lin.pullback[0])
        return LinearizedGGN([lin], params, counter.bytes), counter.bytes, names

    frozen_op, frozen_bytes, frozen_names = kept(True)
    native_op, native_bytes, native_names = kept(False)
    assert "NativeLayerNormBackwardBackward0" in native_names
    assert "NativeLayerNormBackwardBackward0" not in frozen_names
    assert "_FrozenNormalizationBackward" in frozen_names
    V = torch.randn(frozen_op.shape[0], 3, generator=g, dtype=F64)
    torch.testing.assert_close(frozen_op @ V, native_op @ V, rtol=1e-10, atol=1e-12)
    assert frozen_bytes <= native_bytes, (frozen_bytes, native_bytes)


def test_hugging_face_rms_norms_written_as_llama_s_are_frozen_where_they_match():
    """``LlamaRMSNorm`` (float32 arithmetic): frozen on a float32 input, with its own
    values and first derivatives; left alone on a float64 input, whose output its
    float32 arithmetic rounds differently; Gemma's ``1 + weight`` norm and a look-alike
    outside transformers are not taken."""
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(6, eps=1e-5)
    with torch.no_grad():
        norm.weight.add_(0.5 * torch.randn(6))
    assert is_frozen_norm(norm) and not is_frozen_norm(GemmaRMSNorm(6))
    assert not is_frozen_norm(type("LlamaRMSNorm", (nn.Module,), {})())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 6, generator=g).requires_grad_(True)
    u = torch.randn(4, 3, 6, generator=g)
    v = [torch.randn(4, 3, 6, generator=g), torch.randn(6, generator=g)]
    reference = norm(x)
    reference_vjp = torch.autograd.grad(reference, [x, norm.weight], u)
    _, reference_jvp = torch.func.jvp(
        lambda x_, w: torch.func.functional_call(norm, {"weight": w}, (x_,)),
        (x.detach(), norm.weight.detach()),
        tuple(v),
    )
    with frozen_first_derivatives(norm) as switched:
        out = norm(x)
        vjp = torch.autograd.grad(out, [x, norm.weight], u, retain_graph=True)
        dummy = torch.zeros_like(out, requires_grad=True)
        recorded = torch.autograd.grad(out, [x, norm.weight], dummy, create_graph=True)
        (jvp,) = torch.autograd.grad(recorded, dummy, v)
    assert switched == 1 and "_FrozenNormalizationBackward" in graph_node_names(out)
    assert torch.equal(out, reference)
    for got, want in zip(vjp, reference_vjp, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(jvp, reference_jvp, rtol=1e-5, atol=1e-6)
    # left to its own forward, with its graph: a float64 input, a row the check fails (NaN)
    nan_row = x.detach().clone()
    nan_row[0, 0, 0] = float("nan")
    for module, inputs in ((norm.double(), x.detach().double()), (norm.float(), nan_row)):
        inputs.requires_grad_(True)
        own_grads = torch.autograd.grad(module(inputs), [inputs, module.weight], u.to(inputs))
        with frozen_first_derivatives(module):
            out = module(inputs)
            grads = torch.autograd.grad(out, [inputs, module.weight], u.to(inputs))
        assert "_FrozenNormalizationBackward" not in graph_node_names(out)
        for got, want in zip(grads, own_grads, strict=True):
            torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
