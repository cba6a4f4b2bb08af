"""Where the predictive uncertainty comes from: the Jacobian's alignment with the subspace.

For an input ``x`` with output Jacobian ``J = J(x)`` (``C x D``, one row per output; for
outputs ``(batch, ..., C)`` one such block per leading position, as in the 'glm'
predictive) and a GLAS posterior with eigenvectors ``U = [u_1 .. u_k]`` and variances
``v_j``, :func:`alignment` returns per input row

.. math::

    \\|J\\|_F^2, \\qquad
    \\|J U\\|_F^2 = \\sum_{j=1}^k \\|J u_j\\|^2, \\qquad
    \\mathrm{captured} = \\frac{\\|J U\\|_F^2}{\\|J\\|_F^2}, \\qquad
    \\mathrm{residual} = \\|J\\|_F^2 - \\|J U\\|_F^2 = \\|J (I - U U^\\top)\\|_F^2,

and the contribution of each kept direction to the trace of the 'glm' covariance,

.. math::

    \\mathrm{variance\\_by\\_direction}_{j} = v_j \\|J u_j\\|^2 = v_j \\sum_c (J u_j)_c^2,
    \\qquad \\mathrm{variance} = \\sum_j v_j \\|J u_j\\|^2
    = \\mathrm{tr}\\,(J U \\mathrm{diag}(v) U^\\top J^\\top)

(per output ``c`` with ``per_output=True``: ``v_j (J u_j)_c^2``). ``variance`` is the
total 'glm' variance with ``complement='zero'``. With ``complement='prior'`` the
posterior adds the prior's variance ``1/tau`` off ``span(U)``, and since ``U`` is
orthonormal its total 'glm' variance is exactly

.. math::

    \\mathrm{tr}\\,\\bigl(J U \\mathrm{diag}(v - 1/\\tau) U^\\top J^\\top + J J^\\top / \\tau\\bigr)
    = \\mathrm{variance} + \\mathrm{residual} / \\tau ,

:attr:`Alignment.combined`: the out-of-subspace energy ``residual`` (the score of
sketched-Lanczos uncertainty) enters at the prior's variance. With a curvature-aware
complement (``'diag'``, ``'kron'``, ``'kron_diag'``) the posterior is
``U diag(v) U^T + B`` with ``B = P E^{-1} P`` and ``U^T B = 0``, so its total 'glm'
variance is exactly

.. math::

    \\mathrm{variance} + \\mathrm{tr}\\,(J B J^\\top),

the second term (:attr:`Alignment.complement_variance`, from the Jacobian over all
weights as the 'glm' predictive forms it) being the complement's share.
:attr:`Alignment.total_variance` is the 'glm' variance of the posterior in use, whatever
its complement. An input whose Jacobian
points away from the kept directions has a small ``captured`` share, and with
``complement='zero'`` almost no variance; :func:`ood_scores` turns these numbers into
out-of-distribution scores (larger = more unusual).

Cost: ``J U`` takes ``k`` forward-mode JVPs (as the 'glm' predictive). ``||J||_F^2`` is
a sum of squared per-example gradient norms, ``sum_c ||grad_theta f_c(x)||^2``: one
reverse-mode pass per output entry of an example, vectorised with ``torch.func.vmap``
over the examples of a chunk and over output entries. Only the squared norms are kept:
at most ``_BUDGET`` (``2**24``) gradient numbers exist at once over the chunk, so for
large ``D`` or ``C`` the ``C x D`` Jacobians of the chunk are never formed whole (the
output entries are taken in slices). Cost: ``C`` (times the positions) backward passes
per input, against ``k`` forward passes for ``J U``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import vjp, vmap

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.autodiff.functional import module_call
from laplace_glas.autodiff.rnn import elementary_rnns
from laplace_glas.posterior.view import FittedPosterior, fitted_posterior
from laplace_glas.predictive.jvp import (
    jacobian_by_backward,
    jacobian_gram,
    jvp_directions,
    row_chunks,
    unflatten,
)
from laplace_glas.progress import progress
from laplace_glas.validation import (
    check_model_output,
    flag,
    positive_int,
    scalar_prior_precision,
)

__all__ = ["Alignment", "alignment", "ood_scores"]

_BUDGET = 2**24  # gradient numbers held at once in the ||J||_F^2 pass (64 MiB in float32)


@dataclass(frozen=True)
class Alignment:
    """Per-input alignment of the output Jacobian with the kept subspace.

    Rows are the inputs (times the leading output positions of sequence outputs), in
    the order of the 'glm' predictive. See :mod:`laplace_glas.diagnostics.alignment` for
    the formulas.

    Attributes
    ----------
    jacobian_norm2 : torch.Tensor
        ``(n,)``: ``||J(x)||_F^2``.
    projected_norm2 : torch.Tensor
        ``(n,)``: ``||J(x) U||_F^2``.
    variance_by_direction : torch.Tensor
        ``(n, k)``: ``v_j ||J(x) u_j||^2``; ``(n, C, k)``: ``v_j (J(x) u_j)_c^2`` if made
        with ``per_output=True``.
    prior_precision : float
        ``tau`` of the posterior, for :attr:`combined`.
    complement : str
        The posterior's complement (what :attr:`total_variance` adds).
    complement_variance : torch.Tensor or None
        ``(n,)``: ``tr(J B J^T)``, the complement's share of the 'glm' variance for
        ``'diag'``, ``'kron'`` and ``'kron_diag'`` (None for ``'zero'`` and ``'prior'``).

    """

    jacobian_norm2: torch.Tensor
    projected_norm2: torch.Tensor
    variance_by_direction: torch.Tensor
    prior_precision: float
    complement: str = "zero"
    complement_variance: torch.Tensor | None = None

    @property
    def residual(self) -> torch.Tensor:
        """``||J||_F^2 - ||J U||_F^2`` (round-off below zero clipped to 0)."""
        return (self.jacobian_norm2 - self.projected_norm2).clamp_min(0.0)

    @property
    def captured(self) -> torch.Tensor:
        """``||J U||_F^2 / ||J||_F^2`` in ``[0, 1]`` (1 where ``J = 0``: nothing escapes)."""
        norm2 = self.jacobian_norm2
        share = self.projected_norm2 / torch.where(norm2 > 0, norm2, torch.ones_like(norm2))
        return torch.where(norm2 > 0, share, torch.ones_like(share)).clamp(0.0, 1.0)

    @property
    def variance(self) -> torch.Tensor:
        """``sum_j v_j ||J u_j||^2``: the 'glm' variance (trace over outputs) with
        ``complement='zero'``.
        """
        dims = (-2, -1) if self.variance_by_direction.ndim == 3 else (-1,)
        return self.variance_by_direction.sum(dim=dims)

    @property
    def combined(self) -> torch.Tensor:
        """``variance + residual / tau``: the 'glm' variance (trace over outputs) with
        ``complement='prior'``.
        """
        if not self.prior_precision > 0:
            raise ValueError(
                "The combined score residual / prior_precision needs prior_precision > 0, "
                f"got {self.prior_precision}."
            )
        return self.variance + self.residual / self.prior_precision

    @property
    def total_variance(self) -> torch.Tensor:
        """The trace of the 'glm' covariance of the posterior in use: :attr:`variance`
        (``'zero'``), :attr:`combined` (``'prior'``), or ``variance +
        complement_variance`` (the curvature-aware complements).
        """
        if self.complement == "prior":
            return self.combined
        if self.complement_variance is not None:
            return self.variance + self.complement_variance
        return self.variance

    @property
    def complement_share(self) -> torch.Tensor:
        """``1 - variance / total_variance``: the share of the 'glm' variance from
        outside ``span(U)`` (0 where the total is 0).
        """
        total = self.total_variance
        safe = torch.where(total > 0, total, torch.ones_like(total))
        return torch.where(total > 0, 1 - self.variance / safe, torch.zeros_like(total))


def _check_la(la: Any) -> FittedPosterior:
    """The public view of a fitted GLAS posterior ``la``; a clear error for any other object."""
    return fitted_posterior(la, "alignment")


def _per_example_norms(
    model: torch.nn.Module,
    primals: dict[str, torch.Tensor],
    x: Any,
    n_outputs: int,
    dict_key_x: str,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(rows, )`` squared Frobenius norms of the Jacobian rows-blocks of one chunk
    (over the flattened weights ``indices`` of ``primals`` only, when given: a
    subnetwork's).

    Each example's output entries ``f_o`` (``o`` over positions and outputs) get their
    gradients ``grad_theta f_o`` by reverse mode, vectorised over examples and over
    output entries; only their squared norms are kept.
    """
    n_parallel = 1 if isinstance(x, Mapping) else max(x.shape[0], 1)  # examples under vmap

    def one(batch: Any) -> torch.Tensor:
        """Squared gradient norms of one example (``batch`` holds it with a batch axis)."""

        def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return check_model_output(module_call(model, params, (batch,))).reshape(-1)

        out, pullback = vjp(f, primals)
        n_entries = out.shape[0]
        n_params = sum(p.numel() for p in primals.values())
        step = max(1, min(n_entries, _BUDGET // max(n_params * n_parallel, 1)))
        eye = torch.eye(n_entries, dtype=out.dtype, device=out.device)

        def sq_norm(cotangent: torch.Tensor) -> torch.Tensor:
            (grads,) = pullback(cotangent)
            if indices is not None:
                flat = torch.cat([g.reshape(-1) for g in grads.values()])
                return flat[indices].square().sum()
            return sum(g.square().sum() for g in grads.values())

        try:
            norms = vmap(sq_norm, chunk_size=step)(eye)  # (n_entries,)
        except (RuntimeError, NotImplementedError):
            norms = torch.stack([sq_norm(row) for row in eye])
        return norms.reshape(-1, n_outputs).sum(dim=-1)

    def by_backward(batch: Any) -> torch.Tensor:
        """:func:`one` from the Jacobian rows by plain autograd
        (:func:`~laplace_glas.predictive.jvp.jacobian_by_backward`): for models torch.func
        refuses (activation checkpointing, reentrant or not).
        """

        def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
            return check_model_output(module_call(model, params, (batch,))).reshape(-1)

        J = jacobian_by_backward(f, primals, list(primals))  # (1, entries, D)
        rows = J.reshape(-1, J.shape[-1])
        rows = rows if indices is None else rows[:, indices]
        return rows.square().sum(-1).reshape(-1, n_outputs).sum(dim=-1)

    def one_or_by_backward(batch: Any) -> torch.Tensor:
        try:
            return one(batch)
        except RuntimeError as err:  # what torch.func refuses, plain autograd may take
            try:
                return by_backward(batch)
            except Exception:
                raise err from None

    if not isinstance(x, Mapping):
        try:
            return vmap(lambda x_i: one(x_i.unsqueeze(0)), randomness="same")(x).reshape(-1)
        except (RuntimeError, NotImplementedError):
            # a module without a batching rule: one example at a time (the loop raises
            # the caller's own errors, e.g. a wrong input shape)
            n_parallel = 1
    return torch.cat([one_or_by_backward(row) for row in row_chunks(x, 1, dict_key_x)])


def alignment(
    la: Any,
    x: torch.Tensor | Mapping[str, Any],
    *,
    per_output: bool = False,
    chunk_size: int | None = 32,
    progress_bar: bool = False,
) -> Alignment:
    """Alignment of ``J(x)`` with the kept subspace ``span(U)`` of a GLAS posterior.

    .. math::

        \\|J\\|_F^2,\\quad \\|JU\\|_F^2,\\quad
        \\mathrm{captured} = \\|JU\\|_F^2 / \\|J\\|_F^2,\\quad
        \\mathrm{residual} = \\|J\\|_F^2 - \\|JU\\|_F^2,\\quad
        v_j \\|J u_j\\|^2 .

    Parameters
    ----------
    la : ActiveSubspaceLaplace
        A fitted GLAS posterior (any model and likelihood it supports; classification
        Jacobians are those of the logits, as in its 'glm' predictive).
    x : torch.Tensor or mapping
        Inputs ``(batch, ...)`` (or a mapping with the batch under ``la.dict_key_x``),
        in the model's dtype.
    per_output : bool, default=False
        Keep ``variance_by_direction`` per output: ``(n, C, k)`` instead of ``(n, k)``.
    chunk_size : int or None, default=32
        Inputs processed at once (memory bound; ``None`` = all).
    progress_bar : bool, default=False
        ``tqdm`` progress over the chunks.

    Returns
    -------
    Alignment
        ``n = batch * ...`` rows (one per leading output position).

    Raises
    ------
    TypeError
        If ``la`` is not an ``ActiveSubspaceLaplace`` or ``x`` has another dtype.
    ValueError
        If ``la`` is not fitted, or ``x`` is empty or not finite.

    """
    posterior = _check_la(la)
    per_output = flag("per_output", per_output)
    progress_bar = flag("progress_bar", progress_bar)
    chunk_size = positive_int("chunk_size", chunk_size)
    if not isinstance(x, (torch.Tensor, Mapping)):
        raise TypeError(
            "x must be a tensor of inputs (batch, ...) or a mapping with them under "
            f"la.dict_key_x, got {type(x).__name__}."
        )
    posterior.check_inputs(x)
    posterior.check_fitted_weights()
    x = posterior.to_device(x)
    # over the network's weights: a subnetwork's directions embedded in them, its
    # Jacobian norms over its own weights (weight_indices)
    U, v = posterior.network_directions(posterior.n_components), la.posterior_variances
    theta = posterior.network_weights.detach()
    indices = posterior.weight_indices
    names, shapes = posterior.param_names, posterior.param_shapes
    primals = unflatten(theta, names, shapes)
    norms, projected, by_direction, outside = [], [], [], []
    complement = posterior.complement
    B = None
    if complement not in ("zero", "prior"):
        B = posterior.posterior_in_use().covariance_factors()[2]
    chunks = list(row_chunks(x, chunk_size, la.dict_key_x))
    with (
        torch.no_grad(),
        autodiff_friendly(la.model),
        elementary_rnns(la.model, only_off_cpu=False),
    ):
        for rows in progress(chunks, "alignment", progress_bar):
            f, JU = jvp_directions(la.model, names, shapes, theta, rows, U, la.jvp_chunk_size)
            if f.ndim < 2:
                raise ValueError(
                    "alignment needs model outputs of shape (batch, ..., outputs); got "
                    f"{tuple(f.shape)}."
                )
            n_out = f.shape[-1]
            JU = JU.reshape(-1, n_out, JU.shape[-1])  # (rows, C, k)
            squares = JU.square()
            projected.append(squares.sum(dim=(1, 2)))
            weighted = squares * v
            by_direction.append(weighted if per_output else weighted.sum(dim=1))
            with torch.enable_grad():
                norm2 = _per_example_norms(la.model, primals, rows, n_out, la.dict_key_x, indices)
                norms.append(norm2.detach())
                if B is not None:  # tr(J B J^T) from the Jacobian over all weights
                    gram = jacobian_gram(
                        la.model, names, shapes, theta, rows, chunk_size=chunk_size,
                        dict_key_x=la.dict_key_x, weights=B,
                    )  # fmt: skip
                    outside.append(torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1).detach())
    scalar_prior_precision(posterior.prior_precision)
    tau = posterior.tau
    return Alignment(
        jacobian_norm2=torch.cat(norms),
        projected_norm2=torch.cat(projected),
        variance_by_direction=torch.cat(by_direction),
        prior_precision=tau,
        complement=complement,
        complement_variance=torch.cat(outside) if B is not None else None,
    )


def ood_scores(result: Alignment) -> dict[str, torch.Tensor]:
    """Out-of-distribution scores from an :class:`Alignment` (larger = more unusual).

    Returns
    -------
    dict
        ``'variance'``: :attr:`Alignment.total_variance`, the 'glm' variance of the
        posterior in use (its complement included);
        ``'variance (zero)'``: ``sum_j v_j ||J u_j||^2``, the 'glm' variance with
        ``complement='zero'``; ``'variance (prior)'``: ``variance + residual / tau``,
        the 'glm' variance with ``complement='prior'`` (equal to it, see
        :attr:`Alignment.combined`; left out when ``tau = 0``);
        ``'residual'``: ``||J (I - U U^T)||_F^2``; ``'1 - captured'``: the share of
        ``||J||_F^2`` outside ``span(U)``. Each ``(n,)``.

    """
    if not isinstance(result, Alignment):
        raise TypeError(f"ood_scores needs an Alignment, got {type(result).__name__}.")
    scores = {"variance": result.total_variance, "variance (zero)": result.variance}
    if math.isfinite(result.prior_precision) and result.prior_precision > 0:
        scores["variance (prior)"] = result.combined
    scores["residual"] = result.residual
    scores["1 - captured"] = 1.0 - result.captured
    return scores
