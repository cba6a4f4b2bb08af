"""laplace-torch's contract, checked on GLAS against dense references.

The behaviours laplace-torch's own test suite (``tests/test_baselaplace.py``,
``tests/test_serialization.py``) asks of a parametric Laplace class, for the GLAS
variants that suite is run with (``tests/upstream/inject.py``): online updates with
``fit(override=False)``, the posterior precision's ``logdet``/``clone`` and comparisons,
the evidence assembled by hand from those pieces, ``joint`` for classification, the
state dict's value types, low-precision models and laplace-torch's ``ValueError`` for
arguments of the wrong kind. CI has no internet, so the upstream files cannot run
there; this file carries the same checks.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from conftest import explicit_jacobian, loader, mlp
from torch.nn.utils import parameters_to_vector

from laplace_glas import ActiveSubspaceLaplace
from laplace_glas.validation import ArgumentTypeError

VARIANTS = list(itertools.product(["prior", "zero"], ["sum", "mean"]))
ALLOWED_STATE_TYPES = (list, tuple, int, float, str, bool, torch.Tensor)


def model64(widths=(2, 4, 1), seed=0):
    return mlp(list(widths), dtype=torch.float64, seed=seed).eval()


def data64(n, seed, d_in=2, d_out=1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    y = torch.randn(n, d_out, generator=g, dtype=torch.float64)
    return X, y


def glas(model, likelihood="regression", **kwargs):
    kwargs.setdefault("n_components", 8)
    kwargs.setdefault("loss_scaling", "sum")
    kwargs.setdefault("complement", "prior")
    return ActiveSubspaceLaplace(model, likelihood, **kwargs)


def dense_curvature(la: ActiveSubspaceLaplace) -> torch.Tensor:
    """The stored summed curvature ``U diag(h) U^T`` as a matrix."""
    U, h = la.H
    return (U * h) @ U.T


def dense_ggn(model, X) -> torch.Tensor:
    """The summed unit-noise regression GGN ``J^T J`` from explicit ``torch.func`` Jacobians."""
    J = explicit_jacobian(model, X)
    return J.T @ J


# ------------------------------------------------------------------ fit(override=False)
@pytest.mark.parametrize("complement", ["prior", "zero"])
def test_refitting_the_same_data_without_override_multiplies_the_curvature(complement):
    # upstream test_online_fit, with the curvature held as (U, h)
    model = model64()
    X, y = data64(10, 0)
    la = glas(model, complement=complement)
    la.fit(loader(X, y, batch_size=3))
    P, loss, n = dense_curvature(la), la.loss.clone(), la.n_data
    la.fit(loader(X, y, batch_size=3), override=False)
    la.fit(loader(X, y, batch_size=3), override=False)
    assert la.n_data == 3 * n
    torch.testing.assert_close(la.loss, 3 * loss)
    torch.testing.assert_close(dense_curvature(la), 3 * P, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(la.mean, parameters_to_vector(model.parameters()).detach())


@pytest.mark.filterwarnings("ignore::laplace_glas.NumericalRankWarning")  # k > rank, on purpose
def test_update_equals_a_fit_on_the_union_when_k_reaches_the_old_rank():
    # N_A * C = 4 terms: rank(G_A) <= 4 < k, so the stored curvature is exact
    model = model64()
    XA, yA = data64(4, 1)
    XB, yB = data64(9, 2)
    la = glas(model, n_components=8)
    la.fit(loader(XA, yA, batch_size=3))
    la.fit(loader(XB, yB, batch_size=3), override=False)
    union = glas(model, n_components=8)
    union.fit(loader(torch.cat([XA, XB]), torch.cat([yA, yB]), batch_size=3))
    assert la.n_data == union.n_data == 13
    torch.testing.assert_close(la.loss, union.loss)
    torch.testing.assert_close(la.H[1], union.H[1], rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(dense_curvature(la), dense_curvature(union), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(la.log_marginal_likelihood(), union.log_marginal_likelihood())
    # and both are the top 8 of the dense GGN of the union
    G = dense_ggn(model, torch.cat([XA, XB]))
    top = torch.linalg.eigvalsh(G).flip(0)[:8]
    torch.testing.assert_close(la.H[1], top, rtol=1e-7, atol=1e-9)


def test_update_with_a_truncated_old_curvature_is_within_the_weyl_bound():
    # k = 3 < rank(G_A): eigenvalues of the update differ from the union's by at
    # most ||N_A (G_A - P_k G_A P_k)||_2 = N_A lambda_{k+1}(G_A) (Weyl)
    model = model64((2, 6, 1))
    XA, yA = data64(12, 3)
    XB, yB = data64(12, 4)
    k = 3
    la = glas(model, n_components=k)
    la.fit(loader(XA, yA, batch_size=5))
    la.fit(loader(XB, yB, batch_size=5), override=False)
    GA = dense_ggn(model, XA)
    G_union = GA + dense_ggn(model, XB)
    bound = torch.linalg.eigvalsh(GA).flip(0)[k]
    exact = torch.linalg.eigvalsh(G_union).flip(0)[:k]
    gap = (la.H[1] - exact).abs().max()
    assert bound > 1e-6  # the truncation is real
    assert gap <= bound * (1 + 1e-8)
    # the update is the top-k of the truncated sum, formed densely
    truncated = torch.linalg.eigvalsh(_top_k_matrix(GA, k) + dense_ggn(model, XB))
    truncated = truncated.flip(0)[:k]
    torch.testing.assert_close(la.H[1], truncated, rtol=1e-7, atol=1e-9)


def _top_k_matrix(G: torch.Tensor, k: int) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(G)
    return (vectors[:, -k:] * values[-k:]) @ vectors[:, -k:].T


def test_override_false_on_an_unfitted_object_is_a_plain_fit():
    model = model64()
    X, y = data64(10, 5)
    a, b = glas(model), glas(model)
    a.fit(loader(X, y), override=False)
    b.fit(loader(X, y))
    torch.testing.assert_close(a.H[1], b.H[1])
    assert a.n_data == b.n_data


def test_override_false_after_load_state_dict():
    # upstream test_serialize_override: continual learning from a saved posterior
    model = model64()
    X, y = data64(10, 6)
    la = glas(model)
    la.fit(loader(X, y))
    la2 = glas(model)
    la2.load_state_dict(la.state_dict())
    la2.fit(loader(X, y), override=False)
    torch.testing.assert_close(dense_curvature(la2), 2 * dense_curvature(la), rtol=1e-8, atol=1e-9)


def test_override_false_refuses_a_model_with_other_outputs():
    X, y = data64(10, 7)
    la = glas(model64())
    la.fit(loader(X, y))
    la.model = model64((2, 4, 2))
    with pytest.raises(ValueError, match=r"2 outputs, the fitted posterior 1"):
        la.fit(loader(X, torch.cat([y, y], 1)), override=False)


def test_override_must_be_a_bool():
    X, y = data64(10, 7)
    with pytest.raises(TypeError, match=r"override must be True or False"):
        glas(model64()).fit(loader(X, y), override="no")


# ------------------------------------------------------------------ posterior precision
@pytest.mark.parametrize("loss_scaling", ["sum", "mean"])
def test_posterior_precision_logdet_clone_and_comparison(loss_scaling):
    model = model64()
    X, y = data64(10, 8)
    la = glas(model, loss_scaling=loss_scaling, prior_precision=0.7)
    la.fit(loader(X, y))
    P = la.posterior_precision
    dense = P.to_dense()
    torch.testing.assert_close(P.logdet(), torch.logdet(dense))
    torch.testing.assert_close(P.logdet(), la.log_det_posterior_precision)
    Q = P.clone()
    assert Q.vectors is not P.vectors and torch.equal(Q.vectors, P.vectors)
    assert torch.allclose(P, Q) and torch.allclose(P, dense) and torch.allclose(dense, P)
    la.prior_precision = 0.9
    assert not torch.allclose(la.posterior_precision, Q)


def test_restricted_posterior_precision_has_no_finite_logdet_but_compares():
    X, y = data64(10, 9)
    la = glas(model64(), complement="zero")
    la.fit(loader(X, y))
    P = la.posterior_precision
    with pytest.raises(ValueError, match=r"infinite outside span\(U\)"):
        P.logdet()
    assert torch.allclose(P, P.clone())
    other = glas(model64(), complement="prior")
    other.fit(loader(X, y))
    assert not torch.allclose(P, other.posterior_precision)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_evidence_assembled_from_the_public_pieces(likelihood):
    # upstream test_laplace_functionality: log p(y|f) - theta^T P0 theta / 2
    #   + (log det P0 - log det P) / 2 with P = la.posterior_precision
    model = model64((2, 4, 2))
    X, _ = data64(10, 10)
    y = (
        torch.randn(10, 2, dtype=torch.float64)
        if likelihood == "regression"
        else (torch.arange(10) % 2)
    )
    sigma = 0.3 if likelihood == "regression" else 1.0
    la = glas(model, likelihood, sigma_noise=sigma, prior_precision=0.7)
    la.fit(loader(X, y, batch_size=3))
    f = model(X).detach()
    if likelihood == "regression":
        log_lik = torch.distributions.Normal(f, sigma).log_prob(y).sum()
    else:
        log_lik = torch.distributions.Categorical(logits=f).log_prob(y).sum()
    theta = parameters_to_vector(model.parameters()).detach()
    P0 = torch.diag(la.prior_precision_diag)
    lml = (
        log_lik - theta @ P0 @ theta / 2 + (torch.logdet(P0) - la.posterior_precision.logdet()) / 2
    )
    torch.testing.assert_close(lml, la.log_marginal_likelihood())


# ------------------------------------------------------------------ predictive
@pytest.mark.parametrize("pred_type, link", [("glm", "probit"), ("glm", "mc"), ("nn", "mc")])
def test_joint_is_ignored_for_classification_as_in_laplace_torch(pred_type, link):
    model = model64((2, 4, 3))
    X, _ = data64(12, 11)
    y = torch.arange(12) % 3
    la = glas(model, "classification")
    la.fit(loader(X, y))
    kwargs = dict(pred_type=pred_type, link_approx=link, n_samples=20)
    joint = la(X[:4], joint=True, generator=torch.Generator().manual_seed(0), **kwargs)
    marginal = la(X[:4], joint=False, generator=torch.Generator().manual_seed(0), **kwargs)
    torch.testing.assert_close(joint, marginal)


# ------------------------------------------------------------------ state dict
@pytest.mark.parametrize("complement, loss_scaling", VARIANTS)
def test_state_dict_holds_only_laplace_torch_value_types(complement, loss_scaling):
    # upstream test_serialize_no_pickle
    X, y = data64(10, 12)
    la = glas(model64(), complement=complement, loss_scaling=loss_scaling)
    la.fit(loader(X, y))
    la.optimize_prior_precision()
    la.sigma_noise = 1231
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    for key, value in state.items():
        assert value is None or isinstance(value, ALLOWED_STATE_TYPES), key
    la2 = glas(model64(), complement=complement, loss_scaling=loss_scaling)
    la2.load_state_dict(state)
    assert la2.sigma_noise == la.sigma_noise
    for a, b in zip(la(X[:3]), la2(X[:3])):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(la2.lanczos_info.vectors, la.lanczos_info.vectors)
    assert la2.lanczos_info.n_products == la.lanczos_info.n_products


def test_state_dict_of_version_0_1_with_a_dict_record_still_loads():
    X, y = data64(10, 13)
    la = glas(model64())
    la.fit(loader(X, y))
    state = la.state_dict()
    state["eigenpairs"] = la.lanczos_info.to_dict()  # the 0.1 layout
    la2 = glas(model64())
    la2.load_state_dict(state)
    torch.testing.assert_close(la2.eigenvalues, la.eigenvalues)


# ------------------------------------------------------------------ argument kinds
@pytest.mark.parametrize(
    "kwargs",
    [
        {"sigma_noise": torch.tensor(1.2).reshape(1, 1)},
        {"sigma_noise": "1.2"},
        {"prior_mean": "72"},
        {"prior_precision": "1"},
        {"temperature": "1"},
    ],
    ids=["noise 2-d", "noise str", "mean str", "prior str", "temperature str"],
)
def test_arguments_of_the_wrong_kind_raise_laplace_torchs_value_error(kwargs):
    with pytest.raises(ValueError):
        glas(model64(), **kwargs)


def test_noise_for_classification_is_refused():
    with pytest.raises(ValueError, match=r"classification needs sigma_noise=1"):
        glas(model64((2, 4, 3)), "classification", sigma_noise=1.2)


def test_one_element_noise_vector_is_accepted_as_in_laplace_torch():
    la = glas(model64(), sigma_noise=torch.tensor([1.2], dtype=torch.float64))
    assert float(la.sigma_noise) == pytest.approx(1.2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_get_a_clear_error_catchable_as_laplace_torchs(dtype):
    model = torch.nn.Linear(3, 3, dtype=dtype)
    with pytest.raises(ValueError, match=r"float32 or float64.*model.float\(\)") as info:
        ActiveSubspaceLaplace(model, "regression", n_components=2)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ArgumentTypeError)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_one_element_temperature_tensors_give_scalar_results(shape):
    # found by hypothesis: a (1, 1) temperature made the evidence a (1, 1) matrix
    X, y = data64(10, 14)
    la = glas(model64())
    la.fit(loader(X, y))
    reference = la.log_marginal_likelihood()
    la.temperature = torch.ones(shape, dtype=torch.float64)
    assert la.temperature.shape == ()
    torch.testing.assert_close(la.log_marginal_likelihood(), reference)
    _, var = la(X[:3])
    assert var.shape == (3, 1, 1)


@pytest.mark.parametrize("missing", ["x", "y"])
def test_missing_dict_keys_raise_laplace_torchs_key_error(missing):
    # upstream test_dict_data: the default dict_key_x / dict_key_y are absent
    X, y = data64(8, 15)
    keys = {"x": ("inputs", "labels"), "y": ("input_ids", "target")}[missing]
    batches = [{keys[0]: X, keys[1]: y}]

    class DictModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model64()

        def forward(self, data):
            return self.net(data[keys[0]])

    with pytest.raises(KeyError) as info:
        glas(DictModel()).fit(batches)
    assert isinstance(info.value, ValueError)
    name = "dict_key_x='input_ids'" if missing == "x" else "dict_key_y='labels'"
    assert name in str(info.value) and "its keys are" in str(info.value)


def test_einsum_with_the_covariance_operator_uses_its_dense_matrix():
    # upstream test_functional_variance_fast writes J Sigma J^T with torch.einsum
    X, y = data64(10, 16)
    la = glas(model64())
    la.fit(loader(X, y))
    J = torch.randn(3, 1, la.n_params, dtype=torch.float64)
    ours = torch.einsum("ncp,pq,ncq->nc", J, la.posterior_covariance, J)
    dense = la.posterior_covariance.to_dense()
    torch.testing.assert_close(ours, torch.einsum("ncp,pq,ncq->nc", J, dense, J))
    torch.testing.assert_close(ours[:, 0], la.functional_variance(J)[:, 0, 0])


@pytest.mark.parametrize("shape", [(1, 1), (1, "D")])
def test_two_dimensional_prior_means_are_refused_by_name(shape):
    # found by hypothesis: laplace-torch's own message does not name the argument
    model = model64()
    D = sum(p.numel() for p in model.parameters())
    prior_mean = torch.zeros(*(D if s == "D" else s for s in shape), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"prior_mean must be a scalar or a vector"):
        glas(model, prior_mean=prior_mean)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_last_layer_functionality_as_laplace_torchs_lllaplace_suite(likelihood):
    """laplace-torch's ``test_lllaplace.py::test_laplace_functionality`` for the GLAS
    last-layer variant (``complement='prior'``, ``'sum'``), against ``FullLLLaplace`` on
    4 points, where the last layer's GGN (rank <= 8 of D_L = 12) lies inside k = 8: the
    log-likelihood, the evidence assembled by hand from the posterior precision's logdet,
    and the functional variance ``J Sigma J^T`` with Sigma the covariance operator."""
    from laplace import FullLLLaplace
    from torch.distributions import Categorical, Normal

    from laplace_glas import LastLayerActiveSubspaceLaplace

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)
    ).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0]) if likelihood == "classification" else torch.randn(4, 2)
    y = y if likelihood == "classification" else y.double()
    sigma = 1.0 if likelihood == "classification" else 0.3
    kwargs = {"sigma_noise": sigma, "prior_precision": 0.7}
    glas = LastLayerActiveSubspaceLaplace(
        model, likelihood, n_components=8, complement="prior", loss_scaling="sum", **kwargs
    )
    full = FullLLLaplace(model, likelihood, **kwargs)
    for la in (glas, full):
        la.fit(loader(X, y, batch_size=3))
    f = model(X).detach()
    if likelihood == "classification":
        log_lik = Categorical(logits=f).log_prob(y).sum()
    else:
        log_lik = Normal(loc=f, scale=sigma).log_prob(y).sum()
    torch.testing.assert_close(glas.log_likelihood, log_lik)
    theta = glas.mean
    prior = torch.diag(glas.prior_precision_diag)
    by_hand = log_lik - 0.5 * theta @ prior @ theta
    by_hand = by_hand + 0.5 * (prior.logdet() - glas.posterior_precision.logdet())
    torch.testing.assert_close(glas.log_marginal_likelihood(), by_hand)
    torch.testing.assert_close(glas.log_marginal_likelihood(), full.log_marginal_likelihood())
    Js, _ = glas.backend.last_layer_jacobians(X)
    true_f_var = torch.einsum("mkp,pq,mcq->mkc", Js, glas.posterior_covariance, Js)
    torch.testing.assert_close(glas.functional_variance(Js), true_f_var)
    torch.testing.assert_close(glas.functional_variance(Js), full.functional_variance(Js))
