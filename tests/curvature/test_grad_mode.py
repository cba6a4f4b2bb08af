"""Modules that hold fitted parameters must run with gradients in the differentiated
forward passes (reentrant activation checkpointing gave silently wrong curvature)."""

from __future__ import annotations

import warnings

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.checkpoint import checkpoint

from laplace_glas.autodiff.grad_mode import (
    GradientsDisabledError,
    gradients_required,
    values_only,
)
from tests.conftest import loader


class Checkpointed(nn.Module):
    """``block`` under activation checkpointing (``reentrant=None``: none)."""

    def __init__(self, block: nn.Module, reentrant: bool | None):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


class Scale(nn.Module):
    """A parameter outside ``weight``/``bias``: the factored operator refuses it."""

    def __init__(self, d: int):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


def _network(reentrant: bool | None, scale: bool) -> nn.Sequential:
    torch.manual_seed(0)
    first = Checkpointed(nn.Sequential(nn.Linear(3, 8), nn.Tanh()), reentrant)
    middle = [Scale(8)] if scale else []
    return nn.Sequential(first, *middle, nn.Linear(8, 1)).double().eval()


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 3, generator=g, dtype=torch.float64)
    return loader(X, torch.sin(X.sum(1, keepdim=True)), batch_size=16)


def _fit(model: nn.Module, data) -> Laplace:
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    la.n_components = 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning about the reentrant segment
        la.fit(data)
    return la


def test_a_fitted_module_called_without_gradients_raises_naming_it():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    with gradients_required(model, list(model[1].parameters())):
        model(torch.randn(4, 2))  # with gradients: fine
        with torch.no_grad():
            model[0](torch.randn(4, 2))  # not fitted: not checked
            with pytest.raises(GradientsDisabledError, match=r"'1' \(Linear\).*use_reentrant"):
                model[1](torch.randn(4, 3))
        with values_only():  # a frozen module's own value check: let through
            assert not torch.is_grad_enabled()
            model(torch.randn(4, 2))
        with pytest.raises(GradientsDisabledError):  # and only inside that block
            with torch.no_grad():
                model(torch.randn(4, 2))
    with torch.no_grad():  # the hooks are gone after the block
        model(torch.randn(4, 2))


def test_a_block_entered_without_gradients_checks_nothing():
    model = nn.Linear(2, 1)
    with torch.no_grad(), gradients_required(model, list(model.parameters())):
        model(torch.randn(4, 2))
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("scale", [False, True], ids=["factored", "linearised"])
def test_reentrant_checkpointing_is_refused_with_the_module_named(scale):
    """Before the guard, the linearised operator's fit was silently wrong (a top
    eigenvalue 10-20% low: the segment's parameters had no curvature) and the factored
    operator raised torch's 'One of the differentiated Tensors does not require grad'."""
    with pytest.raises(GradientsDisabledError, match=r"'0\.block\.0' \(Linear\)"):
        _fit(_network(reentrant=True, scale=scale), _data())


@pytest.mark.parametrize("scale", [False, True], ids=["factored", "linearised"])
def test_non_reentrant_checkpointing_gives_the_explicit_ggn_s_spectrum(scale):
    """Against ``J^T J`` formed from ``jacrev`` Jacobians of the network without
    checkpointing (laplace-torch's FullLaplace agrees to 2e-7 only: it is the less exact)."""
    data = _data()
    la = _fit(_network(reentrant=False, scale=scale), data)
    assert la.lanczos_info.operator.startswith("linearised" if scale else "factored")
    plain = _network(reentrant=None, scale=scale)
    X = torch.cat([x for x, _ in data])
    params = {name: p.detach() for name, p in plain.named_parameters()}
    J = jacrev(lambda ps: functional_call(plain, ps, (X,)))(params)
    J = torch.cat([j.reshape(len(X), -1) for j in J.values()], 1)
    reference = torch.linalg.eigvalsh(J.T @ J).flip(0)[:5]
    torch.testing.assert_close(la.eigenvalues * len(X), reference, rtol=1e-10, atol=1e-12)


def test_hugging_face_checkpointing_is_off_in_the_fit_s_evaluation_mode():
    """``gradient_checkpointing_enable()`` checkpoints in training mode only (reentrant
    by default); GLAS fits in evaluation mode, so the fit runs and is unchanged."""
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
                body.gradient_checkpointing_enable()
        body.train()
        la = Laplace(
            LogitsModel(body), "classification", subset_of_weights="all", hessian_structure="glas"
        )
        la.n_components = 4
        la.fit(DataLoader(rows, batch_size=8))
        values.append(la.eigenvalues)
    torch.testing.assert_close(values[1], values[0], rtol=0, atol=0)
