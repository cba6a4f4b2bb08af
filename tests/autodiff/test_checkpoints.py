"""Reentrant activation checkpointing in the differentiated forward passes: a segment
run without gradients that holds fitted parameters is refused by name (it gave silently
wrong curvature); everything else fits as before."""

from __future__ import annotations

import warnings

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from laplace_glas.autodiff.checkpoints import GradientsDisabledError, watch_reentrant_checkpoints
from tests.conftest import loader, output_jacobian


class Checkpointed(nn.Module):
    """``block`` under activation checkpointing (``reentrant=None``: none)."""

    def __init__(self, block: nn.Module, reentrant: bool | None):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


class CheckpointedLinear(nn.Linear):
    """A layer that checkpoints its own forward: its owner is called with gradients."""

    def __init__(self, d_in: int, d_out: int, reentrant: bool | None):
        super().__init__(d_in, d_out)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return super().forward(x)
        return checkpoint(super().forward, x, use_reentrant=self.reentrant)


class FunctionalSegment(nn.Module):
    """A segment that reads a layer's weights through ``F.linear``."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.fc, self.reentrant = nn.Linear(3, 8), reentrant

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.fc.weight, self.fc.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.inner(x)
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


class Scale(nn.Module):
    """A parameter outside ``weight``/``bias``: the factored operator refuses it."""

    def __init__(self, d: int):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def _first(kind: str, reentrant: bool | None) -> nn.Module:
    if kind == "module":
        return Checkpointed(nn.Sequential(nn.Linear(3, 8), nn.Tanh()), reentrant)
    if kind == "own forward":
        return nn.Sequential(CheckpointedLinear(3, 8, reentrant), nn.Tanh())
    return FunctionalSegment(reentrant)


def _network(reentrant: bool | None, scale: bool, kind: str = "module") -> nn.Sequential:
    torch.manual_seed(0)
    middle = [Scale(8)] if scale else []
    return nn.Sequential(_first(kind, reentrant), *middle, nn.Linear(8, 1)).double().eval()


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 3, generator=g, dtype=torch.float64)
    return loader(X, torch.sin(X.sum(1, keepdim=True)), batch_size=16)


def _fit(model: nn.Module, data, **options) -> Laplace:
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas", **options)
    la.n_components = 5
    la.fit(data)
    return la


def _explicit_top(model: nn.Module, data, k: int = 5) -> torch.Tensor:
    """Top eigenvalues of ``J^T J`` from ``jacrev`` Jacobians of ``model``'s trainable
    parameters over all of ``data``."""
    _, J = output_jacobian(model, torch.cat([x for x, _ in data]))
    J = J.reshape(-1, J.shape[-1])
    return torch.linalg.eigvalsh(J.T @ J).flip(0)[:k]


SHAPES = [
    pytest.param(kind, scale, id=f"{kind}-{'linearised' if scale else 'factored'}")
    for kind in ("module", "own forward", "functional")
    for scale in (False, True)
]


@pytest.mark.parametrize(("kind", "scale"), SHAPES)
def test_reentrant_segments_holding_fitted_parameters_are_refused_by_name(kind, scale):
    """Before, the linearised operator's fits were silently wrong (top eigenvalues
    127.8, 40.6, 26.8 against 146.8, 56.2, 41.6) and the factored operator raised
    torch's 'One of the differentiated Tensors does not require grad'."""
    with pytest.raises(
        GradientsDisabledError, match=r"parameters 0\.\S*weight.*use_reentrant=False"
    ):
        _fit(_network(True, scale, kind), _data())


@pytest.mark.parametrize("budget", ["100KB", None])
def test_the_streamed_linearisation_refuses_it_too(budget):
    with pytest.raises(GradientsDisabledError):
        _fit(_network(True, True), _data(), memory_budget=budget, solver="block")


@pytest.mark.parametrize(("kind", "scale"), SHAPES)
def test_non_reentrant_checkpointing_gives_the_explicit_ggn_s_spectrum(kind, scale):
    """laplace-torch's FullLaplace agrees with the explicit GGN to 2e-7 only here."""
    data = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no checkpoint warning, nothing else either
        la = _fit(_network(False, scale, kind), data)
    # the factored operator's first-batch check refuses weights read outside their layer
    factored = not scale and kind != "functional"
    assert la.lanczos_info.operator.startswith("factored" if factored else "linearised")
    reference = _explicit_top(_network(None, scale, kind), data)
    torch.testing.assert_close(la.eigenvalues * 64, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", [False, True], ids=["factored", "linearised"])
def test_a_reentrant_segment_without_fitted_parameters_fits_exactly(scale):
    """A frozen, checkpointed first layer: its segment runs without gradients and that
    is right; the fit equals the explicit GGN of the trainable parameters."""
    data = _data()
    model = _network(True, scale)
    model[0].requires_grad_(False)
    la = _fit(model, data)
    plain = _network(None, scale)
    plain[0].requires_grad_(False)
    reference = _explicit_top(plain, data)
    torch.testing.assert_close(la.eigenvalues * 64, reference, rtol=1e-10, atol=1e-12)


class Normalised(nn.Module):
    """A stop-gradient statistic of a fitted layer, without checkpointing."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(3, 8), nn.Linear(8, 1)

    def forward(self, x):
        with torch.no_grad():
            c = self.body(x).abs().mean()
        return self.head(torch.tanh(self.body(x)) / c)


def test_a_fitted_layer_run_under_no_grad_on_purpose_goes_to_the_linearised_operator():
    """The factored operator refuses the layer's call without a graph (it raised torch's
    'One of the differentiated Tensors does not require grad'); the linearised operator
    gives the explicit GGN of the network as written (the statistic a constant)."""
    torch.manual_seed(0)
    model, data = Normalised().double().eval(), _data()
    la = _fit(model, data)
    assert "a layer called without gradients" in la.lanczos_info.operator
    params = list(model.parameters())
    rows = []  # the statistic is per batch: Jacobian rows by reverse mode, batch by batch
    for x, _ in data:
        out = model(x)[:, 0]
        for i in range(len(x)):
            grads = torch.autograd.grad(out[i], params, retain_graph=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    J = torch.stack(rows)
    G = J.T @ J
    top = torch.linalg.eigvalsh(G).flip(0)[:5]
    torch.testing.assert_close(la.eigenvalues * 64, top, rtol=1e-10, atol=1e-12)
    # KFAC's pass failed on the no_grad call ('auto' moved on): it leaves no hook behind
    # (its hooks made every later forward without gradients raise, the predictive too)
    assert "not 'kron'" in la.complement_reason
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        model(x)
    assert la(x, pred_type="glm")[0].shape == (4, 1)


def test_kron_complement_of_weights_read_outside_their_layer():
    model, data = _network(None, False, "functional"), _data()
    with pytest.raises(ValueError, match=r"layer '0\.fc'.*never called as a module"):
        _fit(model, data, complement="kron")
    la = _fit(_network(None, False, "functional"), data)  # 'auto' moves on: the layer
    assert la.complement == "kron_diag"  # read functionally gets the GGN diagonal
    assert "never called as a module" in la.complement_reason
    assert [len(block) for block in la._ggn_kron.kfacs][:2] == [0, 0]


def test_the_watch_counts_segments_without_gradients_and_restores_torch():
    original = torch.utils.checkpoint.check_backward_validity
    x, w = torch.randn(2, 3), torch.randn(3, requires_grad=True)
    with watch_reentrant_checkpoints() as watch, pytest.warns(UserWarning, match="None of"):
        checkpoint(torch.tanh, x, use_reentrant=True)  # torch still warns, once a call
        checkpoint(torch.tanh, x, use_reentrant=True)
        checkpoint(torch.mul, x, w, use_reentrant=True)  # an input needs a gradient
        checkpoint(torch.tanh, x, use_reentrant=False)  # runs with gradients
        assert watch.segments == 2
    assert torch.utils.checkpoint.check_backward_validity is original
    watch.check(nn.Linear(1, 1), [])  # nothing missing: nothing raised
    layer = nn.Linear(1, 1)
    with pytest.raises(GradientsDisabledError, match=r"parameters weight, bias"):
        watch.check(layer, list(layer.parameters()))
    with pytest.raises(KeyError), watch_reentrant_checkpoints():
        raise KeyError
    assert torch.utils.checkpoint.check_backward_validity is original


def test_hugging_face_checkpointing_is_off_in_the_fit_s_evaluation_mode():
    """``gradient_checkpointing_enable`` checkpoints in training mode only; GLAS fits in
    evaluation mode, so a reentrant configuration fits, unchanged."""
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import DataLoader

    from laplace_glas.huggingface import LogitsModel

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, num_labels=3
    )
    config.pad_token_id = 0
    body = transformers.GPT2ForSequenceClassification(config)
    for name, p in body.named_parameters():
        p.requires_grad_("score" in name or "h.1." in name)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (24, 8), generator=g)
    labels = torch.randint(0, 3, (24,), generator=g)
    mask = torch.ones(8, dtype=torch.long)
    rows = [{"input_ids": ids[i], "attention_mask": mask, "labels": labels[i]} for i in range(24)]
    values = []
    for checkpointed in (False, True):
        if checkpointed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5
                body.gradient_checkpointing_enable({"use_reentrant": True})
        body.train()
        la = Laplace(
            LogitsModel(body), "classification", subset_of_weights="all", hessian_structure="glas"
        )
        la.n_components = 4
        la.fit(DataLoader(rows, batch_size=8))
        values.append(la.eigenvalues)
    torch.testing.assert_close(values[1], values[0], rtol=0, atol=0)


def test_the_predictive_of_a_non_reentrant_checkpointed_model_is_the_plain_model_s():
    """'glm' with complement='kron' forms the complement's Jacobians with ``jacrev``,
    which refuses the saved-tensor hooks of non-reentrant checkpointing ('don't yet
    support saved tensor hooks'); one backward pass per output row stands in."""
    data, X = _data(), torch.randn(5, 3, dtype=torch.float64)
    la = _fit(_network(False, False), data)
    plain = _fit(_network(None, False), data)
    assert la.complement == plain.complement == "kron"
    for ours, theirs in zip(la(X, pred_type="glm"), plain(X, pred_type="glm"), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("complement", ["kron", "zero"])
def test_the_predictive_of_a_frozen_reentrant_segment_is_the_plain_model_s(complement):
    """A reentrant checkpoint around a frozen first layer is an ``autograd.Function``
    without ``setup_context``, which every torch.func transform refuses: the 'glm'
    predictive raised torch's functorch error (``J U`` by ``jvp`` and the complement's
    Jacobians by ``jacrev``); one backward pass per output row stands in for both."""
    data, X = _data(), torch.randn(5, 3, dtype=torch.float64)
    fits = []
    for reentrant in (True, None):
        model = _network(reentrant, False)
        model[0].requires_grad_(False)
        fits.append(_fit(model, data, complement=complement))
    la, plain = fits
    assert la.complement == plain.complement == complement
    for ours, theirs in zip(la(X, pred_type="glm"), plain(X, pred_type="glm"), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale", [False, True], ids=["factored", "linearised"])
def test_a_subnetwork_outside_the_reentrant_segment_fits_exactly(scale):
    """The whole network's operator differentiates the segment's weights too, but the
    posterior over the last layer does not need them: no error, and the subnetwork's
    spectrum is the explicit GGN's of the last layer."""
    from torch.nn.utils import parameters_to_vector

    from laplace_glas.subsets import SubnetActiveSubspaceLaplace

    data, model = _data(), _network(True, scale)
    D = parameters_to_vector(model.parameters()).numel()
    la = SubnetActiveSubspaceLaplace(
        model, "regression", subnetwork_indices=torch.arange(D - 9, D), n_components=4
    )
    la.fit(data)
    plain = _network(None, scale)
    for p in list(plain.parameters())[:-2]:
        p.requires_grad_(False)
    reference = _explicit_top(plain, data, 4)
    torch.testing.assert_close(la.eigenvalues * 64, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reentrant", [True, False])
def test_alignment_of_a_checkpointed_frozen_segment_is_the_plain_model_s(reentrant):
    """alignment's per-example reverse mode (``torch.func.vjp``) is refused for both
    checkpoint kinds (no ``setup_context``; saved tensor hooks): one backward pass per
    output entry stands in, and the result is the plain model's."""
    from laplace_glas import alignment

    data, X = _data(), torch.randn(5, 3, dtype=torch.float64)
    results = []
    for kind in (reentrant, None):
        model = _network(kind, False)
        model[0].requires_grad_(False)
        la = _fit(model, data, complement="zero")
        results.append(alignment(la, X))
    ours, plain = results
    torch.testing.assert_close(ours.captured, plain.captured, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.total_variance, plain.total_variance, rtol=1e-10, atol=1e-12)
