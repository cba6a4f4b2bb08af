"""GLAS on the last layer and on a subnetwork against laplace-torch's dense posteriors.

In the ``k >= rank(G_S)`` limit with ``complement='prior'`` GLAS is laplace-torch's
``FullLLLaplace`` / ``FullSubnetLaplace``. The reference ``H`` is the exact summed
GGN ``J_S^T Lambda J_S`` from ``torch.func`` Jacobians (laplace-torch's own ``H``
carries float32 round-off, see ``test_equivalence.py``); the evidence is also compared
with the untouched laplace-torch object.
"""

from __future__ import annotations

import copy
import inspect
import math
import statistics
import warnings

import pytest
import torch
from conftest import explicit_jacobian, loader, mlp, pairwise_probit
from laplace import Laplace
from laplace.baselaplace import BaseLaplace
from laplace.laplace import _all_subclasses
from laplace.lllaplace import FullLLLaplace
from laplace.subnetlaplace import FullSubnetLaplace
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from laplace_glas import (
    ActiveSubspaceLaplace,
    LastLayerActiveSubspaceLaplace,
    SubnetActiveSubspaceLaplace,
)
from laplace_glas.diagnostics.calibration import (
    CoverageNotReachedWarning,
    coverage,
    select_dimension,
)

TAU = 0.7
SIGMA = 0.5
N = 4
LAST_LAYER = 12  # D_L of the regression net [3, 5, 2]; 18 for classification [3, 5, 3]
SUBNET = torch.tensor([0, 3, 7, 12, 15, 20, 21, 25, 28, 31])  # D_S = 10


def problem(likelihood):
    g = torch.Generator().manual_seed(2)
    C = 2 if likelihood == "regression" else 3
    model = mlp([3, 5, C], dtype=torch.float64)
    X = torch.randn(N, 3, generator=g, dtype=torch.float64)
    if likelihood == "regression":
        y = torch.randn(N, C, generator=g, dtype=torch.float64)
    else:
        y = torch.tensor([0, 1, 2, 1])
    Xtest = torch.randn(3, 3, generator=g, dtype=torch.float64)
    return model, X, y, Xtest


def exact_H(model, X, likelihood, columns):
    """sum_n J_{n,S}^T Lambda_n J_{n,S} (unit noise), independent of curvlinops."""
    J = explicit_jacobian(model, X)[:, columns]
    if likelihood == "regression":
        return J.T @ J
    with torch.no_grad():
        p = torch.softmax(model(X), -1)
    Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    Jn = J.reshape(X.shape[0], p.shape[1], -1)
    return torch.einsum("ncd,nce,nef->df", Jn, Lam, Jn)


def fitted(subset, likelihood, loss_scaling="sum", complement="prior"):
    model, X, y, Xtest = problem(likelihood)
    D = sum(p.numel() for p in model.parameters())
    sigma = SIGMA if likelihood == "regression" else 1.0
    common = {"sigma_noise": sigma, "prior_precision": TAU}
    temperature = float(N) if loss_scaling == "mean" else 1.0
    glas_kwargs = {"loss_scaling": loss_scaling, "complement": complement}
    if subset == "last_layer":
        glas = Laplace(
            model, likelihood, hessian_structure="glas", n_components=10, **common, **glas_kwargs
        )
        full = FullLLLaplace(model, likelihood, temperature=temperature, **common)
        n_last = sum(p.numel() for p in model[-1].parameters())
        columns = torch.arange(D - n_last, D)
    else:
        glas = SubnetActiveSubspaceLaplace(
            model, likelihood, SUBNET, n_components=9, **common, **glas_kwargs
        )
        full = FullSubnetLaplace(model, likelihood, SUBNET, temperature=temperature, **common)
        columns = SUBNET
    dl = loader(X, y, batch_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # null-space eigenvalues are flagged
        glas.fit(dl)
    full.fit(dl)
    evidence_as_fitted = full.log_marginal_likelihood().detach()
    full.H = exact_H(model, X, likelihood, columns)
    return glas, full, Xtest, evidence_as_fitted


CASES = [
    (subset, likelihood, scaling)
    for subset in ("last_layer", "subnetwork")
    for likelihood in ("regression", "classification")
    for scaling in ("sum", "mean")
]


@pytest.mark.parametrize(("subset", "likelihood", "loss_scaling"), CASES)
def test_equals_full_laplace_on_the_subset_at_full_rank(subset, likelihood, loss_scaling):
    glas, full, Xtest, evidence_as_fitted = fitted(subset, likelihood, loss_scaling)
    assert glas.n_params == full.H.shape[0]
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), evidence_as_fitted, rtol=1e-6, atol=0
    )
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-9, atol=0
    )
    torch.testing.assert_close(
        glas.posterior_covariance.to_dense(), full.posterior_covariance, rtol=1e-6, atol=1e-12
    )
    if likelihood == "regression":
        f_mu, f_var = glas(Xtest, pred_type="glm")
        ref_mu, ref_var = full(Xtest, pred_type="glm")
        torch.testing.assert_close(f_mu, ref_mu, rtol=1e-10, atol=0)
        torch.testing.assert_close(f_var, ref_var, rtol=1e-6, atol=1e-12)
    else:
        torch.testing.assert_close(
            glas(Xtest, link_approx="probit"),
            pairwise_probit(*full._glm_predictive_distribution(Xtest)),
            rtol=1e-6,
            atol=1e-12,
        )


@pytest.fixture
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_float32_subnetwork_under_a_float64_default_dtype(float64_default, likelihood):
    # laplace-torch's scalar prior_precision_diag takes the default dtype; the evidence
    # then mixed float32 and float64. Reference: the float64 network's dense posterior
    _, full, Xtest, _ = fitted("subnetwork", likelihood)
    model, X, y, _ = problem(likelihood)
    model = model.float()
    sigma = SIGMA if likelihood == "regression" else 1.0
    glas = SubnetActiveSubspaceLaplace(
        model,
        likelihood,
        SUBNET,
        n_components=9,
        sigma_noise=sigma,
        prior_precision=TAU,
        loss_scaling="sum",
        complement="prior",
    )
    y = y.float() if likelihood == "regression" else y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        glas.fit(loader(X.float(), y, batch_size=3))
    evidence = glas.log_marginal_likelihood()
    assert evidence.dtype == torch.float32 and glas.prior_precision_diag.dtype == torch.float32
    torch.testing.assert_close(evidence.double(), full.log_marginal_likelihood(), rtol=1e-4, atol=0)
    if likelihood == "regression":
        for got, want in zip(glas(Xtest.float()), full(Xtest, pred_type="glm")):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("subset", ["last_layer", "subnetwork"])
def test_restricted_posterior_keeps_the_evidence_and_projects_the_covariance(subset):
    glas, full, _, _ = fitted(subset, "regression", complement="zero")
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-9, atol=0
    )
    U = glas.eigenvectors
    torch.testing.assert_close(
        U.T @ full.posterior_covariance @ U,
        torch.diag(glas.posterior_variances),
        rtol=1e-7,
        atol=1e-12,
    )


def test_factory_default_subset_is_the_last_layer():
    model, X, y, _ = problem("regression")
    la = Laplace(model, "regression", hessian_structure="glas", n_components=3)
    assert type(la) is LastLayerActiveSubspaceLaplace
    assert la.n_params is None  # as LLLaplace: the last layer is found on the first batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=3))
    assert la.n_params == LAST_LAYER and la.eigenvectors.shape == (LAST_LAYER, 3)
    named = LastLayerActiveSubspaceLaplace(model, "regression", last_layer_name="2", n_components=3)
    assert named.n_params == LAST_LAYER  # known at construction
    keys = {c._key for c in _all_subclasses(BaseLaplace) if hasattr(c, "_key")}
    assert {("all", "glas"), ("last_layer", "glas"), ("subnetwork", "glas")} <= keys


def test_factory_refuses_subnetwork_glas_before_the_lookup():
    # laplace-torch's factory only lets 'full' / 'diag' through for subnetworks: the
    # registered class has to be constructed directly (documented in the module)
    with pytest.raises(ValueError, match="Subnetwork Laplace requires a full or diagonal"):
        Laplace(mlp([1, 4, 1]), "regression", "subnetwork", "glas", subnetwork_indices=SUBNET)


def test_n_components_is_checked_against_the_subset_size():
    model, X, y, _ = problem("regression")
    with pytest.raises(ValueError, match=r"n_components=10 must be smaller .* D=10"):
        SubnetActiveSubspaceLaplace(model, "regression", SUBNET, n_components=10)
    for k in (12, 40):  # 40 is beyond the whole network's D = 32 too: D_L is named
        la = Laplace(model, "regression", hessian_structure="glas", n_components=k)
        with pytest.raises(ValueError, match=rf"n_components={k} must be smaller .* D=12"):
            la.fit(loader(X, y, batch_size=3))
    with pytest.raises(ValueError, match=r"n_components=40 must be smaller .* D=12"):
        LastLayerActiveSubspaceLaplace(model, "regression", last_layer_name="2", n_components=40)
    with pytest.raises(ValueError, match="Subnetwork indices must lie between 0 and n_params=32"):
        SubnetActiveSubspaceLaplace(model, "regression", torch.tensor([0, 40]), n_components=1)


def test_subnetwork_samples_move_only_the_subnetwork_within_span_u():
    glas, _, _, _ = fitted("subnetwork", "regression", complement="zero")
    theta = torch.nn.utils.parameters_to_vector(glas.model.parameters()).detach()
    samples = glas.sample(50, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (50, theta.numel())
    outside = torch.ones_like(theta, dtype=torch.bool)
    outside[SUBNET] = False
    torch.testing.assert_close(samples[:, outside], theta[outside].expand(50, -1))
    delta = samples[:, SUBNET] - glas.mean
    U = glas.eigenvectors
    torch.testing.assert_close(delta @ U @ U.T, delta, rtol=0, atol=1e-12)


@pytest.mark.parametrize("subset", ["last_layer", "subnetwork"])
def test_nn_predictive_is_the_network_at_the_posterior_samples(subset):
    glas, _, Xtest, _ = fitted(subset, "regression")
    fs = glas.functional_samples(
        Xtest, pred_type="nn", n_samples=4, generator=torch.Generator().manual_seed(3)
    )
    thetas = glas.sample(4, generator=torch.Generator().manual_seed(3))
    model = problem("regression")[0]
    params = list(model[-1].parameters()) if subset == "last_layer" else list(model.parameters())
    for theta, f in zip(thetas, fs):
        vector_to_parameters(theta, params)
        with torch.no_grad():
            torch.testing.assert_close(f, model(Xtest), rtol=1e-12, atol=1e-12)


def test_calibration_truncates_the_last_layer_subspace():
    glas, _, _, _ = fitted("last_layer", "regression", complement="zero")
    _, X, y, _ = problem("regression")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 4 points: the nominal coverage is not reached
        selection = glas.calibrate(loader(X, y, batch_size=3), coverage=0.5, ks=[1, 2, 4])
    assert glas.n_components == selection.k and selection.k in (1, 2, 4)
    assert glas.eigenvectors.shape == (LAST_LAYER, selection.k)


def test_last_layer_state_dict_round_trip():
    glas, _, Xtest, _ = fitted("last_layer", "regression")
    model = problem("regression")[0]
    other = LastLayerActiveSubspaceLaplace(
        model,
        "regression",
        sigma_noise=SIGMA,
        n_components=10,
        complement="prior",
        loss_scaling="sum",
    )
    other.load_state_dict(glas.state_dict())
    for a, b in zip(other(Xtest), glas(Xtest)):
        torch.testing.assert_close(a, b)
    assert isinstance(other, ActiveSubspaceLaplace)


def test_subnetwork_state_dict_round_trip():
    glas, _, Xtest, _ = fitted("subnetwork", "classification")
    other = SubnetActiveSubspaceLaplace(
        problem("classification")[0],
        "classification",
        SUBNET,
        n_components=9,
        complement="prior",
        loss_scaling="sum",
    )
    other.load_state_dict(glas.state_dict())
    torch.testing.assert_close(other.mean, glas.mean)
    torch.testing.assert_close(other(Xtest), glas(Xtest))
    torch.testing.assert_close(other.log_marginal_likelihood(), glas.log_marginal_likelihood())


def calibration_data(likelihood, model, n=40):
    g = torch.Generator().manual_seed(11)
    X = torch.randn(n, 3, generator=g, dtype=torch.float64)
    with torch.no_grad():
        f = model(X)
    if likelihood == "regression":
        return X, f + SIGMA * torch.randn(f.shape, generator=g, dtype=torch.float64)
    return X, torch.distributions.Categorical(logits=f).sample()


@pytest.mark.parametrize("complement", ["zero", "prior"])
@pytest.mark.parametrize("include_noise", [False, True])
def test_subnetwork_glm_sweep_equals_its_own_predictive(complement, include_noise):
    """Each row of the subnetwork's regression sweep is the coverage of its own 'glm'
    predictive truncated to k at that prior precision."""
    glas, _, _, _ = fitted("subnetwork", "regression", complement=complement)
    Xc, yc = calibration_data("regression", problem("regression")[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CoverageNotReachedWarning)
        sel = select_dimension(
            glas,
            loader(Xc, yc, batch_size=16),
            0.8,
            ks=[1, 3, 6, 9],
            prior_precisions=[0.3, 2.0],
            pred_type="glm",
            include_noise=include_noise,
            empirical_bayes=False,
        )
    assert len(sel.rows) == 8
    z = statistics.NormalDist().inv_cdf(0.9)
    for row in sel.rows:
        view = copy.deepcopy(glas)
        view.n_components, view.prior_precision = row.k, row.prior_precision
        f, var = view(Xc, pred_type="glm")
        var = var.diagonal(dim1=-2, dim2=-1)
        half = z * (var + SIGMA**2 if include_noise else var).sqrt()
        expected = ((yc - f).abs() <= half).double().mean().item()
        assert row.coverage == pytest.approx(expected, abs=1e-12)
        assert row.mean_width == pytest.approx(2 * half.mean().item(), rel=1e-10)
        assert coverage(view, loader(Xc, yc), 0.8, include_noise=include_noise) == pytest.approx(
            expected, abs=1e-12
        )


@pytest.mark.parametrize("complement", ["zero", "prior"])
@pytest.mark.parametrize("pred_type", ["glm", "nn"])
def test_subnetwork_classification_sweep_by_hand(complement, pred_type):
    """Classification rows from the shared draws redone by hand: the subnetwork's
    weights ``mean + U_k (z / sqrt(a + tau)) + (I - U_k U_k^T) e / sqrt(tau)`` (the
    complement only for 'prior'), the others at the MAP; 'nn' evaluates the network
    there, 'glm' its linearisation (explicit Jacobian); credible sets of the mean
    softmax."""
    glas, _, _, _ = fitted("subnetwork", "classification", complement=complement)
    model = problem("classification")[0]
    Xc, yc = calibration_data("classification", model)
    S, ks, taus, level = 40, [2, 5, 9], [0.3, 2.0], 0.8
    sel = select_dimension(
        glas,
        loader(Xc, yc, batch_size=16),
        level,
        ks=ks,
        prior_precisions=taus,
        pred_type=pred_type,
        n_samples=S,
        generator=torch.Generator().manual_seed(5),
        empirical_bayes=False,
    )
    g = torch.Generator().manual_seed(5)
    z = torch.randn(S, max(ks), generator=g, dtype=torch.float64)
    e = torch.randn(S, len(SUBNET), generator=g, dtype=torch.float64)
    theta = parameters_to_vector(model.parameters()).detach()
    J = explicit_jacobian(model, Xc)  # (n C, D)
    with torch.no_grad():
        f0 = model(Xc)
    assert len(sel.rows) == len(ks) * len(taus)
    for row in sel.rows:
        view = copy.deepcopy(glas)
        view.n_components, view.prior_precision = row.k, row.prior_precision
        U, v = view.eigenvectors, view.posterior_variances
        sub = (z[:, : row.k] * v.sqrt()) @ U.T
        if complement == "prior":
            sub = sub + (e - (e @ U) @ U.T) / math.sqrt(row.prior_precision)
        delta = torch.zeros(S, theta.numel(), dtype=torch.float64)
        delta[:, SUBNET] = sub
        if pred_type == "glm":
            fs = f0 + (delta @ J.T).reshape(S, *f0.shape)
        else:
            fs = torch.stack(
                [torch.func.functional_call(model, unflat(model, theta + d), (Xc,)) for d in delta]
            ).detach()
        probs = torch.softmax(fs, -1).mean(0)
        order = probs.argsort(-1, descending=True)
        sorted_p = probs.gather(1, order)
        in_set = torch.zeros_like(probs, dtype=torch.bool).scatter(
            1, order, (sorted_p.cumsum(-1) - sorted_p) < level
        )
        expected = in_set.gather(1, yc[:, None]).double().mean().item()
        assert row.coverage == pytest.approx(expected, abs=1e-12)
        assert row.mean_width == pytest.approx(in_set.sum(-1).double().mean().item(), abs=1e-12)
        nll = -probs.gather(1, yc[:, None]).log().mean().item()
        assert row.nll == pytest.approx(nll, rel=1e-9)


def unflat(model, theta):
    out, i = {}, 0
    for name, p in model.named_parameters():
        out[name] = theta[i : i + p.numel()].reshape(p.shape)
        i += p.numel()
    return out


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_subnetwork_calibrate_applies_the_selection(likelihood):
    glas = fitted("subnetwork", likelihood, complement="prior")[0]
    Xc, yc = calibration_data(likelihood, problem(likelihood)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CoverageNotReachedWarning)
        sel = glas.calibrate(
            loader(Xc, yc, batch_size=16),
            0.8,
            ks=[1, 4, 9],
            prior_precisions=[0.3, 2.0],
            n_samples=30,
            generator=torch.Generator().manual_seed(0),
        )
    assert any(r.empirical_bayes for r in sel.rows)
    assert glas.n_components == sel.k and sel.k in (1, 4, 9)
    assert float(glas.prior_precision) == pytest.approx(sel.prior_precision)
    assert glas.eigenvectors.shape == (len(SUBNET), sel.k)
    assert glas.sample(3).shape[1] == sum(p.numel() for p in glas.model.parameters())


def test_last_layer_refuses_a_layerwise_prior_by_name():
    # found by a new-user trial: laplace-torch's LLLaplace failed later, at prediction
    model, X, y, Xtest = problem("regression")
    with pytest.raises(ValueError, match=r"no layerwise prior"):
        LastLayerActiveSubspaceLaplace(
            model,
            "regression",
            last_layer_name="2",
            n_components=3,
            prior_precision=torch.ones(2, dtype=torch.float64),
        )
    la = Laplace(
        model,
        "regression",
        hessian_structure="glas",
        n_components=3,
        prior_precision=torch.ones(2, dtype=torch.float64),
    )  # the last layer is not known yet: checked when fit finds it
    with pytest.raises(ValueError, match=r"no layerwise prior"):
        la.fit(loader(X, y, batch_size=3))
    la = LastLayerActiveSubspaceLaplace(model, "regression", last_layer_name="2", n_components=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=3))
    before, prediction = la.prior_precision.clone(), la(Xtest)
    with pytest.raises(ValueError, match=r"prior_structure='layerwise' is not available"):
        la.optimize_prior_precision(method="marglik", prior_structure="layerwise")
    assert torch.equal(la.prior_precision, before)
    for a, b in zip(prediction, la(Xtest)):
        torch.testing.assert_close(a, b)
    la.optimize_prior_precision(method="marglik", prior_structure="diag", n_steps=5)
    assert la.prior_precision.shape == (LAST_LAYER,)


def test_n_components_can_be_set_before_the_last_layer_is_found():
    model, X, y, _ = problem("regression")
    la = Laplace(model, "regression", hessian_structure="glas", n_components=3)
    la.n_components = 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=3))
    assert la.n_components == 5 and la.eigenvectors.shape == (LAST_LAYER, 5)


def test_a_subset_posterior_built_positionally_is_the_one_built_by_name():
    """The subset constructors bind their arguments to laplace-torch's own signatures
    (SubnetLaplace's, LLLaplace's): the same positional call means the same thing."""
    model = mlp([1, 16, 1])  # D = 49 > SUBNET's largest index
    positional = (model, "regression", SUBNET, SIGMA, TAU, 0.0, 1.0, None, None, None)
    reference = FullSubnetLaplace(*positional)  # laplace-torch reads the same tuple
    assert float(reference.sigma_noise) == SIGMA and reference.temperature == 1.0
    by_position = SubnetActiveSubspaceLaplace(
        *positional, dict_key_x="x", dict_key_y="y", n_components=3
    )
    by_name = SubnetActiveSubspaceLaplace(
        model=model, likelihood="regression", subnetwork_indices=SUBNET, sigma_noise=SIGMA,
        prior_precision=TAU, dict_key_x="x", dict_key_y="y", n_components=3,
    )  # fmt: skip
    for la in (by_position, by_name):
        assert (la.dict_key_x, la.dict_key_y, la.n_components) == ("x", "y", 3)
        assert float(la.sigma_noise) == SIGMA and float(la.prior_precision) == pytest.approx(TAU)
        assert torch.equal(la.subnetwork_indices, SUBNET)
    with pytest.raises(TypeError, match=r"SubnetActiveSubspaceLaplace.__init__\(\): too many"):
        SubnetActiveSubspaceLaplace(*positional, None)  # SubnetLaplace stops there
    with pytest.raises(TypeError, match="multiple values"):
        SubnetActiveSubspaceLaplace(*positional, sigma_noise=2.0)
    with pytest.raises(TypeError, match="n_component"):  # a misspelt GLAS keyword
        SubnetActiveSubspaceLaplace(*positional, n_component=3)
    shown = inspect.signature(SubnetActiveSubspaceLaplace)
    assert list(shown.parameters)[:10] == list(inspect.signature(FullSubnetLaplace).parameters)
    assert list(shown.parameters)[10:] == [
        "enable_backprop", "dict_key_x", "dict_key_y", "glas_kwargs"
    ]  # fmt: skip
    last = LastLayerActiveSubspaceLaplace(
        model, "regression", 1.0, 1.0, 0.0, 1.0, False, None, "x", "y", None, "2"
    )
    assert last._last_layer_name == "2" and last.dict_key_x == "x"


@pytest.mark.parametrize("subset", ["last_layer", "subnetwork"])
def test_subset_fit_takes_the_whole_network_fit_s_arguments(subset):
    """The subset classes hook into ``fit`` rather than restate it: ``process_group``
    reaches the data-parallel check, and ``override=False`` is refused by the last layer
    only (as by laplace-torch's LLLaplace)."""
    model, X, y, _ = problem("regression")
    dl = loader(X, y, batch_size=3)

    def build():
        if subset == "last_layer":
            return LastLayerActiveSubspaceLaplace(model, "regression", n_components=3)
        return SubnetActiveSubspaceLaplace(model, "regression", SUBNET, n_components=3)

    la = build()
    with pytest.raises(ValueError, match="process_group was given"):
        la.fit(dl, process_group=object())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(dl, process_group=None)
        plain = build()
        plain.fit(dl)
    torch.testing.assert_close(la.eigenvalues, plain.eigenvalues)
    assert la.mean.shape == (la.n_params,)
    if subset == "last_layer":
        with pytest.raises(ValueError, match="do not support `override=False`"):
            la.fit(dl, override=False)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la.fit(dl, override=False)  # an update of the stored curvature
        assert la.n_data == 2 * plain.n_data


def test_the_last_layer_fit_leaves_its_model_in_evaluation_mode():
    """As laplace-torch's LLLaplace.fit leaves its feature extractor (the whole-network
    fit gives the modes back); dropout is then off in ``la.model``."""
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
    ).double()
    X, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 1, dtype=torch.float64)
    reference = FullLLLaplace(model, "regression")
    reference.fit(loader(X, y, batch_size=4))
    la = LastLayerActiveSubspaceLaplace(model, "regression", n_components=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=4))
    assert not reference.model.training and not la.model.training
    assert torch.equal(la.model(X), la.model(X))
    whole = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole.fit(loader(X, y, batch_size=4))
    assert model.training  # the whole network's fit gives the user's mode back
