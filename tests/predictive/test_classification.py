"""Classification with GLAS: predictive probabilities, sampling shapes, reproducibility."""

from __future__ import annotations

import pytest
import torch
from conftest import loader

from laplace_glas import ActiveSubspaceLaplace

N_CLASSES = 3
K = 8
SETTINGS = [(s, c) for s in ("mean", "sum") for c in ("zero", "prior")]
GLM_LINKS = ["probit", "mc", "bridge", "bridge_norm"]


@pytest.fixture(scope="module")
def fitted(toy_classification):
    """One fitted GLAS per (loss_scaling, complement)."""
    model, X, y = toy_classification
    fits = {}
    for loss_scaling, complement in SETTINGS:
        la = ActiveSubspaceLaplace(
            model,
            "classification",
            n_components=K,
            loss_scaling=loss_scaling,
            complement=complement,
        )
        la.fit(loader(X, y))
        fits[loss_scaling, complement] = la
    return fits


@pytest.fixture(scope="module")
def X_test(toy_classification):
    _, X, _ = toy_classification
    far = torch.tensor([[6.0, 6.0], [-6.0, 0.0], [0.0, 0.0]])  # off the data, and in between
    return torch.cat([X[::10], far])


def assert_simplex(probs: torch.Tensor, n: int) -> None:
    assert probs.shape == (n, N_CLASSES)
    assert torch.isfinite(probs).all()
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(n), rtol=0, atol=1e-5)


@pytest.mark.parametrize("loss_scaling, complement", SETTINGS)
@pytest.mark.parametrize("link_approx", GLM_LINKS)
def test_glm_predictive_is_a_distribution_over_classes(
    fitted, X_test, loss_scaling, complement, link_approx
):
    la = fitted[loss_scaling, complement]
    probs = la(
        X_test,
        pred_type="glm",
        link_approx=link_approx,
        n_samples=50,
        generator=torch.Generator().manual_seed(0),
    )
    assert_simplex(probs, X_test.shape[0])
    # the posterior's variance must reach the predictive: it is not the MAP softmax
    with torch.no_grad():
        map_probs = torch.softmax(la.model(X_test), -1)
    assert (probs - map_probs).abs().max() > 1e-4


def _argmax_case(loss_scaling, complement, link):
    # bridge with complement='zero' used to flip 25-33% of the classes: laplace-torch's
    # zero-mean correction divides by the tiny variance of sum(f); the mean is centred first
    return pytest.param(loss_scaling, complement, link, id=f"{link}-{loss_scaling}-{complement}")


@pytest.mark.parametrize(
    "loss_scaling, complement, link_approx",
    [_argmax_case(s, c, link) for link in GLM_LINKS for s, c in SETTINGS],
)
def test_glm_predictive_keeps_the_map_class_on_training_points(
    fitted, toy_classification, loss_scaling, complement, link_approx
):
    """On the training blobs every link approximation predicts the MAP's class (the MC
    predictive with many samples does so on all of these points)."""
    la = fitted[loss_scaling, complement]
    _, X, _ = toy_classification
    X = X[::5]
    probs = la(
        X,
        pred_type="glm",
        link_approx=link_approx,
        n_samples=200,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        map_class = la.model(X).argmax(-1)
    agree = (probs.argmax(-1) == map_class).float().mean()
    assert agree >= 0.9


@pytest.mark.parametrize("loss_scaling, complement", SETTINGS)
def test_nn_predictive_is_a_distribution_over_classes(fitted, X_test, loss_scaling, complement):
    la = fitted[loss_scaling, complement]
    probs = la(
        X_test,
        pred_type="nn",
        link_approx="mc",
        n_samples=40,
        generator=torch.Generator().manual_seed(0),
    )
    assert_simplex(probs, X_test.shape[0])
    with torch.no_grad():
        map_probs = torch.softmax(la.model(X_test), -1)
    assert (probs - map_probs).abs().max() > 1e-4


def test_probit_variance_decreases_confidence_with_weaker_prior(fitted, X_test):
    """A weaker prior (smaller tau) means more posterior variance: less confident predictions."""
    la = fitted["mean", "zero"]
    tau = la.prior_precision.clone()
    try:
        la.prior_precision = 10.0
        confident = la(X_test, link_approx="probit").max(-1).values
        la.prior_precision = 0.01
        vague = la(X_test, link_approx="probit").max(-1).values
    finally:
        la.prior_precision = tau
    assert (vague <= confident + 1e-6).all()
    assert (confident - vague).max() > 1e-3


def test_fit_optimize_predict_end_to_end(toy_classification):
    model, X, y = toy_classification
    la = ActiveSubspaceLaplace(model, "classification", n_components=K)
    la.fit(loader(X, y, batch_size=50))
    assert la.n_data == X.shape[0]
    assert la.n_outputs == N_CLASSES
    la.optimize_prior_precision()
    tau = la.prior_precision
    assert tau.numel() == 1
    assert torch.isfinite(tau).all() and tau.item() > 0
    assert tau.item() != 1.0  # moved from the initial value
    probs = la(X, pred_type="glm", link_approx="probit")
    accuracy = (probs.argmax(-1) == y).float().mean().item()
    assert accuracy > 0.9
    nll = -torch.log(probs[torch.arange(len(y)), y]).mean().item()
    assert nll < 0.5


@pytest.mark.parametrize("pred_type", ["glm", "nn"])
@pytest.mark.parametrize("loss_scaling, complement", SETTINGS)
def test_sample_shapes(fitted, X_test, pred_type, loss_scaling, complement):
    la = fitted[loss_scaling, complement]
    n = X_test.shape[0]
    fs = la.functional_samples(
        X_test, pred_type=pred_type, n_samples=7, generator=torch.Generator().manual_seed(0)
    )
    ps = la.predictive_samples(
        X_test, pred_type=pred_type, n_samples=7, generator=torch.Generator().manual_seed(0)
    )
    assert fs.shape == (7, n, N_CLASSES)
    assert ps.shape == (7, n, N_CLASSES)
    assert torch.isfinite(fs).all()
    torch.testing.assert_close(ps.sum(-1), torch.ones(7, n), rtol=0, atol=1e-5)
    assert (ps >= 0).all()
    # samples differ from each other (there is posterior variance)
    assert fs.std(0).max() > 1e-4
    # with the same generator state, predictive samples are the softmax of functional ones
    torch.testing.assert_close(ps, torch.softmax(fs, -1), rtol=1e-5, atol=1e-6)


def test_nn_functional_samples_are_network_outputs_at_weight_samples(fitted, X_test):
    """'nn' samples evaluate the network at theta* + U z: rebuild them by hand."""
    la = fitted["sum", "prior"]
    fs = la.functional_samples(
        X_test, pred_type="nn", n_samples=3, generator=torch.Generator().manual_seed(5)
    )
    thetas = la.sample(3, generator=torch.Generator().manual_seed(5))
    model = la.model
    original = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    try:
        for s in range(3):
            torch.nn.utils.vector_to_parameters(thetas[s], model.parameters())
            with torch.no_grad():
                torch.testing.assert_close(fs[s], model(X_test), rtol=1e-5, atol=1e-6)
    finally:
        torch.nn.utils.vector_to_parameters(original, model.parameters())
    # the module's own weights were not overwritten by the sampler
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(model.parameters()), la.mean)


@pytest.mark.parametrize(
    "call",
    [
        lambda la, X, g: la(X, pred_type="nn", link_approx="mc", n_samples=20, generator=g),
        lambda la, X, g: la(X, pred_type="glm", link_approx="mc", n_samples=20, generator=g),
        lambda la, X, g: la.predictive_samples(X, pred_type="glm", n_samples=5, generator=g),
        lambda la, X, g: la.functional_samples(X, pred_type="nn", n_samples=5, generator=g),
    ],
    ids=["nn", "glm-mc", "predictive_samples-glm", "functional_samples-nn"],
)
def test_generator_reproducibility(fitted, X_test, call):
    la = fitted["mean", "zero"]
    a = call(la, X_test, torch.Generator().manual_seed(123))
    b = call(la, X_test, torch.Generator().manual_seed(123))
    c = call(la, X_test, torch.Generator().manual_seed(124))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_default_generator_draws_fresh_samples(fitted, X_test):
    """Without a generator the global RNG is used: two calls differ, reseeding repeats them."""
    la = fitted["mean", "zero"]
    torch.manual_seed(0)
    a = la(X_test, pred_type="nn", link_approx="mc", n_samples=10)
    b = la(X_test, pred_type="nn", link_approx="mc", n_samples=10)
    torch.manual_seed(0)
    c = la(X_test, pred_type="nn", link_approx="mc", n_samples=10)
    assert not torch.allclose(a, b)
    assert torch.equal(a, c)
