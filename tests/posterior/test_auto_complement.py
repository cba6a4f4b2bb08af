"""The defaults: ``loss_scaling='sum'`` and ``complement='auto'``, resolved by ``fit`` to
'kron' where KFAC covers the model, else 'diag', else 'zero', with the reason."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from conftest import loader, mlp, output_jacobian, regression_data, train
from torch import nn

from laplace_glas import ActiveSubspaceLaplace, SubnetActiveSubspaceLaplace
from laplace_glas.curvature.complement.kfac_layers import kron_refusal

DOUBLE = torch.float64


def fitted(model, X, y, **kwargs):
    kwargs.setdefault("n_components", 3)
    la = ActiveSubspaceLaplace(model, "regression", sigma_noise=0.1, **kwargs)
    la.fit(loader(X, y, batch_size=16))
    return la


@pytest.fixture(scope="module")
def data():
    return regression_data(40, dtype=DOUBLE, d_in=2)


@pytest.fixture(scope="module")
def mlp_model(data):
    X, y = data
    return train(mlp([2, 6, 1], dtype=DOUBLE), X, y, steps=200)


def conv1d_model() -> nn.Module:
    """A Conv1d (BackPACK's diagonal covers it, curvlinops' KFAC does not)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Unflatten(1, (1, 2)), nn.Conv1d(1, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(3, 1)
    ).to(DOUBLE)


def glm(la, X):
    return la(X, pred_type="glm")


def test_the_defaults_are_sum_and_auto(mlp_model):
    la = ActiveSubspaceLaplace(mlp_model, "regression", n_components=3)
    assert la.loss_scaling == "sum"
    assert la.complement == "auto"
    assert la.complement_reason is None


def test_an_mlp_resolves_to_kron_and_equals_the_explicit_setting(mlp_model, data):
    X, y = data
    auto = fitted(mlp_model, X, y)
    assert auto.complement == "kron"
    assert "resolved to 'kron'" in auto.complement_reason
    assert "KFAC covers every trainable parameter" in auto.complement_reason
    explicit = fitted(mlp_model, X, y, loss_scaling="sum", complement="kron")
    assert explicit.complement_reason is None
    torch.testing.assert_close(auto._ggn_kron.kfacs, explicit._ggn_kron.kfacs, rtol=0, atol=0)
    for la in (auto, explicit):
        la.optimize_prior_precision()
    torch.testing.assert_close(auto.prior_precision, explicit.prior_precision, rtol=0, atol=0)
    for got, want in zip(glm(auto, X[:7]), glm(explicit, X[:7])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(auto.log_marginal_likelihood(), explicit.log_marginal_likelihood())
    # and it is not the old default's posterior
    old = fitted(mlp_model, X, y, loss_scaling="mean", complement="zero")
    old.prior_precision = auto.prior_precision
    assert not torch.allclose(glm(old, X[:7])[1], glm(auto, X[:7])[1])


def test_a_conv1d_resolves_to_the_mix_with_the_reason(data):
    X, y = data
    model = train(conv1d_model(), X, y, steps=100)
    assert kron_refusal(model) is not None and "Conv1d" in kron_refusal(model)
    auto = fitted(model, X, y)
    assert auto.complement == "kron_diag"
    assert "resolved to 'kron_diag'" in auto.complement_reason
    assert "not 'kron'" in auto.complement_reason and "Conv1d" in auto.complement_reason
    explicit = fitted(model, X, y, complement="kron_diag")
    torch.testing.assert_close(auto._ggn_diagonal, explicit._ggn_diagonal, rtol=0, atol=0)
    # the Conv1d's entries of the mix are those of the whole diagonal
    whole = fitted(model, X, y, complement="diag")
    conv = sum(len(block) == 0 for block in auto._ggn_kron.kfacs)
    sizes = [p.numel() for p in model.parameters()][:conv]
    torch.testing.assert_close(auto._ggn_diagonal, whole._ggn_diagonal[: sum(sizes)])
    for got, want in zip(glm(auto, X[:5]), glm(explicit, X[:5])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"nn\.Linear or nn\.Conv2d"):
        fitted(model, X, y, complement="kron")  # the explicit setting still refuses


def test_what_backpack_refuses_gets_the_per_example_diagonal(data):
    X, y = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 1)).to(DOUBLE)
    auto = fitted(model, X, y, complement="diag")
    _, J = output_jacobian(model, X)
    torch.testing.assert_close(auto._ggn_diagonal, torch.einsum("tcd,tcd->d", J, J))
    assert fitted(model, X, y).complement == "kron_diag"  # the default: KFAC where it reaches
    explicit = fitted(model, X, y, complement="diag")
    for got, want in zip(glm(auto, X[:5]), glm(explicit, X[:5])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_subnetwork_and_a_custom_loss_resolve_to_zero(mlp_model, data):
    X, y = data
    sub = SubnetActiveSubspaceLaplace(
        copy.deepcopy(mlp_model), "regression", torch.arange(12), n_components=3
    )
    assert sub.complement == "auto"
    sub.fit(loader(X, y, batch_size=16))
    assert sub.complement == "zero"
    assert "not available for SubnetActiveSubspaceLaplace" in sub.complement_reason
    custom = fitted(mlp_model, X, y, loss_fn=nn.MSELoss(reduction="sum"))
    assert custom.complement == "zero"
    assert "custom loss_fn" in custom.complement_reason
    explicit = fitted(mlp_model, X, y, loss_fn=nn.MSELoss(reduction="sum"), complement="zero")
    torch.testing.assert_close(glm(custom, X[:5])[1], glm(explicit, X[:5])[1], rtol=0, atol=0)


def test_a_structured_prior_at_fit_keeps_a_curvature_aware_complement(mlp_model, data):
    X, y = data
    layerwise = fitted(mlp_model, X, y, prior_precision=torch.ones(4, dtype=DOUBLE))
    assert layerwise.complement == "kron"
    D = layerwise.n_params
    per_weight = fitted(mlp_model, X, y, prior_precision=torch.ones(D, dtype=DOUBLE))
    assert per_weight.complement == "diag"  # KFAC's blocks take one value per tensor
    assert "takes a scalar or layerwise prior" in per_weight.complement_reason
    assert per_weight._ggn_kron is None  # no KFAC pass for nothing


def test_a_structured_prior_later_keeps_the_complement_without_a_warning(mlp_model, data):
    X, y = data
    la = fitted(mlp_model, X, y)
    zero = fitted(mlp_model, X, y, complement="zero")
    layerwise = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=DOUBLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la.prior_precision = layerwise
    assert la.complement == "kron"
    assert "resolved to 'kron'" in la.complement_reason
    zero.prior_precision = layerwise  # KFAC's complement adds variance off span(U)
    assert bool((glm(la, X[:5])[1] > glm(zero, X[:5])[1]).all())
    # laplace-torch's marglik over a layerwise prior runs on the 'kron' complement
    la.prior_precision = torch.ones(4, dtype=DOUBLE)  # where laplace-torch's ascent starts
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(prior_structure="layerwise", n_steps=5)
    assert la.complement == "kron" and la.prior_precision.shape == (4,)
    assert la.log_marginal_likelihood().item() > before


def test_the_state_keeps_the_resolved_complement(mlp_model, data):
    X, y = data
    la = fitted(mlp_model, X, y)
    la.optimize_prior_precision()
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["complement"] == "kron" and state["complement_setting"] == "auto"
    fresh = ActiveSubspaceLaplace(copy.deepcopy(mlp_model), "regression", n_components=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 'auto' agrees with the saved 'auto'
        fresh.load_state_dict(state)
    assert fresh.complement == "kron"
    assert fresh.complement_reason == la.complement_reason
    for got, want in zip(glm(fresh, X[:5]), glm(la, X[:5])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a state saved before 'auto' existed: the complement is explicit
    old = {k: v for k, v in state.items() if k not in ("complement_setting", "complement_reason")}
    older = ActiveSubspaceLaplace(copy.deepcopy(mlp_model), "regression", n_components=3)
    older.load_state_dict(old)
    assert older.complement == "kron" and older.complement_reason is None
    torch.testing.assert_close(glm(older, X[:5])[1], glm(la, X[:5])[1], rtol=0, atol=0)
    broken = dict(state, complement_setting="diag")
    with pytest.raises(ValueError, match="complement_setting"):
        older.load_state_dict(broken)
    assert older.complement == "kron"  # unchanged by the refused load


def test_an_unknown_complement_names_auto(mlp_model):
    with pytest.raises(ValueError, match="auto"):
        ActiveSubspaceLaplace(mlp_model, "regression", n_components=3, complement="kfac")


def test_kron_refusal_accepts_linear_layers(mlp_model):
    # data-parallel fits are served too: the factors are summed over the ranks
    # (tests/curvature/parallel/test_distributed.py)
    assert kron_refusal(mlp_model) is None


@pytest.mark.parametrize("value", ["kronn", None, 3])
def test_assigning_an_unknown_complement_is_refused_and_changes_nothing(mlp_model, data, value):
    X, y = data
    la = fitted(mlp_model, X, y)
    before = (la.complement, la.complement_reason)
    with pytest.raises((ValueError, TypeError), match="complement"):
        la.complement = value
    assert (la.complement, la.complement_reason) == before
