"""One curvature problem: everything that describes the matrix a fit eigen-decomposes.

A fit (or a public ``compute_eigenpairs`` call) builds one :class:`CurvatureProblem`
and hands it to the planner (:func:`~laplace_glas.curvature.memory.planner.plan_solve`), which
chooses the operator and the solver. The problem fixes the matrix, not how it is
applied: the model at its weights, the trainable parameters, the data, the loss whose
GGN (or empirical Fisher / Hessian) is taken and the factor that turns that loss's
curvature into the unit-noise mean-loss curvature over the ``N`` likelihood terms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from curvlinops import GGNLinearOperator
from torch import nn

from laplace_glas.curvature.data.batches import (
    XYBatches,
    batch_size,
    batch_to_device,
    split_batch,
    subsample_loader,
)
from laplace_glas.curvature.data.map_loss import count_terms, curvature_loss
from laplace_glas.curvature.data.output_hessian import (
    PosteriorAveragedHessian,
    RowsBatches,
    RowsQuadraticLoss,
)
from laplace_glas.curvature.data.replay import ReplayedBatches
from laplace_glas.curvature.operators.curvlinops import LossOnData, curvlinops_operator
from laplace_glas.curvature.parallel.distributed import Shards, sum_count

__all__ = ["CurvatureProblem", "curvature_likelihood"]


def curvature_likelihood(likelihood: str) -> str:
    """The likelihood of the curvature and of the training loss: laplace-torch fits
    ``'reward_modeling'`` as ``'classification'`` (Bradley-Terry preference pairs: a
    softmax over the pair's two rewards).
    """
    return "classification" if likelihood == "reward_modeling" else likelihood


@dataclass(frozen=True)
class CurvatureProblem:
    """The curvature to eigen-decompose: the unit-noise mean-loss GGN.

    .. math::

        G = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

    with ``J_n`` the Jacobian of the model output of term ``n`` in the parameters and
    ``Lambda_n`` the Hessian of the loss in the outputs (unit noise). ``scale`` times
    curvlinops' curvature of ``loss_func`` on ``data`` is ``G``.

    Attributes
    ----------
    model : nn.Module
        The network at the weights of the fit, in eval mode.
    params : tuple of torch.Tensor
        The parameters under inference, in the order of the ``D``-vector.
    loss_func : nn.Module
        The loss whose GGN curvlinops takes (``MSELoss``, summed cross-entropy or the
        user's ``loss_fn`` on the model's device and dtype).
    scale : float
        ``G = scale * GGN(loss_func)``.
    num_data : int
        curvlinops' ``num_data`` (the number of points its mean reduction divides by).
    loader : iterable
        The batches of the solve (a subsample of the training loader if one was drawn).
    data : XYBatches
        ``loader`` as ``(X, y)`` pairs, the view curvlinops reads.
    batch_size_fn : callable or None
        The batch size of mapping inputs (``None`` for tensors).
    n_terms : int
        ``N``, the likelihood terms (points, or targets that are not ``ignore_index``)
        of ``loader``, summed over the shards.
    n_loader_terms : int
        ``N`` of the whole training loader (differs from ``n_terms`` for a subsample).
    out_shape : torch.Size
        The model output of one data point, e.g. ``(C,)`` or ``(seq_len, vocab)``.
    likelihood : {'regression', 'classification'}
        The curvature's likelihood (``'reward_modeling'`` is ``'classification'``).
    loss_fn : nn.Module or None
        The user's loss (``None``: the likelihood's).
    ignore_index : int
        Classification targets left out.
    dict_key_x, dict_key_y : str
        Keys of the input and the target in mapping batches.
    device : torch.device
        Where the batches and the products go (the model's device).
    dtype : torch.dtype
        The precision of the products (the model's).
    shards : Shards or None
        The ranks of a data-parallel fit (``None``: one process).
    progress_bar : bool
        Show progress bars while operators are built and applied.
    first_batch : any
        The first item of ``loader`` where it is known (the pass at the MAP kept it),
        else ``None``: one-batch measurements take it from :meth:`first_data` instead of
        starting another iterator of the loader (with ``num_workers > 0``, another set
        of worker processes).
    replays : any
        The training loader whose batches ``loader`` replays (the items the pass at
        the MAP kept, :mod:`~laplace_glas.curvature.data.replay`), else ``None``.
    kept_bytes : int
        Bytes of those kept batches (0 where none are kept), held for the whole fit
        (at most :data:`~laplace_glas.curvature.data.replay.KEPT_BYTES`).
    output_hessian : PosteriorAveragedHessian or None
        ``Lambda_n`` averaged over a posterior's predictive
        (:mod:`~laplace_glas.curvature.data.output_hessian`); ``None``: the loss
        Hessian at the model's outputs. The operators built from the rows of
        ``Lambda_n^{1/2}`` (factored, stored Jacobians, streamed factors) take it
        directly, the loss-based ones through :meth:`loss_on_data`'s surrogate.

    """

    model: nn.Module
    params: tuple[torch.Tensor, ...]
    loss_func: nn.Module
    scale: float
    num_data: int
    loader: Iterable
    data: XYBatches
    batch_size_fn: Callable | None
    n_terms: int
    n_loader_terms: int
    out_shape: torch.Size
    likelihood: str
    loss_fn: nn.Module | None = None
    ignore_index: int = -100
    dict_key_x: str = "input_ids"
    dict_key_y: str = "labels"
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    shards: Shards | None = None
    progress_bar: bool = False
    first_batch: Any = None
    replays: Any = None
    kept_bytes: int = 0
    output_hessian: PosteriorAveragedHessian | None = None

    def replay_of(self, loader: Any) -> Any:
        """What a pass over ``loader`` iterates: the batches this problem keeps where
        it replays ``loader``, else ``loader`` itself.
        """
        return self.loader if loader is not None and loader is self.replays else loader

    def first_batch_size(self) -> int:
        """Examples of ``first_batch`` (0 where it is not known)."""
        if self.first_batch is None:
            return 0
        return batch_size(split_batch(self.first_batch, self.dict_key_y)[0], self.dict_key_x)

    def first_data(self) -> Iterable:
        """``(X, y)`` batches whose first is the loader's first: ``first_batch`` alone
        where it is known, else ``data``.
        """
        if self.first_batch is None:
            return self.data
        return XYBatches([self.first_batch], self.dict_key_y)

    @property
    def n_params(self) -> int:
        """``D``, the number of parameters under inference."""
        return sum(p.numel() for p in self.params)

    def loss_on_data(self) -> LossOnData:
        """The problem's loss on its data: what curvlinops' operator and the
        linearised operators (kept or rebuilt) take. With an ``output_hessian`` the loss
        is its surrogate
        (:class:`~laplace_glas.curvature.data.output_hessian.RowsQuadraticLoss` on
        :class:`~laplace_glas.curvature.data.output_hessian.RowsBatches`), whose GGN is
        the averaged one at the same ``scale``.
        """
        loss_func, data = self.loss_func, self.data
        if self.output_hessian is not None:  # the surrogate whose Hessian is the average
            loss_func = RowsQuadraticLoss()
            data = RowsBatches(
                data,
                self.model,
                self.output_hessian,
                self.ignore_index,
                lambda X: batch_to_device(X, self.device),
            )
        return LossOnData(
            self.model, loss_func, self.params, data, self.num_data, self.batch_size_fn
        )

    def batch_arguments(self) -> dict[str, Any]:
        """``model``, ``params``, ``loader``, ``likelihood``, ``n_terms``,
        ``ignore_index``, ``dict_key_x``, ``dict_key_y``, ``device`` and
        ``output_hessian`` by name: the
        arguments of the operators that read this problem's batches themselves (the
        factored GGN, the stored Jacobians, the factored GGN rebuilt per batch).

        Returns
        -------
        dict of str to Any
            The keywords, ready for ``build_factored_ggn(**problem.batch_arguments())``.

        """
        return {
            "model": self.model,
            "params": self.params,
            "loader": self.loader,
            "likelihood": self.likelihood,
            "n_terms": self.n_terms,
            "ignore_index": self.ignore_index,
            "dict_key_x": self.dict_key_x,
            "dict_key_y": self.dict_key_y,
            "device": self.device,
            "output_hessian": self.output_hessian,
        }

    def reference_operator(self) -> GGNLinearOperator:
        """Curvlinops' GGN operator of ``loss_func`` on ``data`` (the reference; its
        products times ``scale`` are the unit-noise mean-loss GGN's).
        """
        return curvlinops_operator("ggn", self.loss_on_data())

    @classmethod
    def build(
        cls,
        model: nn.Module,
        params: Sequence[torch.Tensor],
        loader: Iterable,
        likelihood: str,
        out_shape: torch.Size,
        *,
        n_terms: int | None = None,
        subsample_size: int | None = None,
        generator: torch.Generator | None = None,
        loss_fn: nn.Module | None = None,
        ignore_index: int = -100,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        shards: Shards | None = None,
        progress_bar: bool = False,
        first_batch: Any = None,
        kept: ReplayedBatches | None = None,
        output_hessian: PosteriorAveragedHessian | None = None,
    ) -> CurvatureProblem:
        """The problem of ``loader`` (or of a subsample of ``subsample_size`` points
        drawn with ``generator``; ``first_batch``, the loader's first item where the
        caller has it, is kept for the loader itself, not for a subsample; ``kept``,
        all of its items where the caller kept them, are what the problem's passes
        iterate instead of ``loader``, unless it solves on a subsample).

        ``n_terms`` is ``N`` of ``loader`` when the caller has counted it (the pass at
        the MAP); otherwise it is counted from the targets (summed over ``shards``).

        A rank of ``shards`` whose step fails still takes part in the next collective
        of the fit (its failure flag set) and raises its error after it; the others
        raise a ``RuntimeError`` naming it.

        Raises
        ------
        ValueError
            If ``loader`` has no likelihood term.

        """
        likelihood = curvature_likelihood(likelihood)

        def count(batches: Iterable, error: Exception | None = None) -> int:
            n = 0
            try:  # a rank whose count (or an earlier step) fails still takes part
                if error is None:
                    n = count_terms(batches, likelihood, ignore_index, dict_key_x, dict_key_y)
            except Exception as err:
                error = err
            return sum_count(n, shards, device, error=error)

        if n_terms is None:
            n_terms = count(loader)
            if n_terms == 0:
                raise ValueError("The loader is empty (or all its targets are ignore_index).")
        eigen_loader, eigen_n, error = loader, n_terms, None
        replaying = kept is not None and subsample_size is None
        if replaying:
            eigen_loader = kept
        if subsample_size is not None:
            try:
                eigen_loader = subsample_loader(loader, subsample_size, generator)
            except Exception as err:
                error = err
            eigen_n = count(eigen_loader, error)
        try:  # local steps: a rank that fails them meets the others' next collective
            loss_func, scale, num_data = curvature_loss(
                likelihood,
                eigen_n,
                out_shape,
                ignore_index=ignore_index,
                loss_fn=loss_fn,
                device=device,
                dtype=dtype,
            )
            data = XYBatches(eigen_loader, dict_key_y)
            first = next(iter(loader)) if first_batch is None else first_batch
            batch_size_fn = _batch_size_fn(first, dict_key_x, dict_key_y)
        except Exception as err:
            if shards is None:
                raise
            sum_count(0, shards, device, error=err)  # raises err after the all-reduce
        return cls(
            model=model,
            params=tuple(params),
            loss_func=loss_func,
            scale=scale,
            num_data=num_data,
            loader=eigen_loader,
            data=data,
            batch_size_fn=batch_size_fn,
            n_terms=eigen_n,
            n_loader_terms=n_terms,
            out_shape=out_shape,
            likelihood=likelihood,
            loss_fn=loss_fn,
            ignore_index=ignore_index,
            dict_key_x=dict_key_x,
            dict_key_y=dict_key_y,
            device=device,
            dtype=dtype,
            shards=shards,
            progress_bar=progress_bar,
            first_batch=first_batch if subsample_size is None else None,
            replays=loader if replaying else None,
            kept_bytes=kept.nbytes if replaying else 0,
            output_hessian=output_hessian,
        )


def _batch_size_fn(first_batch: Any, dict_key_x: str, dict_key_y: str) -> Callable | None:
    """The ``batch_size_fn`` curvlinops takes for mapping inputs (``None`` for tensors),
    from a loader's first item.
    """
    first_X = split_batch(first_batch, dict_key_y)[0]
    if not isinstance(first_X, MutableMapping):
        return None

    def batch_size_fn(X: MutableMapping) -> int:
        return batch_size(X, dict_key_x)

    return batch_size_fn
