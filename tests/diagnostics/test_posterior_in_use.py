"""The diagnostics speak of the posterior in use, whatever its complement: alignment's
total is the trace of the 'glm' variance, activity's 'variance' weighting the diagonal of
the dense posterior covariance."""

from __future__ import annotations

import pytest
import torch
from conftest import loader, regression_data, train
from laplace import Laplace
from torch import nn

import laplace_glas  # noqa: F401
from laplace_glas import activity_scores
from laplace_glas.diagnostics.alignment import alignment, ood_scores

DOUBLE = torch.float64
COMPLEMENTS = ("zero", "prior", "diag", "kron", "kron_diag")


def _model(norm: bool) -> nn.Module:
    torch.manual_seed(0)
    middle = [nn.LayerNorm(6)] if norm else []
    return nn.Sequential(nn.Linear(2, 6), *middle, nn.Tanh(), nn.Linear(6, 2)).to(DOUBLE)


@pytest.fixture(scope="module")
def fits():
    X, y = regression_data(n=50, dtype=DOUBLE, seed=7, d_in=2, d_out=2)
    plain, normed = train(_model(False), X, y, steps=120), train(_model(True), X, y, steps=120)
    out = {}
    for complement in COMPLEMENTS:
        model = normed if complement == "kron_diag" else plain
        la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                     n_components=3, sigma_noise=0.2, prior_precision=0.7,
                     complement=complement)  # fmt: skip
        la.fit(loader(X, y, batch_size=25))
        out[complement] = la
    return out, X


@pytest.mark.parametrize("complement", COMPLEMENTS)
def test_the_alignment_total_is_the_trace_of_the_glm_variance(fits, complement):
    las, X = fits
    la = las[complement]
    x = torch.cat([X[:5], 4 * X[:3]])  # in and out of the data
    result = alignment(la, x)
    _, f_var = la(x, pred_type="glm")
    trace = torch.diagonal(f_var, dim1=-2, dim2=-1).sum(-1)
    torch.testing.assert_close(result.total_variance, trace, rtol=1e-6, atol=1e-10)
    scores = ood_scores(result)
    torch.testing.assert_close(scores["variance"], trace, rtol=1e-6, atol=1e-10)
    share = result.complement_share
    if complement == "zero":
        assert result.complement_variance is None and bool((share.abs() < 1e-12).all())
    else:
        assert bool((share > 0).all()) and bool((share < 1).all())


@pytest.mark.parametrize("complement", COMPLEMENTS)
def test_variance_activity_is_the_dense_posterior_diagonal(fits, complement):
    las, _ = fits
    la = las[complement]
    scores = activity_scores(la, weighting="variance")
    if complement == "zero":
        sigma = la.posterior_covariance.to_dense()
    elif complement == "prior":
        sigma = torch.linalg.inv(la.posterior_precision.to_dense())
    else:
        sigma = la.posterior_covariance.to_dense()
    torch.testing.assert_close(scores, torch.diagonal(sigma), rtol=1e-8, atol=1e-12)


def test_plot_alignment_draws_any_complement(fits, tmp_path):
    pytest.importorskip("matplotlib")
    from laplace_glas.plotting import plot_alignment

    las, X = fits
    results = {name: alignment(la, X[:6]) for name, la in las.items() if name != "zero"}
    plot_alignment(results, tmp_path / "alignment.png")
    assert (tmp_path / "alignment.png").stat().st_size > 0
    with pytest.raises(ValueError, match="complement must be"):
        plot_alignment(results, complement="kron")


@pytest.mark.parametrize("complement", ["zero", "prior", "diag", "kron", "kron_diag"])
def test_a_classifier_s_alignment_total_is_the_trace_of_its_glm_logit_variance(complement):
    """For a classifier the 'glm' call returns probabilities: the total is the trace of
    the logits' linearised covariance, which the probit link reads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 3)).to(DOUBLE)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(50, 2, generator=g, dtype=DOUBLE)
    y = torch.randint(0, 3, (50,), generator=g)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="glas",
                 n_components=3, prior_precision=0.7, complement=complement)  # fmt: skip
    la.fit(loader(X, y, batch_size=25))
    x = torch.cat([X[:5], 4 * X[:3]])
    _, f_var = la._glm_predictive_distribution(x)
    trace = torch.diagonal(f_var, dim1=-2, dim2=-1).sum(-1)
    torch.testing.assert_close(alignment(la, x).total_variance, trace, rtol=1e-6, atol=1e-10)
