"""Link functions from a Gaussian over logits (or outputs) to predictions.

* :func:`gaussian_samples` draws from ``N(f_mu, f_var)`` row by row through an
  eigen-decomposition: the GLAS output covariance ``(J U) diag(v) (J U)^T`` has rank at
  most k, so the Cholesky factorisation laplace-torch uses fails whenever ``C > k``.
* :func:`laplace_bridge` is laplace-torch's Laplace bridge with the mean centred first.
"""

from __future__ import annotations

import math

import torch

__all__ = ["gaussian_samples", "laplace_bridge"]


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
