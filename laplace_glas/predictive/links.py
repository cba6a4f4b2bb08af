"""Link functions from a Gaussian over logits (or outputs) to predictions.

* :func:`gaussian_samples` draws from ``N(f_mu, f_var)`` row by row through an
  eigen-decomposition: the GLAS output covariance ``(J U) diag(v) (J U)^T`` has rank at
  most k, so the Cholesky factorisation laplace-torch uses fails whenever ``C > k``.
* :func:`probit` is laplace-torch's probit approximation applied to the logits'
  softmax-invariant part: the mean and the covariance are centred first.
* :func:`laplace_bridge` is laplace-torch's Laplace bridge with the mean centred first.

Softmax does not change when the same number is added to every logit,
``softmax(f + c 1) = softmax(f)``, so the exact predictive ``E[softmax(f)]`` under
``f ~ N(mu, Sigma)`` depends only on the centred logits ``P f ~ N(P mu, P Sigma P)``,
``P = I - 1 1^T / C``. A Laplace posterior keeps the prior's variance along weight
directions no data constrains, such as shifting every class's bias by the same amount;
they give every logit the same shift and so a large variance along ``1`` that cannot
change a prediction. The approximations are applied to the centred Gaussian, where that
variance is gone.
"""

from __future__ import annotations

import math

import torch

__all__ = ["centred_logits", "gaussian_samples", "laplace_bridge", "probit"]


def gaussian_samples(
    f_mu: torch.Tensor,
    f_var: torch.Tensor,
    n_samples: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``(n_samples, n, C)`` draws of ``f_mu + f_var^{1/2} z`` for each of the ``n`` rows.

    ``f_var`` is ``(n, C, C)`` (square root by ``eigh``, negative round-off clamped
    to 0, so singular covariances are fine) or ``(n, C)`` (diagonal).
    """
    z = torch.randn(
        n_samples, *f_mu.shape, device=f_mu.device, dtype=f_mu.dtype, generator=generator
    )
    if f_var.shape == f_mu.shape:
        return f_mu + f_var.clamp(min=0).sqrt() * z
    evals, evecs = torch.linalg.eigh(f_var)
    root = evecs * evals.clamp(min=0).sqrt().unsqueeze(-2)  # (n, C, C)
    return f_mu + torch.einsum("ncd,snd->snc", root, z)


def centred_logits(f_mu: torch.Tensor, f_var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian of the centred logits ``P f``, ``P = I - 1 1^T / C``.

    .. math::

        P\\mu = \\mu - \\bar\\mu\\,\\mathbf 1, \\qquad
        (P \\Sigma P)_{ij} = \\Sigma_{ij} - \\bar\\Sigma_{i\\cdot} - \\bar\\Sigma_{\\cdot j}
        + \\bar\\Sigma_{\\cdot\\cdot},

    with bars the means over the classes. ``f_mu`` is ``(n, C)`` and ``f_var``
    ``(n, C, C)``.
    """
    row_means = f_var.mean(dim=-1, keepdim=True)
    column_means = f_var.mean(dim=-2, keepdim=True)
    total_means = row_means.mean(dim=-2, keepdim=True)
    return (
        f_mu - f_mu.mean(dim=-1, keepdim=True),
        f_var - row_means - column_means + total_means,
    )


def probit(f_mu: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
    """Class probabilities by the probit approximation on the centred logits.

    .. math::

        p \\approx \\operatorname{softmax}\\big(\\kappa \\odot P\\mu\\big), \\qquad
        \\kappa_c = \\big(1 + \\tfrac{\\pi}{8} (P \\Sigma P)_{cc}\\big)^{-1/2},

    laplace-torch's probit (MacKay, 1992) with ``(mu, Sigma)`` replaced by the centred
    ``(P mu, P Sigma P)`` (:func:`centred_logits`). The exact predictive is the same for
    both, but the probit scales each logit by its own variance, so a variance every
    logit shares, which cannot change a prediction, shrinks all of them toward a
    uniform prediction. For ``C`` classes that shared variance is what the prior
    leaves along ``1``.

    Parameters
    ----------
    f_mu : torch.Tensor
        ``(n, C)`` logit means.
    f_var : torch.Tensor
        ``(n, C, C)`` logit covariances.

    Returns
    -------
    torch.Tensor
        ``(n, C)`` probabilities.

    """
    f_mu, f_var = centred_logits(f_mu, f_var)
    variances = f_var.diagonal(dim1=-2, dim2=-1).clamp(min=0)
    kappa = 1 / torch.sqrt(1.0 + math.pi / 8 * variances)
    return torch.softmax(kappa * f_mu, dim=-1)


def laplace_bridge(
    f_mu: torch.Tensor, f_var: torch.Tensor, normalize: bool = False
) -> torch.Tensor:
    """Laplace bridge from a Gaussian over logits to class probabilities.

    laplace-torch's formula (Hobbhahn et al., 2022), with one change: the mean is
    centred first (``f_mu - mean(f_mu)``, which leaves softmax unchanged). The bridge
    conditions the Gaussian on ``sum(f) = 0`` and shifts the mean by
    ``Sigma 1 * sum(mu) / (1^T Sigma 1)``; a GLAS posterior has almost no variance
    along the softmax-invariant direction ``1``, so without centring that shift
    divides by nearly zero and moves the mean arbitrarily far.
    """
    f_mu = f_mu - f_mu.mean(-1, keepdim=True)
    total = f_var.sum(dim=(1, 2)).reshape(-1, 1, 1)
    f_var = f_var - torch.einsum("bi,bj->bij", f_var.sum(-1), f_var.sum(-2)) / total
    K = f_mu.size(-1)
    f_var_diag = torch.diagonal(f_var, dim1=1, dim2=2)
    if normalize:
        mean_var = f_var_diag.mean(dim=1) / math.sqrt(K / 2)
        f_mu = f_mu / mean_var.sqrt().unsqueeze(-1)
        f_var_diag = f_var_diag / mean_var.unsqueeze(-1)
    sum_exp = torch.exp(-f_mu).sum(dim=1).unsqueeze(-1)
    alpha = (1 - 2 / K + f_mu.exp() / K**2 * sum_exp) / f_var_diag
    return torch.nan_to_num(alpha / alpha.sum(dim=1).unsqueeze(-1), nan=1.0)
