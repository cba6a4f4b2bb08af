"""peft's LoRA layers with their Jacobian frozen (the linearised GGN's kept graphs)
against the layers' own values and derivatives, and the kept graphs' products against
the explicit GGN."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import first_derivatives, graph_node_names, output_jacobian
from torch import nn

from laplace_glas.autodiff import frozen_activations, frozen_lora
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.autodiff.frozen_activations import frozen_first_derivatives
from laplace_glas.autodiff.frozen_lora import is_frozen_lora
from laplace_glas.autodiff.frozen_norms import normalised_rows
from laplace_glas.curvature.operators.graph_bytes import SavedBytes
from laplace_glas.curvature.operators.linearized import LinearizedGGN, linearize_batch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

F64 = torch.float64
D_IN, D_OUT = 5, 3


class OneLayer(nn.Module):
    """One base layer, ``nn.Linear`` or GPT-2's ``Conv1D`` (``W`` stored as ``d_in x d_out``)."""

    def __init__(self, conv1d: bool):
        super().__init__()
        Conv1D = transformers.pytorch_utils.Conv1D
        self.proj = Conv1D(D_OUT, D_IN) if conv1d else nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        return self.proj(x)


def lora_layer(conv1d: bool = False, dtype=F64, **config) -> nn.Module:
    """A peft LoRA layer (r = 2, alpha 4) on a frozen base, ``lora_B`` off its zero start."""
    torch.manual_seed(0)
    config = {"lora_dropout": 0.0, **config}
    lora = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["proj"], fan_in_fan_out=conv1d, **config
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(OneLayer(conv1d), lora)
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.5)
    return layer.to(dtype).eval()


def _adapters(layer: nn.Module) -> list[torch.Tensor]:
    return [layer.lora_A["default"].weight, layer.lora_B["default"].weight]


@pytest.mark.parametrize("trained", ["A-and-B", "B-only"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["x-grad", "x-no-grad"])
@pytest.mark.parametrize("shape", [(4, D_IN), (2, 3, D_IN)], ids=["rows", "sequences"])
@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
def test_frozen_lora_keeps_values_and_first_derivatives(conv1d, shape, input_grad, trained):
    """Inside the block the layer gives its own values, and vector-Jacobian products
    (plain and recorded) and double-backward Jacobian-vector products equal to
    ``torch.func.jvp`` of the layer itself, through one frozen node; the recorded
    backward pass differentiates through its own node."""
    layer = lora_layer(conv1d)
    A, B = _adapters(layer)
    if trained == "B-only":
        A.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, dtype=F64).requires_grad_(input_grad)
    wanted = [t for t in (x, A, B) if t.requires_grad]
    u = torch.randn(*shape[:-1], D_OUT, generator=g, dtype=F64)
    v = {id(t): torch.randn(t.shape, generator=g, dtype=F64) for t in (x, A, B)}

    def layer_of(x_, A_, B_):
        names = ["lora_A.default.weight", "lora_B.default.weight"]
        return torch.func.functional_call(layer, dict(zip(names, (A_, B_), strict=True)), (x_,))

    tangents = tuple(v[id(t)] if t.requires_grad else torch.zeros_like(t) for t in (x, A, B))
    _, reference_jvp = torch.func.jvp(layer_of, (x.detach(), A.detach(), B.detach()), tangents)
    reference = layer(x)
    reference_vjp = torch.autograd.grad(reference, wanted, u)
    with frozen_first_derivatives(layer) as switched:
        out = layer(x)
        names = graph_node_names(out)
        tangents = [v[id(t)] for t in wanted]
        vjp, jvp, recorded_vjp, recorded_names = first_derivatives(out, wanted, u, tangents)
    assert switched == 1
    assert "_FrozenLoRABackward" in names and "_LoRAPullbackBackward" in recorded_names
    assert torch.equal(out, reference)
    for got, want in zip([*vjp, *recorded_vjp], [*reference_vjp, *reference_vjp], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(jvp, reference_jvp, rtol=1e-12, atol=1e-13)
    assert "forward" not in vars(layer)
    assert "_FrozenLoRABackward" not in graph_node_names(layer(x))


NORMS = {
    "layer": lambda: nn.LayerNorm(D_IN),
    "layer-no-affine": lambda: nn.LayerNorm(D_IN, elementwise_affine=False),
    "layer-no-bias": lambda: nn.LayerNorm(D_IN, bias=False),
    "rms": lambda: nn.RMSNorm(D_IN),
}


@pytest.mark.parametrize("norm_name", list(NORMS))
def test_a_lora_layer_after_a_frozen_norm_keeps_the_norm_s_tensors_not_its_output(norm_name):
    """``layer(norm(h))``: the LoRA layer's backward pass reads its input through the
    norm's kept tensors (``weight * (centred * rstd) + bias``), not the norm's output,
    with the same values and first derivatives as the two modules' own."""
    layer = lora_layer()
    A, B = _adapters(layer)
    torch.manual_seed(2)
    norm = NORMS[norm_name]().to(F64).requires_grad_(False)
    with torch.no_grad():  # off the ones / zeros start, so that weight and bias count
        for p in norm.parameters():
            p.add_(0.5 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    h = (1.0 + torch.randn(2, 3, D_IN, generator=g, dtype=F64)).requires_grad_(True)
    u = torch.randn(2, 3, D_OUT, generator=g, dtype=F64)
    v = [torch.randn(t.shape, generator=g, dtype=F64) for t in (h, A, B)]

    def composed(h_, A_, B_):
        names = ["lora_A.default.weight", "lora_B.default.weight"]
        return torch.func.functional_call(layer, dict(zip(names, (A_, B_))), (norm(h_),))

    _, reference_jvp = torch.func.jvp(composed, (h.detach(), A.detach(), B.detach()), tuple(v))
    reference = layer(norm(h))
    reference_vjp = torch.autograd.grad(reference, [h, A, B], u)
    with frozen_first_derivatives(nn.ModuleList([norm, layer])) as switched:
        x = norm(h)
        rows = normalised_rows(x)
        out = layer(x)
        vjp = torch.autograd.grad(out, [h, A, B], u, retain_graph=True)
        dummy = torch.zeros_like(out, requires_grad=True)
        recorded = torch.autograd.grad(out, [h, A, B], dummy, create_graph=True)
        (jvp,) = torch.autograd.grad(recorded, dummy, v)
    assert switched == 2 and rows is not None
    assert torch.equal(out, reference)
    kept = [t for t in out.grad_fn.saved_tensors if t is not None]
    output_storage = x.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != output_storage for t in kept)
    assert any(t is rows.centred or t.data_ptr() == rows.centred.data_ptr() for t in kept)
    for got, want in zip(vjp, reference_vjp, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(jvp, reference_jvp, rtol=1e-12, atol=1e-13)
    assert normalised_rows(layer(x.detach().requires_grad_(True))) is None


def test_norms_over_several_axes_give_no_rows():
    """A norm over the last two axes: its output is read as itself."""
    norm = nn.LayerNorm((3, D_IN)).to(F64)
    with frozen_first_derivatives(norm):
        x = norm(torch.randn(2, 3, D_IN, dtype=F64, requires_grad=True))
    assert normalised_rows(x) is None and x.grad_fn is not None


def test_a_norm_output_changed_in_place_is_read_as_itself():
    """``layer(norm(h).mul_(3))``: once changed in place the rows no longer describe the
    output; the LoRA layer keeps the output itself, with the composition's own
    gradients (the frozen layers' outputs may be changed in place, as by
    ``nn.ReLU(inplace=True)``)."""
    layer = lora_layer()
    A, B = _adapters(layer)
    norm = nn.LayerNorm(D_IN).to(F64)
    h = torch.randn(4, D_IN, dtype=F64, requires_grad=True)
    u = torch.randn(4, D_OUT, dtype=F64)
    own = torch.autograd.grad(layer(norm(h).mul_(3)), [h, A, B], u)
    with frozen_first_derivatives(nn.ModuleList([norm, layer])):
        x = norm(h)
        assert normalised_rows(x) is not None
        x.mul_(3)
        assert normalised_rows(x) is None
        out = layer(x)
        grads = torch.autograd.grad(out, [h, A, B], u)
    assert "_FrozenLoRABackward" in graph_node_names(out)
    for got, want in zip(grads, own, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def _two_adapters() -> nn.Module:
    layer = lora_layer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer.update_layer("other", 2, 4, config=peft.LoraConfig(r=2, lora_alpha=4))
    layer.set_adapter(["default", "other"])
    return layer.to(F64)


def _merged() -> nn.Module:
    layer = lora_layer()
    layer.merge()
    return layer


def _trained_base() -> nn.Module:
    layer = lora_layer()
    layer.base_layer.weight.requires_grad_(True)
    return layer


def _hooked() -> nn.Module:
    layer = lora_layer()
    layer.lora_A["default"].register_forward_hook(lambda module, args, out: 2 * out)
    return layer


LEFT_ALONE = {
    "forward-hook-on-lora_A": _hooked,
    "dora": lambda: lora_layer(use_dora=True),
    "lora-bias": lambda: lora_layer(lora_bias=True),
    "dropout-training": lambda: lora_layer(lora_dropout=0.5).train(),
    "two-adapters": _two_adapters,
    "merged": _merged,
    "trained-base": _trained_base,
    "float64-base-float32-adapters": lambda: _mixed_dtypes(),
    "bfloat16": lambda: lora_layer(dtype=torch.bfloat16),
    "nan-row (the check fails)": lambda: lora_layer(),
}


def _mixed_dtypes() -> nn.Module:
    layer = lora_layer()
    layer.lora_A.float()
    layer.lora_B.float()
    return layer


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_lora_layers_outside_the_plain_case_keep_their_own_forward(case):
    """DoRA, a LoRA bias, active dropout, two adapters, a merged layer, a trained base,
    mixed or half-precision dtypes, and a call whose output differs from
    ``base(x) + B(A(x)) s`` (a NaN): the layer's own forward, with its own graph and
    gradients."""
    layer = LEFT_ALONE[case]()
    dtype = layer.base_layer.weight.dtype
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(1)).to(dtype)
    if case.startswith("nan-row"):
        x[1, 2] = float("nan")
    x.requires_grad_(True)
    params = [x, *(p for p in layer.parameters() if p.requires_grad)]
    u = torch.randn(4, D_OUT).to(dtype)
    torch.manual_seed(5)
    own = torch.autograd.grad(layer(x), params, u, allow_unused=True)  # merged: A, B unused
    with frozen_first_derivatives(layer) as switched:
        torch.manual_seed(5)
        out = layer(x)
        grads = torch.autograd.grad(out, params, u, allow_unused=True)
    assert switched == 1
    assert "_FrozenLoRABackward" not in graph_node_names(out)
    for got, want in zip(grads, own, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_only_peft_lora_linear_layers_are_taken():
    """By exact type: peft's LoRA ``Linear``; not its embedding or a look-alike."""
    assert is_frozen_lora(lora_layer())
    assert not is_frozen_lora(nn.Linear(2, 2))
    assert not is_frozen_lora(type("Linear", (nn.Module,), {})())
    model = nn.Sequential(nn.Embedding(6, D_IN))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0"]))
    assert not is_frozen_lora(wrapped.base_model.model[0])


def _kept(model, params, X, y, monkeypatch, freeze_lora=True, norm_rows=True) -> tuple:
    """One batch linearised (sum-reduced MSE): the operator, its kept bytes and its
    graphs' node names; ``freeze_lora`` / ``norm_rows`` False switch the frozen LoRA
    layers / their reading of norm outputs off."""
    if not freeze_lora:
        monkeypatch.setattr(frozen_activations, "is_frozen_lora", lambda module: False)
    if not norm_rows:
        monkeypatch.setattr(frozen_lora, "normalised_rows", lambda x: None)
    counter = SavedBytes.beside(model)
    with autodiff_friendly(model):
        lin = linearize_batch(
            model, nn.MSELoss(reduction="sum"), params, X, y, num_data=len(X), counter=counter
        )
    monkeypatch.undo()
    assert not isinstance(lin, str), lin
    names = graph_node_names(lin.outputs) | graph_node_names(lin.pullback[0])
    return LinearizedGGN([lin], params, counter.bytes), counter.bytes, names


def _explicit_ggn(model, X) -> torch.Tensor:
    """The sum-reduced MSE's GGN ``2 J^T J`` from ``jacrev`` Jacobians."""
    _, J = output_jacobian(model, X)
    return 2.0 * torch.einsum("ncd,nce->de", J, J)


class LoRAMLP(nn.Module):
    """Linear -> LayerNorm -> Linear -> tanh -> RMSNorm -> Conv1D (2 outputs), LoRA on
    the three linear layers."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 8)
        self.norm = nn.LayerNorm(8)
        self.second = nn.Linear(8, 8)
        self.rms = nn.RMSNorm(8)
        self.head = transformers.pytorch_utils.Conv1D(2, 8)

    def forward(self, x):
        return self.head(self.rms(torch.tanh(self.second(self.norm(self.first(x))))))


def test_kept_graphs_with_frozen_lora_give_the_explicit_ggn_in_less_memory(monkeypatch):
    """The linearised operator's products with frozen LoRA layers equal the GGN formed
    from ``jacrev`` Jacobians (and the products through peft's own forward); its kept
    graphs take fewer bytes, as the layers after a norm keep the norm's tensors
    instead of its output."""
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["first", "second", "head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(LoRAMLP(), lora).to(F64).eval()
    with torch.no_grad():  # lora_B and the norms' weight and bias off their start
        for name, p in model.named_parameters():
            if "lora_B" in name or "norm" in name or "rms" in name:
                p.add_(0.5 * torch.randn_like(p))
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(16, 3, generator=g, dtype=F64), torch.randn(16, 2, generator=g, dtype=F64)

    frozen_op, frozen_bytes, frozen_names = _kept(model, params, X, y, monkeypatch)
    outputs_op, outputs_bytes, _ = _kept(model, params, X, y, monkeypatch, norm_rows=False)
    own_op, own_bytes, own_names = _kept(model, params, X, y, monkeypatch, freeze_lora=False)
    assert "_FrozenLoRABackward" in frozen_names and "_LoRAPullbackBackward" in frozen_names
    assert "_FrozenLoRABackward" not in own_names
    G = _explicit_ggn(model, X)
    V = torch.randn(G.shape[0], 3, generator=g, dtype=F64)
    with autodiff_friendly(model):
        for op in (frozen_op, outputs_op, own_op):
            torch.testing.assert_close(op @ V, G @ V, rtol=1e-10, atol=1e-12)
    # two norm outputs of 16 x 8 float64 numbers not kept
    assert frozen_bytes <= outputs_bytes - 2 * 16 * 8 * 8, (frozen_bytes, outputs_bytes)
    assert outputs_bytes <= own_bytes, (outputs_bytes, own_bytes)


class InPlaceLoRA(nn.Module):
    """LoRA Linear -> ReLU(inplace) -> LayerNorm -> SiLU(inplace) -> LoRA Conv1D."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 8)
        self.relu = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(8)
        self.silu = nn.SiLU(inplace=True)
        self.head = transformers.pytorch_utils.Conv1D(2, 8)

    def forward(self, x):
        return self.head(self.silu(self.norm(self.relu(self.first(x)))))


@pytest.mark.parametrize("trained", ["A-and-B", "B-only"])
def test_in_place_activations_and_untrained_adapters_give_the_explicit_ggn(trained, monkeypatch):
    """In-place activations keep their own graph (the frozen derivative would be taken
    after the input was overwritten) and may change a frozen layer's output in place;
    a norm output changed so is kept as itself. With ``lora_A`` not trained the kept
    graphs hold no more than peft's own (``x`` is kept for ``A``'s gradient only)."""
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["first", "head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(InPlaceLoRA(), lora).to(F64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
            if trained == "B-only" and "lora_A" in name:
                p.requires_grad_(False)
    assert not frozen_activations.is_elementwise_activation(nn.ReLU(inplace=True))
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(16, 3, generator=g, dtype=F64), torch.randn(16, 2, generator=g, dtype=F64)

    frozen_op, frozen_bytes, _ = _kept(model, params, X, y, monkeypatch)
    own_op, own_bytes, _ = _kept(model, params, X, y, monkeypatch, freeze_lora=False)
    G = _explicit_ggn(model, X)
    V = torch.randn(G.shape[0], 2, generator=g, dtype=F64)
    with autodiff_friendly(model):
        torch.testing.assert_close(frozen_op @ V, G @ V, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(own_op @ V, G @ V, rtol=1e-10, atol=1e-12)
    assert frozen_bytes <= own_bytes, (frozen_bytes, own_bytes)
