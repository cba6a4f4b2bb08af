"""The loss Hessian in the outputs that weights each example of the GGN, averaged over a
posterior's predictive.

The GGN of a fit weights example ``n`` by ``Lambda_n``, the Hessian of its loss in the
model's outputs:

.. math::

    G = \\frac1N \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n .

The standard choice is ``Lambda_n`` at the MAP's outputs ``f_n``: ``diag(p_n) - p_n
p_n^T`` for the softmax cross-entropy with ``p_n = softmax(f_n)``
(:func:`~laplace_glas.curvature.operators.factors.row_vectors`). It vanishes as ``p_n``
saturates: a confidently fitted training point then constrains no direction, although
its likelihood falls steeply as soon as its margin shrinks, and those directions keep
the prior's variance. :class:`PosteriorAveragedHessian` replaces it by its average
over a Gaussian posterior's predictive at ``x_n`` (the mean held at the MAP):

.. math::

    \\tilde\\Lambda_n = \\sum_j w_j \\,
    \\mathbb E_{f \\sim \\mathcal N(f_n, V_j(x_n))}
    \\left[\\operatorname{diag}(p(f)) - p(f) p(f)^\\top\\right],
    \\qquad \\sum_j w_j = 1,

with ``V_j(x) = J(x) Sigma_j J(x)^T`` the logit covariance of posterior ``j`` (a
mixture of the last posteriors damps the fixed-point iteration of
:func:`~laplace_glas.posterior.fixed_point.fit_posterior_curvature`). The expectation
is a Monte Carlo average over ``S`` antithetic draws ``f_n +- L_j(x_n) eps_s`` of
standard normals ``eps_s`` drawn once per instance, so that every pass of a fit (and
every loader order) sees the same ``tilde Lambda_n`` for the same example: the
operator of the eigen-solver is one fixed matrix. ``tilde Lambda_n`` keeps the
softmax's null direction ``1`` (every ``diag(p) - p p^T`` does), so its eigen-
decomposition ``Q diag(w) Q^T`` gives ``C - 1`` rows ``sqrt(w_r) q_r^T`` (the
smallest eigenvalue, that of ``1``, left out): the row count of the MAP's, so every
quantity built from the rows (the factored GGN, its KFAC factors, the stored
Jacobians, the per-example GGN diagonal's columns) takes it unchanged.

The operators that differentiate the loss itself (curvlinops' GGN, the linearised
operators) take it through a surrogate: batches whose targets are the rows
(:class:`RowsBatches`) and the loss :class:`RowsQuadraticLoss`
``1/2 sum_n sum_r (l_{n,r}^T f_n)^2``, whose Hessian in ``f_n`` is
``sum_r l_{n,r} l_{n,r}^T = tilde Lambda_n``: the GGN of the surrogate is the
averaged one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "LogitCovariance",
    "OutputHessianRefusal",
    "PosteriorAveragedHessian",
    "RowsBatches",
    "RowsQuadraticLoss",
    "check_n_draws",
    "mean_softmax_hessian",
    "softmax_hessian",
]

LogitCovariance = Callable[[Any], torch.Tensor]
"""``x -> J(x) Sigma J(x)^T``: the ``(B, C, C)`` logit covariance of a posterior."""


class OutputHessianRefusal(ValueError):
    """A part of a fit that takes only the loss's own Hessian at the outputs (KFAC's
    data pass) was asked to follow a posterior-averaged one.
    """


def check_n_draws(n_draws: Any) -> int:
    """``n_draws`` if it is an even int >= 2 (antithetic pairs), else a ``ValueError``."""
    if isinstance(n_draws, bool) or not isinstance(n_draws, int) or n_draws < 2:
        raise ValueError(f"n_draws must be an even int >= 2; got {n_draws!r}.")
    if n_draws % 2:
        raise ValueError(f"n_draws must be even (antithetic pairs); got {n_draws}.")
    return n_draws


def softmax_hessian(p: torch.Tensor) -> torch.Tensor:
    """``diag(p) - p p^T`` over the last axis (the softmax cross-entropy's Hessian in
    the logits at probabilities ``p``).
    """
    return torch.diag_embed(p) - p[..., :, None] * p[..., None, :]


def mean_softmax_hessian(p: torch.Tensor) -> torch.Tensor:
    """``(1/S) sum_s diag(p_s) - p_s p_s^T`` ``(..., C, C)`` of draws ``p`` ``(S, ..., C)``.

    .. math::

        \\frac1S \\sum_s \\big(\\operatorname{diag}(p_s) - p_s p_s^\\top\\big)
        = \\operatorname{diag}(\\bar p) - \\frac1S \\sum_s p_s p_s^\\top ,

    the second moment as one batched product over the draws instead of ``S`` outer
    products (:func:`softmax_hessian` of every draw, then their mean).
    """
    second_moment = torch.einsum("s...i,s...j->...ij", p, p) / p.shape[0]
    return torch.diag_embed(p.mean(0)) - second_moment


def _psd_root(V: torch.Tensor) -> torch.Tensor:
    """``L`` with ``L L^T = V`` for symmetric PSD ``(..., C, C)`` (eigenvalues below 0
    from rounding are set to 0; no Cholesky, which singular covariances refuse).
    """
    w, Q = torch.linalg.eigh(0.5 * (V + V.transpose(-1, -2)))
    return Q * w.clamp_min(0).sqrt()[..., None, :]


class PosteriorAveragedHessian:
    """``tilde Lambda_n``: the softmax cross-entropy's output Hessian averaged over a
    mixture of posteriors' predictives, the mean held at the model's outputs.

    Parameters
    ----------
    covariances : sequence of callables
        ``x -> J(x) Sigma_j J(x)^T`` ``(B, C, C)`` for each posterior of the mixture
        (e.g. :func:`~laplace_glas.posterior.fixed_point.frozen_logit_covariance`).
    weights : sequence of float
        ``w_j >= 0`` summing to one, one per covariance.
    n_draws : int
        ``S``, Monte Carlo draws per example (even: ``S / 2`` antithetic pairs).
    seed : int
        Seed of the draws' ``torch.Generator`` (the draws are made once, on first use).

    Raises
    ------
    ValueError
        If the weights and covariances differ in number, a weight is negative, they do
        not sum to one, or ``n_draws`` is not a positive even number.

    """

    def __init__(
        self,
        covariances: Sequence[LogitCovariance],
        weights: Sequence[float],
        n_draws: int = 256,
        seed: int = 0,
    ):
        if len(covariances) == 0 or len(covariances) != len(weights):
            raise ValueError(
                f"One weight per covariance is needed; got {len(covariances)} covariances "
                f"and {len(weights)} weights."
            )
        if any(w < 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-9:
            raise ValueError(f"The weights must be >= 0 and sum to 1; got {list(weights)}.")
        self.covariances = tuple(covariances)
        self.weights = tuple(float(w) for w in weights)
        self.n_draws = check_n_draws(n_draws)
        self.seed = seed
        self._eps: torch.Tensor | None = None

    def draws(self, C: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The ``(S, C)`` standard normals ``[eps; -eps]`` (made once, then reused)."""
        if self._eps is None or self._eps.shape[1] != C:
            g = torch.Generator().manual_seed(self.seed)
            half = torch.randn(self.n_draws // 2, C, generator=g, dtype=torch.float64)
            self._eps = torch.cat([half, -half])
        return self._eps.to(dtype=dtype, device=device)

    def matrices(self, X: Any, outputs: torch.Tensor) -> torch.Tensor:
        """``tilde Lambda_n`` ``(B, C, C)`` of the batch ``X`` with MAP outputs
        ``outputs`` ``(B, C)``.
        """
        if outputs.ndim != 2:
            raise NotImplementedError(
                "The posterior-averaged output Hessian needs outputs of shape (batch, "
                f"classes); got {tuple(outputs.shape)} (sequence outputs are not supported)."
            )
        f = outputs.detach()
        B, C = f.shape
        eps = self.draws(C, f.dtype, f.device)
        total = f.new_zeros(B, C, C)
        for weight, covariance in zip(self.weights, self.covariances):
            if weight == 0.0:
                continue
            with torch.no_grad():
                V = covariance(X).to(dtype=f.dtype, device=f.device)
            if V.shape != (B, C, C):
                raise ValueError(
                    f"A logit covariance of shape {tuple(V.shape)} for outputs of shape "
                    f"{(B, C)}; expected {(B, C, C)}."
                )
            logits = f + torch.einsum("bij,sj->sbi", _psd_root(V), eps)  # (S, B, C)
            total += weight * mean_softmax_hessian(torch.softmax(logits, -1))
        return total

    def rows(
        self, X: Any, outputs: torch.Tensor, y: torch.Tensor, ignore_index: int, scale: float
    ) -> torch.Tensor:
        """``(C - 1, B, C)``: rows ``r`` of ``tilde Lambda_n^{1/2}`` times ``scale``,
        zero for targets equal to ``ignore_index`` (the layout of
        :func:`~laplace_glas.curvature.operators.factors.row_vectors`).
        """
        Lam = self.matrices(X, outputs)
        w, Q = torch.linalg.eigh(0.5 * (Lam + Lam.transpose(-1, -2)))
        # ascending: the first is the null direction 1 of every softmax Hessian
        half = Q[..., 1:] * w[..., 1:].clamp_min(0).sqrt()[..., None, :]  # (B, C, C-1)
        mask = (y.reshape(-1) != ignore_index).to(outputs.dtype) * scale
        return (half * mask[:, None, None]).permute(2, 0, 1).to(outputs.dtype)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_posteriors={len(self.covariances)}, "
            f"weights={self.weights}, n_draws={self.n_draws})"
        )


class RowsQuadraticLoss(nn.Module):
    """``1/2 sum_n sum_r (l_{n,r}^T f_n)^2`` of outputs ``f`` ``(B, C)`` and rows ``l``
    ``(B, R, C)`` (the "targets"): its Hessian in ``f_n`` is ``sum_r l_{n,r}
    l_{n,r}^T``, so its GGN is ``sum_n J_n^T (sum_r l_{n,r} l_{n,r}^T) J_n``. Summed
    over the examples (``reduction='sum'``, the reduction curvlinops reads).
    """

    reduction = "sum"

    def forward(self, outputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The loss (a scalar)."""
        return 0.5 * torch.einsum("brc,bc->br", rows, outputs).square().sum()


class RowsBatches:
    """``(X, l)`` batches of ``data``'s ``(X, y)``: the targets replaced by the rows
    ``l`` ``(B, C - 1, C)`` of ``output_hessian`` at the model's outputs (computed on
    every pass, without gradients), the targets of :class:`RowsQuadraticLoss`.

    Parameters
    ----------
    data : iterable
        ``(X, y)`` pairs (``XYBatches``); its length and ``unit`` are passed on.
    model : nn.Module
        The network at the weights of the fit.
    output_hessian : PosteriorAveragedHessian
        The averaged Hessian.
    ignore_index : int
        Targets left out (zero rows).
    to_device : callable
        Moves an input batch to the model's device (for the outputs).

    """

    def __init__(
        self,
        data: Iterable,
        model: nn.Module,
        output_hessian: PosteriorAveragedHessian,
        ignore_index: int,
        to_device: Callable[[Any], Any],
    ):
        self.data = data
        self.model = model
        self.output_hessian = output_hessian
        self.ignore_index = ignore_index
        self.to_device = to_device

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        for X, y in self.data:
            inputs = self.to_device(X)
            with torch.no_grad():
                outputs = self.model(inputs)
            rows = self.output_hessian.rows(inputs, outputs, y.to(outputs.device),
                                            self.ignore_index, 1.0)  # fmt: skip
            yield X, rows.permute(1, 0, 2)

    def __len__(self) -> int:
        """The number of batches of ``data``."""
        return len(self.data)

    @property
    def unit(self) -> str:
        """What one batch is called in messages (``data``'s)."""
        return getattr(self.data, "unit", "batch")
