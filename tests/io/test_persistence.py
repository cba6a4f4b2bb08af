"""state_dict / load_state_dict: a fitted GLAS is restored without a refit, bit for bit."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import loader, mlp
from laplace import Laplace

from laplace_glas import ActiveSubspaceLaplace

K = 5
SIGMA = 0.1
TAU = 0.5
SEED = 7


@pytest.fixture(scope="module")
def reg_glas(toy_regression):
    model, X, y = toy_regression
    la = ActiveSubspaceLaplace(
        model,
        "regression",
        n_components=K,
        loss_scaling="mean",
        complement="zero",
        sigma_noise=SIGMA,
        prior_precision=TAU,
    )
    la.fit(loader(X, y))
    return la


@pytest.fixture(scope="module")
def X_test():
    return torch.linspace(-3, 3, 13).reshape(-1, 1)


def save_and_load(la, path):
    torch.save(la.state_dict(), path)
    return torch.load(path, weights_only=True)


def restored(la, state, **kwargs):
    kwargs.setdefault("n_components", K)
    fresh = ActiveSubspaceLaplace(copy.deepcopy(la.model), la.likelihood, **kwargs)
    fresh.load_state_dict(state)
    return fresh


def predictions(la, X):
    f_mu, f_var = la(X, pred_type="glm")
    nn_mu, nn_var = la(
        X,
        pred_type="nn",
        link_approx="mc",
        n_samples=20,
        generator=torch.Generator().manual_seed(SEED),
    )
    return {
        "glm_mean": f_mu,
        "glm_var": f_var,
        "nn_mean": nn_mu,
        "nn_var": nn_var,
        "eigenvalues": la.eigenvalues,
        "posterior_variances": la.posterior_variances,
        "lml": la.log_marginal_likelihood().detach(),
    }


def test_regression_round_trip_is_bit_identical(reg_glas, X_test, tmp_path):
    state = save_and_load(reg_glas, tmp_path / "glas.pt")
    # constructor defaults differ from the saved settings: the state wins (and says so)
    with pytest.warns(UserWarning, match=r"n_components 2 is replaced by the saved"):
        la = restored(reg_glas, state, n_components=2)
    assert la.n_components == K
    assert la.n_data == reg_glas.n_data == 100
    torch.testing.assert_close(la.sigma_noise, torch.tensor(SIGMA))
    torch.testing.assert_close(la.prior_precision, torch.tensor([TAU]))
    assert torch.equal(la.mean, reg_glas.mean)
    assert torch.equal(la.eigenvectors, reg_glas.eigenvectors)
    before, after = predictions(reg_glas, X_test), predictions(la, X_test)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert before["glm_var"].min() > 0  # a real posterior, not a degenerate one
    info, info2 = reg_glas.lanczos_info, la.lanczos_info
    assert info2.n_products == info.n_products
    assert torch.equal(info2.residuals, info.residuals)


def test_restored_posterior_supports_the_whole_api(reg_glas, X_test, tmp_path):
    la = restored(reg_glas, save_and_load(reg_glas, tmp_path / "glas.pt"))
    la.optimize_prior_precision()
    ref = copy.deepcopy(reg_glas)
    ref.optimize_prior_precision()
    torch.testing.assert_close(la.prior_precision, ref.prior_precision, rtol=0, atol=0)
    la.n_components = 3  # truncation works on a restored posterior ...
    assert la.eigenvalues.shape == (3,)
    with pytest.raises(ValueError, match=r"Only 5 eigenpairs were computed"):
        la.n_components = K + 1  # ... but not growing beyond what was saved
    samples = la.sample(4, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (4, reg_glas.n_params)


def test_state_dict_holds_only_weights_only_types(reg_glas):
    state = reg_glas.state_dict()

    def check(obj):
        if isinstance(obj, dict):
            for value in obj.values():
                check(value)
        elif isinstance(obj, (tuple, list)):
            for value in obj:
                check(value)
        else:
            assert isinstance(obj, (torch.Tensor, int, float, str, bool, type(None))), type(obj)

    check(state)
    assert state["loss_scaling"] == "mean"
    assert state["complement"] == "zero"
    assert state["n_components"] == K
    assert state["likelihood"] == "regression"


SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    from torch import nn

    from laplace_glas import ActiveSubspaceLaplace

    weights, state, inputs, out = sys.argv[1:5]
    model = nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(),
                          nn.Linear(50, 1))
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    la = ActiveSubspaceLaplace(model, "regression", n_components=5)
    la.load_state_dict(torch.load(state, weights_only=True))
    X = torch.load(inputs, weights_only=True)
    f_mu, f_var = la(X, pred_type="glm")
    nn_mu, nn_var = la(X, pred_type="nn", link_approx="mc", n_samples=20,
                       generator=torch.Generator().manual_seed(int(sys.argv[5])))
    torch.save({"glm_mean": f_mu, "glm_var": f_var, "nn_mean": nn_mu, "nn_var": nn_var,
                "eigenvalues": la.eigenvalues,
                "posterior_variances": la.posterior_variances,
                "lml": la.log_marginal_likelihood().detach()}, out)
    """
)


def test_restore_in_a_separate_process(reg_glas, X_test, tmp_path):
    paths = {name: tmp_path / f"{name}.pt" for name in ("weights", "state", "inputs", "out")}
    torch.save(reg_glas.model.state_dict(), paths["weights"])
    torch.save(reg_glas.state_dict(), paths["state"])
    torch.save(X_test, paths["inputs"])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *(str(p) for p in paths.values()), str(SEED)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = torch.load(paths["out"], weights_only=True)
    ours = predictions(reg_glas, X_test)
    assert set(theirs) == set(ours)
    for key, value in ours.items():
        torch.testing.assert_close(theirs[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_classification_round_trip(toy_classification, tmp_path):
    model, X, y = toy_classification
    la = ActiveSubspaceLaplace(
        model,
        "classification",
        n_components=6,
        loss_scaling="sum",
        complement="prior",
        prior_precision=2.0,
    )
    la.fit(loader(X, y))
    state = save_and_load(la, tmp_path / "glas_cls.pt")
    la2 = restored(la, state, loss_scaling="sum", complement="prior", n_components=6)
    assert la2.n_outputs == 3
    for link in ("probit", "bridge"):
        assert torch.equal(la(X, link_approx=link), la2(X, link_approx=link))
    for kwargs in (
        {"pred_type": "glm", "link_approx": "mc"},
        {"pred_type": "nn", "link_approx": "mc"},
    ):
        a = la(X, n_samples=10, generator=torch.Generator().manual_seed(SEED), **kwargs)
        b = la2(X, n_samples=10, generator=torch.Generator().manual_seed(SEED), **kwargs)
        assert torch.equal(a, b)
    assert torch.equal(la.log_marginal_likelihood(), la2.log_marginal_likelihood())
    assert torch.equal(la.posterior_variances, la2.posterior_variances)


def test_loss_scaling_and_complement_come_from_the_state(reg_glas, X_test, tmp_path):
    state = save_and_load(reg_glas, tmp_path / "glas.pt")
    with pytest.warns(UserWarning) as record:
        la = restored(reg_glas, state, loss_scaling="sum", complement="prior")
    messages = [str(w.message) for w in record]
    assert any("loss_scaling 'sum' is replaced by the saved 'mean'" in m for m in messages)
    assert any("complement 'prior' is replaced by the saved 'zero'" in m for m in messages)
    assert la.loss_scaling == "mean"
    assert la.complement == "zero"
    assert la.scaling_factor == 1.0
    assert torch.equal(la.posterior_variances, reg_glas.posterior_variances)
    assert torch.equal(la(X_test)[1], reg_glas(X_test)[1])


def test_no_warning_when_the_settings_agree(reg_glas, tmp_path):
    state = save_and_load(reg_glas, tmp_path / "glas.pt")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        restored(reg_glas, state, loss_scaling="mean", complement="zero")
    assert not [w for w in record if "replaced by the saved" in str(w.message)]


def test_sum_scaled_state_restores_the_sum_posterior(toy_regression, tmp_path):
    """The saved loss_scaling decides the posterior, not the constructor's."""
    _, X, y = toy_regression
    small = mlp([1, 8, 1])
    small.load_state_dict(mlp([1, 8, 1], seed=3).state_dict())
    la = ActiveSubspaceLaplace(
        small, "regression", n_components=4, loss_scaling="sum", sigma_noise=SIGMA
    )
    la.fit(loader(X, y))
    state = save_and_load(la, tmp_path / "glas_sum.pt")
    with pytest.warns(UserWarning, match=r"loss_scaling 'mean' is replaced by the saved 'sum'"):
        la2 = restored(la, state, n_components=4, loss_scaling="mean")
    assert la2.scaling_factor == 100.0
    assert torch.equal(la2.posterior_variances, la.posterior_variances)


def test_loading_into_a_model_with_another_number_of_parameters(reg_glas, tmp_path):
    state = save_and_load(reg_glas, tmp_path / "glas.pt")
    other = ActiveSubspaceLaplace(mlp([1, 20, 1]), "regression", n_components=K)
    with pytest.raises(ValueError, match=r"different number of parameters"):
        other.load_state_dict(state)


def test_loading_into_another_likelihood(reg_glas, tmp_path):
    state = save_and_load(reg_glas, tmp_path / "glas.pt")
    other = ActiveSubspaceLaplace(copy.deepcopy(reg_glas.model), "classification", n_components=K)
    with pytest.raises(ValueError, match=r"Different likelihoods"):
        other.load_state_dict(state)


def test_loading_a_full_laplace_state(toy_classification):
    model, X, y = toy_classification
    full = Laplace(model, "classification", subset_of_weights="all", hessian_structure="full")
    full.fit(loader(X, y))
    la = ActiveSubspaceLaplace(model, "classification", n_components=K)
    with pytest.raises(ValueError, match=r"Not a GLAS state dict"):
        la.load_state_dict(full.state_dict())


def test_load_into_another_dtype_converts_the_eigen_solve_record(reg_glas, tmp_path):
    """A float32 posterior loaded from a float64 fit holds float32 eigenpairs in
    lanczos_info too (the diagnostics multiply them with the model's products)."""
    model64 = copy.deepcopy(reg_glas.model).double()
    la64 = ActiveSubspaceLaplace(model64, "regression", n_components=K, sigma_noise=SIGMA)
    X = torch.linspace(-2, 2, 40, dtype=torch.float64).reshape(-1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la64.fit(loader(X, torch.sin(3 * X)))
    state = save_and_load(la64, tmp_path / "glas64.pt")
    la32 = restored(reg_glas, state)  # reg_glas's model: the same net in float32
    assert la32._dtype == torch.float32
    info = la32.lanczos_info
    for tensor in (info.values, info.vectors, info.residuals, info.raw_values):
        assert tensor.dtype == torch.float32
    assert la32.eigenvectors.dtype == torch.float32
    torch.testing.assert_close(info.values, la64.lanczos_info.values.float())


@pytest.mark.parametrize("key", ["values", "raw_values"])
def test_a_record_with_nan_eigenvalues_is_refused(reg_glas, key):
    state = reg_glas.state_dict()
    record = dict(state["eigenpairs"])
    record[key] = record[key].clone()
    record[key][0] = float("nan")
    state["eigenpairs"] = tuple(record.items())
    fresh = ActiveSubspaceLaplace(copy.deepcopy(reg_glas.model), "regression", n_components=K)
    with pytest.raises(ValueError, match=rf"\['eigenpairs'\]\['{key}'\] contains NaN"):
        fresh.load_state_dict(state)
    assert getattr(fresh, "H", None) is None  # nothing was assigned
