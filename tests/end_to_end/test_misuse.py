"""Misuse and bad input: every case gets a clear error, a warning, or a correct answer.

Each class of the misuse fuzzing pass is here: out-of-range hyperparameters, sample counts
and shapes, the state dict, inputs the eigen-solve cannot use, inconsistent state and
train-mode models; plus property-based tests of the argument validators.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import loader, mlp, regression_data
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import laplace_glas.curvature.fit as fit_module
import laplace_glas.curvature.memory.planner as dispatch
from laplace_glas import (
    ActiveSubspaceLaplace,
    CoverageNotReachedWarning,
    FittedWeightsChangedWarning,
    LanczosConvergenceWarning,
)

K = 3


@pytest.fixture(scope="module")
def data():
    return regression_data(40)


@pytest.fixture(scope="module")
def cls_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(30, 2, generator=g), torch.arange(3).repeat(10)


def fit(data, model=None, **kwargs):
    kwargs.setdefault("n_components", K)
    la = ActiveSubspaceLaplace(
        model if model is not None else mlp([1, 8, 1]), "regression", **kwargs
    )
    la.fit(loader(*data, batch_size=10))
    return la


@pytest.fixture(scope="module")
def fitted_state(data):
    """A fitted posterior's state dict and a function making a fresh object to load it."""
    la = fit(data)
    return la.state_dict(), la


def fresh_like(la):
    return ActiveSubspaceLaplace(la.model, "regression", n_components=K)


def assert_valid_moments(f_mu, f_var):
    assert torch.isfinite(f_mu).all() and torch.isfinite(f_var).all()
    assert (f_var.diagonal(dim1=-2, dim2=-1) >= 0).all()


# --------------------------------------------------------------- 1. hyperparameters
BAD_POSITIVE = [-1.0, 0.0, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, torch.tensor(-2.0)])
@pytest.mark.parametrize("where", ["constructor", "setter"])
def test_prior_precision_out_of_range(data, where, value):
    with pytest.raises(ValueError, match=r"prior_precision must be a finite number >= 0"):
        if where == "constructor":
            ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", prior_precision=value)
        else:
            la = fit(data)
            before = la.prior_precision.clone()
            try:
                la.prior_precision = value
            finally:
                assert torch.equal(la.prior_precision, before)


@pytest.mark.parametrize("name", ["sigma_noise", "temperature"])
@pytest.mark.parametrize("value", BAD_POSITIVE)
def test_noise_and_temperature_must_be_positive_and_finite(data, name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a finite number > 0"):
        ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", **{name: value})
    la = fit(data)
    with pytest.raises(ValueError, match=rf"{name} must be a finite number > 0"):
        setattr(la, name, value)
    assert_valid_moments(*la(torch.randn(4, 1)))


@pytest.mark.parametrize("where", ["constructor", "setter"])
def test_per_output_sigma_noise_names_the_homoscedastic_limit(data, where):
    sigma = torch.tensor([0.1, 0.2])
    with pytest.raises(ValueError, match=r"sigma_noise must be one scalar.*shape \(2,\)"):
        if where == "constructor":
            ActiveSubspaceLaplace(mlp([1, 6, 2]), "regression", sigma_noise=sigma)
        else:
            fit(data).sigma_noise = sigma


def test_sigma_noise_for_classification_is_refused_by_name():
    with pytest.raises(ValueError, match=r"sigma_noise is for regression"):
        ActiveSubspaceLaplace(mlp([2, 4, 3]), "classification", sigma_noise=0.5)


def test_zero_prior_precision_is_fine_where_the_posterior_is_proper(data):
    la = fit(data, prior_precision=0.0, complement="zero")
    assert (la.subspace_curvature > 0).all()
    assert torch.allclose(la.posterior_variances, 1 / la.subspace_curvature)
    assert_valid_moments(*la(torch.randn(4, 1)))


def test_zero_prior_precision_refused_where_the_posterior_is_improper(data):
    la = fit(data, prior_precision=0.0, complement="prior")
    with pytest.raises(ValueError, match=r"needs a proper prior: prior_precision is 0"):
        la(torch.randn(4, 1))
    la = fit(data, prior_precision=0.0, complement="zero")
    with pytest.raises(ValueError, match=r"The evidence needs a proper prior"):
        la.log_marginal_likelihood()
    la.prior_precision = 1.0
    assert torch.isfinite(la.log_marginal_likelihood())


def test_zero_prior_precision_with_a_flat_direction_is_refused(data):
    la = fit(data, prior_precision=0.0, complement="zero")
    h = la.H[1].clone()
    h[-1] = 0.0
    la.H = (la.H[0], h)
    with pytest.raises(ValueError, match=r"improper: 1 of the 3 kept directions"):
        la.sample(2)


def test_prior_precision_tensor_keeps_its_gradient(data):
    la = fit(data)
    log_tau = torch.zeros(1, requires_grad=True)
    la.prior_precision = log_tau.exp()
    la.log_marginal_likelihood().backward()
    assert log_tau.grad is not None and torch.isfinite(log_tau.grad).all()


@pytest.mark.parametrize("value", [math.nan, math.inf, torch.full((3,), math.nan)])
def test_prior_mean_must_be_finite(value):
    with pytest.raises(ValueError, match=r"prior_mean must be"):
        ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", prior_mean=value)


# --------------------------------------------------------------- 2. sample counts, shapes
@pytest.mark.parametrize("n", [0, -3, 2.5, "5", None])
@pytest.mark.parametrize(
    "call",
    [
        lambda la, n: la(torch.randn(3, 2), link_approx="mc", n_samples=n),
        lambda la, n: la(torch.randn(3, 2), pred_type="nn", link_approx="mc", n_samples=n),
        lambda la, n: la.functional_samples(torch.randn(3, 2), n_samples=n),
        lambda la, n: la.predictive_samples(torch.randn(3, 2), pred_type="nn", n_samples=n),
        lambda la, n: la.sample(n),
    ],
    ids=["glm-mc", "nn", "functional_samples", "predictive_samples", "sample"],
)
def test_sample_counts_must_be_positive_ints(cls_data, call, n):
    la = ActiveSubspaceLaplace(mlp([2, 5, 3]), "classification", n_components=K)
    la.fit(loader(*cls_data, batch_size=10))
    with pytest.raises(ValueError, match=r"n_samples must be a positive int"):
        call(la, n)


def test_glm_mc_probabilities_are_valid_for_one_sample(cls_data):
    la = ActiveSubspaceLaplace(mlp([2, 5, 3]), "classification", n_components=K)
    la.fit(loader(*cls_data, batch_size=10))
    probs = la(torch.randn(4, 2), link_approx="mc", n_samples=1)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize(
    "value",
    [torch.zeros(5), torch.zeros(2, 3, 4), torch.zeros(2, 5), torch.zeros(13, dtype=torch.long)],
    ids=["short", "3-d", "wrong-D", "integer"],
)
@pytest.mark.parametrize("method", ["log_prob", "square_norm"])
def test_weight_vectors_of_the_wrong_shape(data, method, value):
    la = fit(data)
    with pytest.raises(ValueError, match=rf"shape \(D,\) or \(n, D\) with D={la.n_params}"):
        getattr(la, method)(value)


# --------------------------------------------------------------- 3. load_state_dict
def corrupt(state, key, value):
    state = dict(state)
    state[key] = value
    return state


CORRUPTIONS = {
    "nan eigenvalues": (lambda s: corrupt(s, "H", (s["H"][0], s["H"][1] * math.nan)), "NaN"),
    "negative eigenvalues": (
        lambda s: corrupt(s, "H", (s["H"][0], -s["H"][1])),
        "negative curvatures",
    ),
    "nan eigenvectors": (lambda s: corrupt(s, "H", (s["H"][0] * math.nan, s["H"][1])), "NaN"),
    "n_components beyond pairs": (lambda s: corrupt(s, "n_components", 10), "exceeds the 3"),
    "n_components zero": (lambda s: corrupt(s, "n_components", 0), "n_components"),
    "bad loss_scaling": (lambda s: corrupt(s, "loss_scaling", "foo"), "loss_scaling"),
    "bad complement": (lambda s: corrupt(s, "complement", "all"), "complement"),
    "missing H": (lambda s: {k: v for k, v in s.items() if k != "H"}, "'H' are missing"),
    "missing mean": (lambda s: {k: v for k, v in s.items() if k != "mean"}, "'mean' are missing"),
    "negative prior": (lambda s: corrupt(s, "prior_precision", torch.tensor([-1.0])), "prior"),
    "zero noise": (lambda s: corrupt(s, "sigma_noise", torch.tensor(0.0)), "sigma_noise"),
    "noise beyond float32": (
        lambda s: corrupt(s, "sigma_noise", torch.tensor(1e-20, dtype=torch.float64)),
        r"sigma_noise.*float32",
    ),
    "per-layer prior": (lambda s: corrupt(s, "prior_precision", torch.ones(3)), "one number"),
    "nan temperature": (lambda s: corrupt(s, "temperature", math.nan), "temperature"),
    "short mean": (lambda s: corrupt(s, "mean", s["mean"][:-1]), "D="),
    "wrong class": (lambda s: corrupt(s, "cls_name", "FullLaplace"), "FullLaplace"),
    "eigenpairs record mismatch": (
        lambda s: corrupt(
            s, "eigenpairs", tuple({**dict(s["eigenpairs"]), "vectors": torch.zeros(2, 2)}.items())
        ),
        "eigenpairs",
    ),
    "not a mapping": (lambda s: [1, 2], "mapping"),
    "non-orthonormal eigenvectors": (
        lambda s: corrupt(s, "H", (3 * s["H"][0], s["H"][1])),
        "not orthonormal",
    ),
}


@pytest.mark.parametrize("case", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_load_state_dict_refuses_invalid_states_and_leaves_the_object_unchanged(
    data, fitted_state, case
):
    state, _ = fitted_state
    make, match = CORRUPTIONS[case]
    target = fit(data, loss_scaling="sum")
    # predicting first: a prediction records its Jacobian path (la.jacobian_path)
    f_before = target(torch.randn(3, 1, generator=torch.Generator().manual_seed(0)))
    before = {k: v for k, v in vars(target).items()}
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(make(state))
    assert vars(target).keys() == before.keys()
    for key, value in before.items():
        assert vars(target)[key] is value, key
    f_after = target(torch.randn(3, 1, generator=torch.Generator().manual_seed(0)))
    assert all(torch.equal(a, b) for a, b in zip(f_before, f_after))


def test_valid_state_still_loads(fitted_state):
    state, la = fitted_state
    other = fresh_like(la)
    other.load_state_dict(state)
    assert torch.equal(other.eigenvalues, la.eigenvalues)


# --------------------------------------------------------------- 4. inputs the solve cannot use
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_are_refused_with_the_conversion_named(dtype):
    with pytest.raises(TypeError, match=r"float32 or float64 .*model\.float\(\)"):
        ActiveSubspaceLaplace(mlp([1, 8, 1]).to(dtype), "regression", n_components=K)


def test_mixed_dtype_models_are_refused():
    model = mlp([1, 8, 1])
    model[0].double()
    with pytest.raises(TypeError, match=r"mix dtypes \(float32, float64\)"):
        ActiveSubspaceLaplace(model, "regression", n_components=K)


class WeightFree(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return 0 * x[:, :1] + 0 * self.w.sum()


@pytest.mark.parametrize("solver", ["lanczos", "block"])
def test_zero_ggn_is_named(data, solver):
    with pytest.raises(ValueError, match=r"The GGN is zero.*do not depend on the parameters"):
        fit(data, model=WeightFree(), n_components=2, solver=solver)


def test_one_shot_iterator_is_refused_before_any_pass(data):
    la = ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", n_components=K)
    with pytest.raises(TypeError, match=r"train_loader must be re-iterable.*one-shot iterator"):
        la.fit(iter(loader(*data, batch_size=10)))
    with pytest.raises(TypeError, match=r"re-iterable"):
        la.fit(batch for batch in loader(*data, batch_size=10))


def test_a_list_of_batches_is_a_valid_loader(data):
    la = ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", n_components=K)
    la.fit(list(loader(*data, batch_size=10)))
    reference = fit(data)
    assert torch.allclose(la.eigenvalues, reference.eigenvalues, rtol=1e-4)


@pytest.mark.parametrize("ncv", [1, K, 10_000])
def test_ncv_must_exceed_k_and_not_exceed_d(ncv):
    with pytest.raises(ValueError, match=r"n_components < ncv <= D"):
        ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", n_components=K, ncv=ncv)


def test_ncv_checked_against_a_raised_n_components(data):
    la = fit(data, ncv=5)
    with pytest.raises(ValueError, match=r"5 < ncv"):
        la.compute_eigenpairs(loader(*data, batch_size=10), n_components=5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank_threshold": "a"}, TypeError, "rank_threshold must be a real number"),
        ({"rank_threshold": 2.0}, ValueError, r"rank_threshold must be a finite number in \[0.0"),
        ({"rank_threshold": math.nan}, ValueError, "rank_threshold"),
        ({"seed": "a"}, TypeError, "seed must be an int"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"seed": 2**70}, ValueError, "seed must lie in"),
        ({"ignore_index": "x"}, TypeError, "ignore_index must be an int"),
        ({"enable_backprop": "yes"}, TypeError, "enable_backprop must be True or False"),
        ({"progress_bar": 1}, TypeError, "progress_bar must be True or False"),
        ({"dict_key_x": 3}, TypeError, "dict_key_x must be a str"),
        ({"generator": 3}, ValueError, "generator must be a CPU torch.Generator"),
        ({"backend": "curvlinops"}, ValueError, "curvature backend 'curvlinops'"),
        ({"loss_scaling": ["mean"]}, ValueError, "loss_scaling must be"),
    ],
)
def test_non_numeric_and_out_of_range_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", n_components=K, **kwargs)


def test_numpy_settings_are_accepted(data):
    la = fit(data, n_components=np.int64(K), seed=np.int32(3), rank_threshold=np.float32(1e-5))
    assert la.n_components == K and isinstance(la.n_components, int)
    assert la.seed == 3


def test_integer_regression_targets_are_refused(data):
    X, y = data
    la = ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", n_components=K)
    with pytest.raises(TypeError, match=r"Regression targets must be floating point.*y\.float"):
        la.fit(loader(X, y.round().long(), batch_size=10))


class TupleOutput(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.net, self.kind = mlp([1, 8, 1]), kind

    def forward(self, x):
        out = self.net(x)
        return (out, x) if self.kind == "tuple" else {"logits": out}


@pytest.mark.parametrize(("kind", "hint"), [("tuple", r"\[0\]"), ("dict", r"\['logits'\]")])
def test_non_tensor_model_outputs_say_how_to_wrap_the_model(data, kind, hint):
    la = ActiveSubspaceLaplace(TupleOutput(kind), "regression", n_components=K)
    with pytest.raises(TypeError, match=rf"returned a {kind}.*Wrap the model.*{hint}"):
        la.fit(loader(*data, batch_size=10))


def test_non_tensor_output_at_prediction_is_named(data):
    la = fit(data)
    la.model.forward = lambda x: (nn.Sequential.forward(la.model, x), x)
    try:
        with pytest.raises(TypeError, match=r"returned a tuple"):
            la(torch.randn(3, 1))
    finally:
        del la.model.forward


# --------------------------------------------------------------- 5. inconsistent state
def test_compute_eigenpairs_on_another_loader_uses_its_own_n(data):
    """Eigenvalues of a half-size loader equal a fresh fit on that half (not scaled by 2)."""
    X, y = data
    la = fit(data, solver="lanczos")
    half = loader(X[:20], y[:20], batch_size=10)
    replica = la.compute_eigenpairs(half)
    reference = fit((X[:20], y[:20]))
    assert replica.n_data == 20
    assert torch.allclose(replica.values, reference.lanczos_info.values, rtol=1e-4)


class Augmenting:
    """A loader that draws new input noise on every pass (random augmentation)."""

    def __init__(self, X, y):
        self.X, self.y = X, y

    def __iter__(self):
        for i in range(0, len(self.X), 10):
            noise = 0.3 * torch.randn(self.X[i : i + 10].shape)
            yield self.X[i : i + 10] + noise, self.y[i : i + 10]


class OutputScale(nn.Module):
    """A network times a learnt scalar: a parameter outside any supported layer."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.scale * self.net(x)


@pytest.mark.parametrize(
    ("solver", "match"),
    [("lanczos", r"residuals .* not reproducible"), ("block", r"did not converge for 3 of the 3")],
)
@pytest.mark.usefixtures("without_jacobian")
def test_irreproducible_products_warn_about_the_residuals(data, solver, match, monkeypatch):
    """The curvlinops operator passes over the data once per product where the batches
    are read from the loader (here: none kept by the pass at the MAP, as for data larger
    than their share of the budget). (The factored and linearised operators, which
    solver='auto' and 'block' use within their memory budget, read the data once, so
    their products are consistent: a model with a free-standing parameter, the
    linearised operator refused and the stored Jacobians not tried keep curvlinops here.)
    """
    monkeypatch.setattr(fit_module, "KEPT_BYTES", 0)
    monkeypatch.setattr(dispatch, "build_linearized_ggn", lambda *a, **kw: "refused here")
    torch.manual_seed(0)
    model = OutputScale(mlp([1, 8, 1]))
    # complement 'zero': no complement pass draws from the augmentation before the solve
    la = ActiveSubspaceLaplace(
        model, "regression", n_components=K, solver=solver, loss_scaling="mean", complement="zero"
    )
    with pytest.warns(LanczosConvergenceWarning, match=match):
        la.fit(Augmenting(*data))
    assert la.lanczos_info.operator.startswith("curvlinops")


@pytest.mark.parametrize("solver", ["lanczos", "block"])
@pytest.mark.usefixtures("without_jacobian")
def test_kept_batches_give_curvlinops_one_draw_of_the_augmentation(data, solver, monkeypatch):
    """The same model and loader as above with the batches kept by the pass at the MAP
    (the default for data this small): every product replays them, the residuals are
    reproducible and the solve converges."""
    monkeypatch.setattr(dispatch, "build_linearized_ggn", lambda *a, **kw: "refused here")
    torch.manual_seed(0)
    model = OutputScale(mlp([1, 8, 1]))
    la = ActiveSubspaceLaplace(
        model, "regression", n_components=K, solver=solver, loss_scaling="mean", complement="zero"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", LanczosConvergenceWarning)
        la.fit(Augmenting(*data))
    assert la.lanczos_info.operator.startswith("curvlinops")


@pytest.mark.parametrize("solver", ["auto", "block"])
@pytest.mark.usefixtures("without_jacobian")
def test_the_linearised_operator_reads_an_augmenting_loader_once(data, solver):
    """Within its budget the linearised operator keeps one draw of the augmentation:
    its products are those of one fixed data set, so the residual check, which warns
    for the same model and loader on curvlinops' operator (the test above), is quiet."""
    torch.manual_seed(0)
    model = OutputScale(mlp([1, 8, 1]))
    la = ActiveSubspaceLaplace(model, "regression", n_components=K, solver=solver)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LanczosConvergenceWarning)
        la.fit(Augmenting(*data))
    assert la.lanczos_info.operator.startswith("linearised (not factored")


def test_reproducible_products_do_not_warn(data):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LanczosConvergenceWarning)
        for dtype in (torch.float32, torch.float64):
            X, y = (t.to(dtype) for t in data)
            for solver in ("auto", "lanczos", "block"):
                fit((X, y), model=mlp([1, 8, 1]).to(dtype), solver=solver)


def test_weights_changed_after_fit_warn(data):
    la = fit(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FittedWeightsChangedWarning)
        la(torch.randn(3, 1))
    with torch.no_grad():
        la.model[0].weight.add_(0.1)
    for call in (
        lambda: la(torch.randn(3, 1)),
        lambda: la(torch.randn(3, 1), pred_type="nn", link_approx="mc", n_samples=2),
        lambda: la.functional_samples(torch.randn(3, 1), n_samples=2),
    ):
        with pytest.warns(FittedWeightsChangedWarning, match=r"Call fit\(\) again"):
            call()
    la.fit(loader(*data, batch_size=10))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FittedWeightsChangedWarning)
        la(torch.randn(3, 1))


def test_failed_fit_leaves_the_previous_posterior(data):
    la = fit(data)
    values = la.eigenvalues.clone()
    X, y = data
    with pytest.raises(ValueError, match="NaN"):
        la.fit(loader(X, y * math.nan, batch_size=10))
    assert torch.equal(la.eigenvalues, values)
    assert_valid_moments(*la(torch.randn(3, 1)))


# --------------------------------------------------------------- 6. train-mode models
def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))


def dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 1))


@pytest.mark.parametrize("pred_type", ["glm", "nn"])
def test_batchnorm_in_train_mode_is_left_untouched_by_predictions(data, pred_type):
    la = fit(data, model=bn_model())
    la.model.train()
    bn = la.model[1]
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    x = torch.randn(5, 1)
    kwargs = {"pred_type": pred_type, "link_approx": "mc", "n_samples": 3}
    out = la(x, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])
    assert torch.equal(bn.num_batches_tracked, stats[2])
    assert la.model.training and bn.training  # the caller's mode is restored
    la.model.eval()
    expected = la(x, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.allclose(out[0], expected[0]) and torch.allclose(out[1], expected[1])


def test_dropout_in_train_mode_glm_runs_deterministically(data):
    la = fit(data, model=dropout_model())
    x = torch.randn(5, 1)
    expected = la(x)
    la.model.train()
    got = la(x)
    assert la.model.training
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_partly_train_mode_model_comes_back_as_it_was(data):
    la = fit(data, model=dropout_model())
    assert all(m.training for m in la.model)  # fit gave the caller's (train) modes back
    la.model.eval()
    la.model[2].train()
    la(torch.randn(2, 1))
    assert [m.training for m in la.model] == [False, False, True, False]


def test_replica_solve_with_a_train_mode_model_matches_the_fit(data):
    la = fit(data, model=dropout_model(), solver="lanczos")
    la.model.train()
    again = la.compute_eigenpairs(loader(*data, batch_size=10))
    assert torch.allclose(again.values, la.lanczos_info.values, rtol=1e-4)
    assert la.model.training


# --------------------------------------------------------------- property-based validators
CONSTRUCTOR_ARGUMENTS = [
    "sigma_noise",
    "prior_precision",
    "prior_mean",
    "temperature",
    "n_components",
    "loss_scaling",
    "complement",
    "solver",
    "block_size",
    "tol",
    "maxiter",
    "ncv",
    "seed",
    "subsample_size",
    "rank_threshold",
    "jvp_chunk_size",
    "sample_chunk_size",
    "ignore_index",
    "enable_backprop",
    "progress_bar",
    "dict_key_x",
    "generator",
    "backend",
    "loss_fn",
]

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(-3, 3), max_size=3),
    st.builds(
        lambda shape, fill: torch.full(shape, fill),
        st.lists(st.integers(0, 3), max_size=2).map(tuple),
        st.floats(allow_nan=True, allow_infinity=True, width=32),
    ),
    st.builds(lambda v: np.float64(v), st.floats()),
    st.builds(lambda v: np.int64(v), st.integers(-5, 50)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(CONSTRUCTOR_ARGUMENTS), value=ANY_VALUE)
def test_any_constructor_argument_works_or_raises_a_named_error(name, value):
    try:
        la = ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", **{name: value})
    except (ValueError, TypeError) as err:
        message = str(err)
        assert (
            name in message
            or name.replace("_", " ") in message
            or (name == "backend" and "backend" in message)
        ), message
        return
    # accepted: the stored hyperparameters are usable numbers
    for attribute in ("sigma_noise", "prior_precision", "temperature"):
        number = torch.as_tensor(getattr(la, attribute), dtype=torch.float64)
        assert torch.isfinite(number).all() and (number >= 0).all()


@pytest.fixture(scope="module")
def fitted_for_properties(data):
    return fit(data)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.sampled_from(["prior_precision", "sigma_noise", "temperature"]), value=ANY_VALUE)
# found by this test: the scatter, summed in float32, overflowed to inf (evidence -inf)
# where the evidence itself is a float32 number
@example(name="prior_precision", value=7.709953630286711e37)
# found by this test: a tiny temperature makes s lambda_1 / (N sigma^2 T) overflow float32
@example(name="temperature", value=8.142418742019421e-36)
def test_any_hyperparameter_set_gives_valid_predictions_or_a_named_error(
    fitted_for_properties, name, value
):
    la = fitted_for_properties
    saved = {k: getattr(la, k) for k in ("prior_precision", "sigma_noise", "temperature")}
    try:
        setattr(la, name, value)
    except (ValueError, TypeError) as err:
        assert name in str(err), str(err)
        return
    try:
        try:
            f_mu, f_var = la(torch.linspace(-1, 1, 4).reshape(-1, 1))
        except ValueError as err:  # refused where the prior must be proper, or where
            # the value set makes the curvature overflow the dtype (named in the error)
            assert "prior_precision is 0" in str(err) or name in str(err), str(err)
            return
        assert_valid_moments(f_mu, f_var)
        evidence = la.log_marginal_likelihood() if float(la.prior_precision) > 0 else None
        if evidence is not None and not torch.isfinite(evidence):
            # only where the evidence lies beyond its dtype's range: its scatter term
            # alone, -P_0 |theta - mu_0|^2 / 2 (float64), is below -max
            assert float(evidence) == -float("inf"), evidence
            delta = (la.mean - la.prior_mean).double()
            scatter = la.prior_precision_diag.double() @ delta.square() / 2
            assert scatter > torch.finfo(evidence.dtype).max, (evidence, scatter)
    finally:
        for key, saved_value in saved.items():
            setattr(la, key, saved_value)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(n=ANY_VALUE.filter(lambda v: not isinstance(v, int) or v < 10_000))
def test_any_sample_count_gives_samples_or_a_named_error(fitted_for_properties, n):
    """Counts of a sane size (a huge one is torch's allocation error, by design)."""
    la = fitted_for_properties
    try:
        draws = la.sample(n)
    except (ValueError, TypeError) as err:
        assert "n_samples" in str(err)
        return
    assert draws.shape == (int(n), la.n_params) and torch.isfinite(draws).all()


# --------------------------------------------------------------- beyond the issue (fuzzing)
def test_nn_regression_variance_needs_two_samples(data):
    la = fit(data)
    with pytest.raises(ValueError, match=r"n_samples must be >= 2 for the sample variance"):
        la(torch.randn(3, 1), pred_type="nn", link_approx="mc", n_samples=1)


def test_sigma_noise_setter_refuses_noise_for_classification(cls_data):
    la = ActiveSubspaceLaplace(mlp([2, 5, 3]), "classification", n_components=K)
    with pytest.raises(ValueError, match=r"sigma_noise is for regression"):
        la.sigma_noise = 2.0
    assert float(la.sigma_noise) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"tol": -1.0}, "tol must be"), ({"maxiter": 0}, "maxiter must be")]
)
def test_compute_eigenpairs_validates_like_the_constructor(data, kwargs, match):
    la = fit(data)
    with pytest.raises(ValueError, match=match):
        la.compute_eigenpairs(loader(*data, batch_size=10), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"val_loader": "iterator"}, TypeError, "val_loader must be re-iterable"),
        ({"val_loader": []}, ValueError, "val_loader is empty"),
        ({"grid_size": 0}, ValueError, "grid_size must be a positive int"),
        ({"grid_size": 2.5}, ValueError, "grid_size must be a positive int"),
        ({"log_prior_prec_base": 1.0}, ValueError, "log_prior_prec_base must be > 0 and != 1"),
        ({"log_prior_prec_min": 2, "log_prior_prec_max": -2}, ValueError, "must be below"),
    ],
)
def test_gridsearch_arguments(data, kwargs, error, match):
    la = fit(data)
    if kwargs.get("val_loader") == "iterator":
        kwargs["val_loader"] = iter(loader(*data, batch_size=10))
    kwargs.setdefault("val_loader", loader(*data, batch_size=10))
    with pytest.raises(error, match=match):
        la.optimize_prior_precision(method="gridsearch", **kwargs)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_activity_functions_refuse_non_finite_scores(data, bad):
    from laplace_glas import cumulative_activity, per_parameter, weights_for_share

    scores = torch.tensor([1.0, bad, 2.0])
    with pytest.raises(ValueError, match="NaN or inf"):
        cumulative_activity(scores)
    with pytest.raises(ValueError, match="NaN or inf"):
        weights_for_share(scores, 0.5)
    la = fit(data)
    with pytest.raises(ValueError, match="NaN or inf"):
        per_parameter(la, torch.full((la.n_params,), bad))


def test_inputs_of_another_dtype_and_without_batch_axis(data):
    la = fit(data)
    with pytest.raises(TypeError, match=r"input is float64 but the model's parameters are float32"):
        la(torch.randn(3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"batch axis"):
        la(torch.tensor(0.5))


def test_single_logit_classifier_is_refused(cls_data):
    X, y = cls_data
    la = ActiveSubspaceLaplace(mlp([2, 5, 1]), "classification", n_components=2)
    with pytest.raises(ValueError, match=r"at least 2 logits"):
        la.fit(loader(X, torch.zeros_like(y), batch_size=10))


def test_dict_batch_without_the_target_key(data):
    X, y = data
    batches = [{"input_ids": X[i : i + 10], "target": y[i : i + 10]} for i in range(0, 40, 10)]
    la = ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", n_components=K)
    with pytest.raises(ValueError, match=r"no target under dict_key_y='labels'.*'target'"):
        la.fit(batches)


def test_calibration_arguments(data):
    la = fit(data)
    calib = loader(*regression_data(20, seed=5), batch_size=10)
    with pytest.raises(ValueError, match=r"prior_precisions is empty and empirical_bayes=False"):
        la.calibrate(calib, prior_precisions=[], empirical_bayes=False)
    with pytest.raises(TypeError, match=r"ks must be a sequence of ints"):
        la.calibrate(calib, ks=[1.7])
    with pytest.raises(TypeError, match=r"ks must be a sequence of ints"):
        la.calibrate(calib, ks="12")
    with pytest.raises(ValueError, match=r"generator must be a torch.Generator"):
        la.calibrate(calib, pred_type="nn", generator="x")


def test_calibration_warns_when_the_weights_moved(data):
    from laplace_glas import coverage

    la = fit(data)
    with torch.no_grad():
        la.model[0].bias.add_(0.5)
    with pytest.warns(FittedWeightsChangedWarning):
        coverage(la, loader(*regression_data(20, seed=5), batch_size=10))


def test_log_prob_of_non_finite_weights_is_refused(data):
    la = fit(data)
    with pytest.raises(ValueError, match="NaN or inf"):
        la.log_prob(torch.full((la.n_params,), math.nan))


def test_loading_another_n_components_warns(fitted_state):
    state, la = fitted_state
    other = ActiveSubspaceLaplace(la.model, "regression", n_components=5)
    with pytest.warns(UserWarning, match=r"n_components 5 is replaced by the saved 3"):
        other.load_state_dict(state)
    assert other.n_components == 3


def test_a_refused_call_leaves_the_posterior_as_it_was(toy_regression):
    """A refused optimize_prior_precision or load_state_dict changes nothing."""
    from conftest import fit_glas

    model, X, y = toy_regression
    la = fit_glas(model, X, y, n_components=5)
    before = (la.prior_precision.clone(), la.H, la.loss, la.n_components)
    with pytest.raises(ValueError):
        la.optimize_prior_precision(method="marglik", init_prior_prec=torch.zeros(4))
    with pytest.raises(ValueError):  # a diverging ascent sets a non-finite prior
        la.optimize_prior_precision(
            method="marglik", prior_structure="layerwise", lr=1e6, n_steps=50
        )
    state = la.state_dict()
    state["prior_mean"] = torch.tensor([float("nan")])
    with pytest.raises(ValueError):
        la.load_state_dict(state)
    assert torch.equal(la.prior_precision, before[0])
    assert la.H is before[1] and la.loss is before[2] and la.n_components == before[3]
    la(X[:3], pred_type="glm")  # still predicts


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"coverage": "0.9"}, TypeError, r"coverage must be a real number, got '0.9'"),
        (
            {"coverage": 1.5},
            ValueError,
            r"coverage \(the nominal coverage level\) must lie in \(0, 1\)",
        ),
        ({"ks": 3}, TypeError, r"ks must be a sequence of ints, got 3"),
        ({"n_samples": 2.5, "pred_type": "nn"}, TypeError, r"n_samples must be an int >= 2"),
        ({"pred_type": "full"}, ValueError, r"pred_type must be 'glm' or 'nn', got 'full'"),
        ({"include_noise": "yes"}, TypeError, r"include_noise must be True or False"),
    ],
)
@pytest.mark.parametrize("entry", ["calibrate", "select_dimension"])
def test_calibration_arguments_of_the_wrong_type(data, entry, kwargs, error, match):
    from laplace_glas import select_dimension

    la = fit(data)
    calib = loader(*regression_data(20, seed=5), batch_size=10)
    before = (la.n_components, la.prior_precision.clone())
    with pytest.raises(error, match=match):
        if entry == "calibrate":
            la.calibrate(calib, **kwargs)
        else:
            select_dimension(la, calib, **kwargs)
    assert la.n_components == before[0] and torch.equal(la.prior_precision, before[1])


class _InputsModel(nn.Module):
    """An MLP reading its input from the dict entry ``inputs``."""

    def __init__(self):
        super().__init__()
        self.net = mlp([1, 8, 1])

    def forward(self, batch):
        return self.net(batch["inputs"])


@pytest.mark.parametrize("prior", ["scalar", "layerwise"])
def test_calibrate_with_a_custom_dict_key_x(data, prior):
    """Dict batches whose input sits under another dict_key_x are calibrated like tensors."""
    import statistics

    from laplace_glas import coverage

    X, y = data
    Xc, yc = regression_data(20, seed=5)
    prior_precision = 1.0 if prior == "scalar" else torch.ones(4)
    la = ActiveSubspaceLaplace(
        _InputsModel(),
        "regression",
        n_components=K,
        dict_key_x="inputs",
        prior_precision=prior_precision,
        loss_scaling="mean",  # intervals wide enough that the coverage is strictly between
        complement="zero",  # 0 and 1 on these few points
    )
    la.fit([{"inputs": X[i : i + 10], "labels": y[i : i + 10]} for i in range(0, 40, 10)])
    calib = [{"inputs": Xc[i : i + 5], "labels": yc[i : i + 5]} for i in range(0, 20, 5)]
    level = 0.5
    f, var = la({"inputs": Xc}, pred_type="glm")
    half = statistics.NormalDist().inv_cdf(0.5 + level / 2) * var.reshape(yc.shape).sqrt()
    own = float(((yc - f).abs() <= half).double().mean())
    assert 0 < own < 1
    assert coverage(la, calib, level=level, include_noise=False) == pytest.approx(own)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CoverageNotReachedWarning)
        selection = la.calibrate(calib, coverage=level, ks=[K], prior_precisions=[1.0])
    assert selection.k == K
    with warnings.catch_warnings():  # the default: the prior tuned, intervals of y
        warnings.simplefilter("ignore", CoverageNotReachedWarning)
        tuned = la.calibrate(calib, coverage=level, ks=[K])
    assert tuned.include_noise and tuned.k == K


def test_last_layer_fit_of_an_empty_loader(data):
    from laplace_glas import LastLayerActiveSubspaceLaplace

    X, y = data
    la = LastLayerActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", n_components=2)
    with pytest.raises(ValueError, match=r"training loader is empty"):
        la.fit(loader(X[:0], y[:0], batch_size=10))
    with pytest.raises(TypeError, match=r"train_loader must be re-iterable"):
        la.fit(iter(loader(X, y, batch_size=10)))


@pytest.mark.parametrize("value", [[("stochastic", True)], "stochastic", 1])
def test_backend_kwargs_of_the_wrong_type(value):
    with pytest.raises(TypeError, match=r"backend_kwargs must be a dict .* or None"):
        ActiveSubspaceLaplace(mlp([1, 8, 1]), "regression", backend_kwargs=value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pred_type": "glmm"}, r"pred_type must be 'glm' or 'nn', got 'glmm'"),
        ({"link_approx": "probitt"}, r"link_approx must be one of .*'probit'.*got 'probitt'"),
        ({"method": "grid"}, r"method must be 'marglik' or 'gridsearch', got 'grid'"),
    ],
)
def test_gridsearch_typos_are_named_before_any_work(data, kwargs, match):
    la = fit(data)
    before = la.prior_precision.clone()
    kwargs.setdefault("method", "gridsearch")

    class Unread:
        def __iter__(self):
            raise AssertionError("the validation data was read")

    with pytest.raises(ValueError, match=match):
        la.optimize_prior_precision(val_loader=[Unread()], **kwargs)
    assert torch.equal(la.prior_precision, before)


@pytest.mark.parametrize("kind", ["full", "last_layer", "subnetwork"])
def test_a_model_on_the_meta_device_is_refused_by_name(kind):
    from laplace_glas import LastLayerActiveSubspaceLaplace, SubnetActiveSubspaceLaplace

    with torch.device("meta"):
        model = mlp([1, 8, 1])
    cls, kwargs = {
        "full": (ActiveSubspaceLaplace, {}),
        "last_layer": (LastLayerActiveSubspaceLaplace, {}),
        "subnetwork": (SubnetActiveSubspaceLaplace, {"subnetwork_indices": torch.arange(5)}),
    }[kind]
    with pytest.raises(ValueError, match=r"on the 'meta' device.*to_empty"):
        cls(model, "regression", n_components=2, **kwargs)


def test_hugging_face_batches_without_input_ids_name_the_key():
    """fit and predict on dict batches lacking ``input_ids`` raise ``MissingKeyError``."""
    transformers = pytest.importorskip("transformers")
    from laplace_glas.curvature.data.batches import MissingKeyError
    from laplace_glas.huggingface import LogitsModel, causal_lm_batch

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=12, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = LogitsModel(transformers.GPT2LMHeadModel(config).double().eval())
    batch = causal_lm_batch(torch.randint(3, 12, (4, 6)))
    renamed = {"tokens": batch["input_ids"], **{k: batch[k] for k in ("attention_mask", "labels")}}
    la = ActiveSubspaceLaplace(model, "classification", n_components=2)
    with pytest.raises(
        MissingKeyError, match=r"no 'input_ids'.*\['attention_mask', 'labels', 'tokens'\]"
    ):
        la.fit([renamed])
    la.fit([batch])
    with pytest.raises(MissingKeyError, match=r"no input under dict_key_x='input_ids'.*'tokens'"):
        la({"tokens": batch["input_ids"], "attention_mask": batch["attention_mask"]})


@pytest.mark.parametrize("complement", ["zero", "prior"])
def test_alignment_of_a_subnetwork_posterior_is_over_its_weights(data, complement):
    """alignment of a subnetwork posterior: ``J`` over the subnetwork's weights, its
    variances those of the posterior's own 'glm' predictive.
    """
    from conftest import output_jacobian

    from laplace_glas import SubnetActiveSubspaceLaplace, alignment

    X, y = data
    model = mlp([1, 8, 1], dtype=torch.float64)
    indices = torch.arange(3, 20)
    la = SubnetActiveSubspaceLaplace(
        model, "regression", subnetwork_indices=indices, n_components=K, complement=complement
    )
    la.fit(loader(X.double(), y.double(), batch_size=10))
    x = torch.linspace(-3, 3, 7, dtype=torch.float64).reshape(-1, 1)
    result = alignment(la, x)
    _, J = output_jacobian(model, x)
    J_sub = J[..., indices]  # (n, 1, D_s)
    JU = J_sub @ la.eigenvectors[:, :K]
    torch.testing.assert_close(result.jacobian_norm2, J_sub.square().sum(dim=(1, 2)))
    torch.testing.assert_close(result.projected_norm2, JU.square().sum(dim=(1, 2)))
    _, f_var = la(x, pred_type="glm")
    own = result.variance if complement == "zero" else result.combined
    torch.testing.assert_close(own, f_var.reshape(-1))


def test_a_subnetwork_state_loads_only_into_the_same_subnetwork(data):
    from laplace_glas import SubnetActiveSubspaceLaplace

    model = mlp([1, 8, 1])

    def subnet(indices):
        return SubnetActiveSubspaceLaplace(
            model, "regression", subnetwork_indices=indices, n_components=K
        )

    la = subnet(torch.arange(0, 20))
    la.fit(loader(*data, batch_size=10))
    state = la.state_dict()
    assert torch.equal(state["subnetwork_indices"], torch.arange(0, 20))
    other = subnet(torch.arange(5, 25))  # the same size, other weights
    with pytest.raises(ValueError, match=r"saved with other subnetwork_indices \(the same size"):
        other.load_state_dict(state)
    assert other.H is None  # left unfitted
    same = subnet(torch.arange(0, 20))
    same.load_state_dict(state)
    x = torch.linspace(-2, 2, 5).reshape(-1, 1)
    torch.testing.assert_close(same(x)[1], la(x)[1])
    old = {key: value for key, value in state.items() if key != "subnetwork_indices"}
    with pytest.warns(UserWarning, match=r"no subnetwork_indices.*cannot be checked"):
        subnet(torch.arange(5, 25)).load_state_dict(old)
