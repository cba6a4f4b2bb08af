"""Link functions from a Gaussian over logits (or outputs) to predictions.

* :func:`gaussian_samples` draws from ``N(f_mu, f_var)`` row by row through an
  eigen-decomposition: the GLAS output covariance ``(J U) diag(v) (J U)^T`` has rank at
  most k, so the Cholesky factorisation laplace-torch uses fails whenever ``C > k``.
* :func:`probit` is the probit approximation of the softmax applied to differences of
  logits (a mean-field approximation): for two classes it is the binary probit.
* :func:`laplace_bridge` is laplace-torch's Laplace bridge with the mean centred first.

Softmax does not change when the same number is added to every logit,
``softmax(f + c 1) = softmax(f)``, so the exact predictive ``E[softmax(f)]`` under
``f ~ N(mu, Sigma)`` depends on the logits' differences only. A Laplace posterior keeps
the prior's variance along weight directions no data constrains, such as shifting every
class's bias by the same amount; they give every logit the same large variance, which
cannot change a prediction. laplace-torch's probit ``softmax(kappa * mu)``,
``kappa_c = (1 + pi/8 Sigma_cc)^{-1/2}``, scales each logit by its own variance and so
reads that shared variance as uncertainty in every class; :func:`probit` sees only
the variances of differences, ``Var(f_c - f_j)``, in which it cancels.
"""

from __future__ import annotations

import math

import torch

__all__ = ["gaussian_samples", "laplace_bridge", "probit"]


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


def probit(f_mu: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
    """Class probabilities by the probit approximation on differences of logits.

    .. math::

        p_c \\propto \\Big(\\sum_{j=1}^C \\exp\\Big(-\\frac{\\mu_c - \\mu_j}
        {\\sqrt{1 + \\tfrac{\\pi}{8}\\,V_{cj}}}\\Big)\\Big)^{-1}, \\qquad
        V_{cj} = \\operatorname{Var}(f_c - f_j) = \\Sigma_{cc} + \\Sigma_{jj} - 2\\Sigma_{cj},

    normalised over ``c``. The softmax is ``softmax(f)_c = 1 / sum_j exp(-(f_c - f_j))``,
    a function of the differences ``f_c - f_j ~ N(mu_c - mu_j, V_cj)``; the
    approximation scales each difference's mean by ``(1 + pi/8 V_cj)^{-1/2}``, as the
    binary probit ``E[sigmoid(d)] ~ sigmoid(m / sqrt(1 + pi/8 v))`` does, term by term
    as though the differences were independent (a mean-field approximation of the
    Gaussian-softmax integral; Lu, Ie and Sha, 2020, take it for a diagonal ``Sigma``).
    For two classes it is that binary probit exactly, and for any ``C`` it depends on
    ``(mu, Sigma)`` only through the differences of the logits, as the exact predictive
    does. laplace-torch's ``softmax(kappa * mu)`` is neither: for two independent
    logits of equal variance it counts half of ``V_12``, and a variance all logits
    share shrinks every prediction toward uniform. Like any such approximation it can
    be more or less confident than the exact predictive.

    Besides its output it holds a few ``(n, C, C)`` buffers, as large as ``f_var``.

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

    Raises
    ------
    ValueError
        If the shapes are not ``(n, C)`` and ``(n, C, C)``.

    """
    if f_mu.ndim != 2 or f_var.shape != (*f_mu.shape, f_mu.shape[-1]):
        raise ValueError(
            "probit takes logit means (n, C) and covariances (n, C, C), got "
            f"{tuple(f_mu.shape)} and {tuple(f_var.shape)}."
        )
    variances = f_var.diagonal(dim1=-2, dim2=-1)
    difference_variances = variances.unsqueeze(-1) + variances.unsqueeze(-2)
    difference_variances.sub_(f_var).sub_(f_var.mT)  # in place: a fresh tensor
    scale = torch.sqrt(1.0 + math.pi / 8 * difference_variances.clamp(min=0))
    margins = (f_mu.unsqueeze(-1) - f_mu.unsqueeze(-2)) / scale  # (n, c, j)
    return torch.softmax(-torch.logsumexp(-margins, dim=-1), dim=-1)


def laplace_bridge(
    f_mu: torch.Tensor, f_var: torch.Tensor, normalize: bool = False
) -> torch.Tensor:
    """Laplace bridge from a Gaussian over logits to class probabilities.

    laplace-torch's formula (Hobbhahn et al., 2022), with one change: the mean is
    centred first (``f_mu - mean(f_mu)``, which leaves softmax unchanged). The bridge
    conditions the Gaussian on ``sum(f) = 0`` and shifts the mean by
    ``Sigma 1 * sum(mu) / (1^T Sigma 1)``; a posterior on a subspace
    (``complement='zero'``) can have almost no variance along the softmax-invariant
    direction ``1``, so without centring that shift divides by nearly zero and moves
    the mean arbitrarily far.
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
