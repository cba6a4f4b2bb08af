"""Every bad input raises the documented exception with a message that says what is wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import loader, mlp, regression_data
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas import ActiveSubspaceLaplace, NotFittedError

D_SMALL = 13  # mlp([1, 4, 1]): 4 + 4 + 4 + 1


def small_model() -> nn.Module:
    return mlp([1, 4, 1]).eval()


def small_classifier() -> nn.Module:
    return mlp([2, 4, 3]).eval()


@pytest.fixture(scope="module")
def reg_data():
    return regression_data(20)


@pytest.fixture(scope="module")
def cls_data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(24, 2, generator=g)
    y = torch.arange(3).repeat(8)
    return X, y


@pytest.fixture
def fitted(reg_data):
    """A freshly fitted GLAS (function scope: some tests change its state)."""
    X, y = reg_data
    la = ActiveSubspaceLaplace(small_model(), "regression", n_components=3)
    la.fit(loader(X, y, batch_size=8))
    return la


def glas(model=None, likelihood="regression", **kwargs):
    kwargs.setdefault("n_components", 2)
    model = model if model is not None else small_model()
    return ActiveSubspaceLaplace(model, likelihood, **kwargs)


# ---------------------------------------------------------------- constructor arguments
@pytest.mark.parametrize("k", [0, -3])
def test_n_components_below_one(k):
    with pytest.raises(ValueError, match=r"n_components must be >= 1"):
        glas(n_components=k)


@pytest.mark.parametrize("k", [D_SMALL, D_SMALL + 1, 10_000])
def test_n_components_not_below_d_points_to_the_default_and_full_laplace(k):
    with pytest.raises(ValueError, match=r"the default min\(20, D - 1\)") as info:
        glas(n_components=k)
    message = str(info.value)
    assert f"D={D_SMALL}" in message
    assert "FullLaplace" in message


def test_largest_allowed_n_components_is_d_minus_one():
    la = glas(n_components=D_SMALL - 1)
    assert la.n_components == D_SMALL - 1


@pytest.mark.parametrize("k", [2.0, "3", True, torch.tensor(2)])
def test_n_components_must_be_an_int(k):
    with pytest.raises(TypeError, match=r"n_components must be an int"):
        glas(n_components=k)


def test_n_components_none_is_the_default():
    """``None`` (the constructor's default) means ``min(20, D - 1)``: 12 for D = 13."""
    assert glas(n_components=None).n_components == 12
    assert glas(mlp([1, 8, 1]), n_components=None).n_components == 20  # D = 25


@pytest.mark.parametrize("scaling", ["avg", "MEAN", "", None])
def test_unknown_loss_scaling(scaling):
    with pytest.raises(ValueError, match=r"loss_scaling must be 'mean'.*or 'sum'"):
        glas(loss_scaling=scaling)


@pytest.mark.parametrize("complement", ["full", "Prior", None])
def test_unknown_complement(complement):
    with pytest.raises(
        ValueError, match=r"complement must be one of 'auto', 'zero', 'prior', 'diag'"
    ):
        glas(complement=complement)


def test_unknown_likelihood_is_rejected():
    # 'reward_modeling' is supported (tests/test_reward_modeling.py)
    with pytest.raises(
        ValueError,
        match=r"likelihood must be one of 'regression', 'classification', 'reward_modeling'",
    ):
        glas(likelihood="poisson")


def test_model_without_parameters():
    with pytest.raises(ValueError, match=r"no parameters that require grad"):
        glas(nn.Sequential(nn.Tanh()), n_components=1)


def test_model_with_frozen_parameters_only():
    model = small_model()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"no parameters that require grad"):
        glas(model, n_components=1)


def test_frozen_parameters_do_not_count_towards_d():
    model = small_model()
    model[0].weight.requires_grad_(False)  # D = 13 - 4 = 9
    glas(model, n_components=8)
    with pytest.raises(ValueError, match=r"D=9"):
        glas(model, n_components=9)


def test_not_a_module():
    with pytest.raises(TypeError, match=r"torch.nn.Module"):
        glas(lambda x: x)


def test_factory_rejects_glas_on_a_subnetwork():
    # laplace-torch's factory lets only 'full' / 'diag' through for subnetworks (the
    # last layer is supported: tests/test_subsets.py)
    with pytest.raises(ValueError, match=r"Subnetwork Laplace"):
        Laplace(
            small_model(), "regression", subset_of_weights="subnetwork", hessian_structure="glas"
        )


def test_ggn_backend_is_accepted_and_changes_nothing(reg_data):
    X, y = reg_data
    model = small_model()
    with_backend = glas(model, backend=CurvlinopsGGN)
    default = glas(model)
    with_backend.fit(loader(X, y))
    default.fit(loader(X, y))
    assert isinstance(with_backend, ActiveSubspaceLaplace)
    torch.testing.assert_close(with_backend.eigenvalues, default.eigenvalues, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"subsample_size": 0}, r"subsample_size must be a positive int"),
        ({"subsample_size": 2.5}, r"subsample_size must be a positive int"),
        ({"sample_chunk_size": 0}, r"sample_chunk_size must be a positive int"),
        ({"sample_chunk_size": 2.0}, r"sample_chunk_size must be a positive int"),
        ({"jvp_chunk_size": 0}, r"jvp_chunk_size must be a positive int or None"),
        ({"block_size": -1}, r"block_size must be a positive int or None"),
        ({"maxiter": 0}, r"maxiter must be a positive int or None"),
        ({"ncv": 0}, r"ncv must be a positive int or None"),
        ({"tol": -1e-3}, r"tol must be a non-negative number"),
        ({"tol": "small"}, r"tol must be a non-negative number"),
        ({"jvp_chunk_size": True}, r"jvp_chunk_size must be a positive int or None"),
        ({"jvp_chunk_size": 1.5}, r"jvp_chunk_size must be a positive int or None"),
    ],
)
def test_other_invalid_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        glas(**kwargs)


# ---------------------------------------------------------------- before fit
UNFITTED_CALLS = {
    "glm predictive": lambda la, X: la(X),
    "nn predictive": lambda la, X: la(X, pred_type="nn", link_approx="mc"),
    "sample": lambda la, X: la.sample(),
    "log_marginal_likelihood": lambda la, X: la.log_marginal_likelihood(),
    "eigenvalues": lambda la, X: la.eigenvalues,
    "eigenvectors": lambda la, X: la.eigenvectors,
    "posterior_variances": lambda la, X: la.posterior_variances,
    "posterior_covariance": lambda la, X: la.posterior_covariance,
    "posterior_precision": lambda la, X: la.posterior_precision,
    "log_det_ratio": lambda la, X: la.log_det_ratio,
    "lanczos_info": lambda la, X: la.lanczos_info,
    "optimize_prior_precision": lambda la, X: la.optimize_prior_precision(),
    "state_dict": lambda la, X: la.state_dict(),
    "functional_samples": lambda la, X: la.functional_samples(X),
    "predictive_samples nn": lambda la, X: la.predictive_samples(X, pred_type="nn"),
}


@pytest.mark.parametrize("call", list(UNFITTED_CALLS.values()), ids=list(UNFITTED_CALLS))
def test_use_before_fit_raises_not_fitted(call, reg_data):
    X, _ = reg_data
    la = glas()
    with pytest.raises(NotFittedError, match=r"not fitted yet.*call fit"):
        call(la, X)


@pytest.mark.parametrize("attribute", ["scatter", "log_likelihood"])
def test_evidence_terms_before_fit_raise_not_fitted(attribute):
    la = glas()
    with pytest.raises(NotFittedError, match=r"not fitted yet"):
        getattr(la, attribute)


def test_not_fitted_error_is_a_value_error():
    # callers that catch laplace-torch's ValueError keep working
    assert issubclass(NotFittedError, ValueError)


# ---------------------------------------------------------------- training data
def test_empty_loader():
    empty = DataLoader(TensorDataset(torch.zeros(0, 1), torch.zeros(0, 1)), batch_size=4)
    with pytest.raises(ValueError, match=r"loader is empty"):
        glas().fit(empty)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_training_inputs(reg_data, value):
    X, y = reg_data
    X = X.clone()
    X[13] = value
    with pytest.raises(ValueError, match=r"training inputs of batch 1 contains NaN or inf"):
        glas().fit(loader(X, y, batch_size=8))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_training_targets(reg_data, value):
    X, y = reg_data
    y = y.clone()
    y[2] = value
    with pytest.raises(ValueError, match=r"training targets of batch 0 contains NaN or inf"):
        glas().fit(loader(X, y, batch_size=8))


@pytest.mark.parametrize(
    "reshape",
    [
        lambda y: y.reshape(-1),
        lambda y: y.repeat(1, 2),
        lambda y: y.unsqueeze(-1),
    ],
    ids=["(N,)", "(N, 2)", "(N, 1, 1)"],
)
def test_regression_targets_of_the_wrong_shape(reg_data, reshape):
    X, y = reg_data
    with pytest.raises(ValueError, match=r"Regression targets of shape .* do not match .*\(8, 1\)"):
        glas().fit(loader(X, reshape(y), batch_size=8))


def test_classification_with_float_labels(cls_data):
    X, y = cls_data
    with pytest.raises(ValueError, match=r"integer class labels.*float32"):
        glas(small_classifier(), "classification").fit(loader(X, y.float()))


def test_classification_with_one_hot_labels(cls_data):
    X, y = cls_data
    with pytest.raises(ValueError, match=r"integer class labels of shape \(batch,\)"):
        glas(small_classifier(), "classification").fit(loader(X, nn.functional.one_hot(y, 3)))


@pytest.mark.parametrize("shift", [1, -1])
def test_classification_with_out_of_range_labels(cls_data, shift):
    X, y = cls_data
    with pytest.raises(ValueError, match=r"Class labels must lie in \[0, 2\]"):
        glas(small_classifier(), "classification").fit(loader(X, y + shift))


def test_shuffled_loader_with_drop_last(reg_data):
    X, y = reg_data
    dl = DataLoader(TensorDataset(X, y), batch_size=7, shuffle=True, drop_last=True)
    with pytest.raises(ValueError, match=r"drop_last=True"):
        glas().fit(dl)


def test_shuffled_loader_without_drop_last_is_fine(reg_data):
    X, y = reg_data
    shuffled = glas()
    shuffled.fit(DataLoader(TensorDataset(X, y), batch_size=7, shuffle=True))
    ordered = glas()
    ordered.fit(loader(X, y, batch_size=7))
    torch.testing.assert_close(shuffled.eigenvalues, ordered.eigenvalues, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- prediction time
NAN_BATCH = torch.tensor([[0.5], [float("nan")], [-0.5]])
INF_BATCH = torch.tensor([[0.5], [float("inf")]])


@pytest.mark.parametrize("X", [NAN_BATCH, INF_BATCH], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "kwargs", [{}, {"pred_type": "nn", "link_approx": "mc"}], ids=["glm", "nn"]
)
def test_non_finite_inputs_at_prediction(fitted, X, kwargs):
    with pytest.raises(ValueError, match=r"input contains NaN or inf"):
        fitted(X, **kwargs)


@pytest.mark.parametrize(
    "method, pred_type",
    [
        ("functional_samples", "glm"),
        ("functional_samples", "nn"),
        ("predictive_samples", "glm"),
        ("predictive_samples", "nn"),
    ],
)
def test_non_finite_inputs_to_samplers(fitted, method, pred_type):
    with pytest.raises(ValueError, match=r"input contains NaN or inf"):
        getattr(fitted, method)(NAN_BATCH, pred_type=pred_type, n_samples=4)


def test_empty_prediction_batch(fitted):
    with pytest.raises(ValueError, match=r"input batch is empty"):
        fitted(torch.zeros(0, 1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pred_type": "gp"}, r"Only glm and nn"),
        ({"pred_type": "nn", "link_approx": "probit"}, r"Only mc link approximation"),
        ({"link_approx": "laplace_bridge"}, r"Unsupported link approximation"),
        (
            {"pred_type": "nn", "link_approx": "mc", "n_samples": 0},
            r"n_samples must be a positive int",
        ),
        ({"pred_type": "nn", "link_approx": "mc", "joint": True}, r"joint=True"),
        ({"generator": 123}, r"Invalid random generator"),
    ],
)
def test_invalid_predictive_arguments(fitted, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fitted(torch.zeros(3, 1), **kwargs)


# ---------------------------------------------------------------- prior precision
def test_prior_precision_of_another_length_is_rejected_when_set(fitted):
    before = fitted.prior_precision.clone()
    with pytest.raises(ValueError, match=r"n_layers=4.*D=13.*shape \(3,\)"):
        fitted.prior_precision = torch.ones(3)
    with pytest.raises(ValueError, match=r"n_layers=4.*D=13.*shape \(3,\)"):
        fitted.log_marginal_likelihood(prior_precision=torch.ones(3))
    assert torch.equal(fitted.prior_precision, before)  # a failed call changes nothing
    fitted.log_marginal_likelihood()  # still usable


def test_non_positive_per_parameter_prior_precision_from_the_constructor_is_rejected(reg_data):
    with pytest.raises(ValueError, match=r"layerwise or diagonal prior_precision must be positive"):
        glas(prior_precision=torch.zeros(D_SMALL))
    with pytest.raises(ValueError, match=rf"D={D_SMALL}.*shape \({D_SMALL + 1},\)"):
        glas(prior_precision=torch.ones(D_SMALL + 1))


def test_unknown_prior_structure_in_optimize(fitted):
    with pytest.raises(ValueError, match=r"prior_structure must be one of 'scalar', 'layerwise'"):
        fitted.optimize_prior_precision(prior_structure="blockwise")


def test_init_prior_prec_of_another_length_in_optimize(fitted):
    before = fitted.prior_precision.clone()
    with pytest.raises(ValueError, match=r"n_layers=4.*shape \(5,\)"):
        fitted.optimize_prior_precision(init_prior_prec=torch.ones(5))
    assert torch.equal(fitted.prior_precision, before)


def test_gridsearch_without_val_loader(fitted):
    with pytest.raises(ValueError, match=r"gridsearch requires a validation set"):
        fitted.optimize_prior_precision(method="gridsearch")


# ---------------------------------------------------------------- n_components after fit
def test_n_components_setter_beyond_computed_pairs(fitted):
    assert fitted.n_components == 3
    with pytest.raises(ValueError, match=r"Only 3 eigenpairs were computed.*refit"):
        fitted.n_components = 4
    assert fitted.n_components == 3  # unchanged by the failed assignment
    fitted.n_components = 2
    assert fitted.eigenvalues.shape == (2,)
    fitted.n_components = 3  # back up to what was computed: allowed
    assert fitted.eigenvalues.shape == (3,)


@pytest.mark.parametrize(
    "k, error, match",
    [
        (0, ValueError, r">= 1"),
        (D_SMALL, ValueError, r"must be smaller than the number of parameters"),
        (1.5, TypeError, r"must be an int"),
    ],
)
def test_n_components_setter_validates(fitted, k, error, match):
    with pytest.raises(error, match=match):
        fitted.n_components = k


def test_n_components_setter_before_fit_sets_the_request(reg_data):
    X, y = reg_data
    la = glas(n_components=2)
    la.n_components = 5
    la.fit(loader(X, y))
    assert la.eigenvalues.shape == (5,)


def test_numpy_and_tensor_settings_are_accepted():
    """numpy integers and a numpy / 0-d tensor tol, as laplace-torch users pass them."""
    la = glas(
        solver="block",
        block_size=np.int64(4),
        maxiter=np.int64(20),
        sample_chunk_size=np.int32(8),
        jvp_chunk_size=np.int64(2),
        tol=torch.tensor(1e-6),
    )
    assert (la.block_size, la.maxiter, la.sample_chunk_size, la.jvp_chunk_size) == (4, 20, 8, 2)
    assert type(la.block_size) is int and la.tol == pytest.approx(1e-6)
    assert glas(ncv=np.int64(9), tol=np.float32(1e-3)).ncv == 9


def test_the_default_k_works_on_a_model_smaller_than_it():
    """A 10 -> 1 classifier head has D = 11: the default k becomes D - 1 = 10."""
    from laplace import Laplace

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 1))
    X = torch.randn(40, 10)
    y = (X[:, 0] > 0).float().reshape(-1, 1)
    la = Laplace(model, "regression", hessian_structure="glas", subset_of_weights="all")
    assert la.n_components == 10
    la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=20))
    assert la.eigenvalues.shape == (10,)
    la.n_components = 3  # an explicit choice is kept
    assert la.n_components == 3
    # the last-layer posterior (the factory's default) caps the default once it knows
    # its layer: 10 -> 1, D_L = 11
    net = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Tanh(), torch.nn.Linear(10, 1))
    ll = Laplace(net, "regression", hessian_structure="glas")
    ll.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=20))
    assert ll.n_components == 10
    with pytest.raises(ValueError, match="n_components=11 must be smaller"):
        Laplace(
            model, "regression", hessian_structure="glas", subset_of_weights="all", n_components=11
        )


def test_the_default_works_on_a_tiny_classification_head_where_kron_does():
    """``Laplace(model, 'classification', hessian_structure='glas')`` on a 4 -> 2 last
    layer (D_L = 10): k defaults to 9 and the predictive runs, as 'kron''s does."""
    import warnings

    from laplace import Laplace

    from laplace_glas.curvature.solvers.eigenpairs import NumericalRankWarning

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    X = torch.randn(40, 4)
    train = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(X, (X[:, 0] > 0).long()), batch_size=20
    )
    probs = {}
    for structure in ("kron", "glas"):
        la = Laplace(net, "classification", hessian_structure=structure)
        with warnings.catch_warnings():
            # a 2-class softmax GGN of a 5-input layer has rank <= 5 of the 9 eigenpairs
            warnings.simplefilter("ignore", NumericalRankWarning)
            la.fit(train)
        probs[structure] = la(X[:5])
    assert la.n_components == 9
    assert torch.allclose(probs["glas"].sum(-1), torch.ones(5))
    assert torch.allclose(probs["glas"], probs["kron"], atol=0.05)


@pytest.mark.parametrize("complement", ["kron", "kron_diag", "diag", "zero"])
def test_a_sigma_noise_whose_curvature_overflows_float32_is_refused_by_name(complement):
    """sigma_noise = 3e-19 passes the constructor's float32 range (1/sigma^2 is finite)
    but s lambda_1 / sigma^2 is not: the evidence was NaN, the variances NaN or 0."""
    X, y = regression_data(n=60, dtype=torch.float32, seed=0, d_in=3)
    model = mlp([3, 8, 1])
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                 n_components=3, complement=complement, sigma_noise=1.0)  # fmt: skip
    la.fit(loader(X, y, batch_size=20))
    la.sigma_noise = 1e-3  # large curvature, still representable: finite values
    assert torch.isfinite(la.log_marginal_likelihood())
    assert torch.isfinite(la(X[:2], pred_type="glm")[1]).all()
    la.sigma_noise = 3e-19
    for call in (la.log_marginal_likelihood, lambda: la(X[:2], pred_type="glm"),
                 lambda: la.sample(2)):  # fmt: skip
        with pytest.raises(ValueError, match=r"curvature overflows float32.*float64 model"):
            call()


def test_float32_occam_term_of_a_large_curvature_over_a_small_prior_is_finite():
    """``log(1 + a / tau)`` with ``a / tau`` beyond float32 (``a`` ~ 1e35, ``tau`` 1e-4):
    the evidence was -inf for 'zero' / 'prior'; it now equals the float64 model's."""
    X, y = regression_data(n=20, dtype=torch.float64, seed=0, d_in=3)
    values = []
    for dtype in (torch.float32, torch.float64):
        model = mlp([3, 6, 1], dtype=dtype)
        la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                     n_components=3, complement="zero", sigma_noise=1e-17,
                     prior_precision=1e-4)  # fmt: skip
        la.fit(loader(X.to(dtype), y.to(dtype), batch_size=10))
        values.append(float(la.log_det_ratio))
    assert math.isfinite(values[0])
    assert values[0] == pytest.approx(values[1], rel=1e-5)


def test_a_temperature_whose_curvature_overflows_is_refused_by_the_prior_tuning():
    X, y = regression_data(n=20, dtype=torch.float32, seed=0, d_in=3)
    la = Laplace(mlp([3, 6, 1]), "regression", subset_of_weights="all",
                 hessian_structure="glas", n_components=3, temperature=1e-36)  # fmt: skip
    la.fit(loader(X, y, batch_size=10))
    with pytest.raises(ValueError, match="curvature overflows float32"):
        la.optimize_prior_precision()
