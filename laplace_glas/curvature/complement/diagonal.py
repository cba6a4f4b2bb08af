"""The diagonal of the summed GGN, for the curvature-aware complement
(``complement='diag'``).

.. math::

    h^{\\mathrm{diag}}_i = \\sum_{n=1}^N \\big(J_n^\\top \\Lambda_n J_n\\big)_{ii}
    = N \\, (G_1)_{ii},

with ``Lambda_n`` the unit-noise loss Hessian in the outputs (``I`` for regression,
``diag(p) - p p^T`` for the softmax cross-entropy): the same convention as the stored
eigenvalues ``h_j = N lambda_j(G_1)``, so the posterior scales both alike. Computed in
one pass over the data with BackPACK's exact GGN diagonal (``DiagGGNExact``) on a copy
of the network (BackPACK's hooks stay on the modules it extends), over the parameters
that require grad, leaving out classification targets equal to ``ignore_index``, and
summed over the ranks of a data-parallel fit.

BackPACK computes the diagonal layer by layer from the layers' inputs and output
sensitivities, without per-example gradients, but only for the modules it has an
extension for, and it counts a parameter shared by two modules (tied weights) once.
Where it refuses the model (an ``nn.LSTM``, attention, a norm, an embedding, weights
read functionally) or the model ties parameters, the same exact diagonal comes from
:func:`~laplace_glas.curvature.complement.per_example_diagonal.per_example_ggn_diagonal`: one
reverse pass per example and output column, for any model torch differentiates.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from backpack import backpack, extend, memory_cleanup
from backpack.context import CTX
from backpack.extensions import DiagGGNExact
from torch import nn

from laplace_glas.curvature.complement.kfac_layers import parameter_owners
from laplace_glas.curvature.complement.per_example_diagonal import per_example_ggn_diagonal
from laplace_glas.curvature.data.batches import scored_pair
from laplace_glas.curvature.data.losses import summed_unit_noise_loss
from laplace_glas.curvature.data.output_hessian import PosteriorAveragedHessian
from laplace_glas.curvature.parallel.distributed import Shards, all_reduce_sum, flag_failure
from laplace_glas.progress import progress

__all__ = ["ggn_diagonal", "shared_parameters"]


def ggn_diagonal(
    model: nn.Module,
    loader: Iterable,
    likelihood: str,
    *,
    ignore_index: int = -100,
    dict_key_y: str = "labels",
    device: torch.device | str = "cpu",
    shards: Shards | None = None,
    progress_bar: bool = False,
    names: list[str] | None = None,
    estimator: str = "exact",
    generator: torch.Generator | None = None,
    output_hessian: PosteriorAveragedHessian | None = None,
) -> torch.Tensor:
    """``(D,)`` diagonal of the summed unit-noise GGN over the trainable parameters (or
    over the parameters ``names``, in their order: the per-example pass).

    Parameters
    ----------
    model : torch.nn.Module
        The network at its MAP weights.
    loader : iterable of batches
        ``(X, y)`` tuples with tensor inputs.
    likelihood : {'regression', 'classification'}
        The curvature's likelihood.
    ignore_index : int
        Classification targets left out (padding).
    dict_key_y : str
        Key of the targets in mapping batches.
    device : torch.device or str
        Where the batches are moved.
    shards : Shards, optional
        The ranks of a data-parallel fit (the diagonal is summed over them).
    progress_bar : bool
        Show a ``tqdm`` bar over the batches.
    names : list of str, optional
        A subset of ``model.named_parameters()`` (``complement='kron_diag'``: those KFAC
        does not cover); BackPACK, which takes every parameter, is then not used.
    estimator : {'exact', 'mc'}, default='exact'
        ``'mc'``: the per-example pass's unbiased Monte Carlo estimate (one Rademacher
        column of ``Lambda^{1/2}`` per output position; BackPACK is then not used).
    generator : torch.Generator, optional
        The Rademacher draws of ``'mc'`` (on ``device``).
    output_hessian : PosteriorAveragedHessian, optional
        ``Lambda_n`` averaged over a posterior's predictive (the per-example pass; BackPACK
        takes only the loss's own Hessian).

    Raises
    ------
    ValueError
        For targets that do not match the outputs, outputs with more columns than the
        per-example pass holds, and models that neither BackPACK nor per-example reverse
        mode can differentiate (named with both reasons). Mapping inputs and per-token
        outputs (``(batch, seq_len, C)``, ``ignore_index`` left out) take the per-example
        pass.

    """
    total, error = None, None
    backpack_refusal = "a subset of the parameters" if names is not None else None
    if estimator == "mc":
        backpack_refusal = "diagonal_estimator='mc', which the per-example pass samples"
    if output_hessian is not None:
        backpack_refusal = "a posterior-averaged output Hessian, which BackPACK does not take"
    backpack_refusal = backpack_refusal or shared_parameters(model)
    data = _DiagonalPass(loader, likelihood, ignore_index, dict_key_y, device, shards, progress_bar)
    if backpack_refusal is None:
        with _extended_copy(model) as network:
            try:
                total, error = _summed_diagonal(network, data)
            except BackPACKRefusal as err:
                backpack_refusal = str(err)
    if backpack_refusal is not None:
        total, error = _per_example_diagonal(
            model, data, backpack_refusal, names, estimator, generator, output_hessian
        )
    if total is None:
        wanted = None if names is None else set(names)
        params = [
            p for n, p in model.named_parameters()
            if p.requires_grad and (wanted is None or n in wanted)
        ]  # fmt: skip
        total = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        if shards is None:
            raise ValueError("The loader has no scored targets: there is no GGN diagonal.")
    if shards is None:
        return total.to(device)
    # the status first, in the layout of the fit's other once-per-fit collectives: a
    # rank that failed in an earlier step of the fit meets the others here
    step = "computing the GGN diagonal of complement='diag'"
    flag_failure(shards, device, error, step, "no rank fits")
    return all_reduce_sum(total.to(device), shards)


class BackPACKRefusal(ValueError):
    """BackPACK cannot compute the diagonal of this model (the per-example pass can)."""


def shared_parameters(model: nn.Module) -> str | None:
    """Why BackPACK's diagonal would be wrong for ``model``: a trainable parameter held
    by two modules (tied weights), whose diagonal BackPACK takes from one use only
    (None where no parameter is shared).
    """
    for names in parameter_owners(model).values():
        if len(names) > 1:
            return f"{names[0]!r} and {names[1]!r} are one tied parameter"
    return None


@dataclass(frozen=True)
class _DiagonalPass:
    """The pass both routes to the diagonal (BackPACK's, the per-example one) make: the
    batches, their likelihood and targets, where they go, the ranks and the progress bar.
    """

    loader: Iterable
    likelihood: str
    ignore_index: int
    dict_key_y: str
    device: torch.device | str
    shards: Shards | None
    progress_bar: bool


def _per_example_diagonal(
    model: nn.Module,
    data: _DiagonalPass,
    backpack_refusal: str,
    names: list[str] | None,
    estimator: str = "exact",
    generator: torch.Generator | None = None,
    output_hessian: PosteriorAveragedHessian | None = None,
) -> tuple[torch.Tensor | None, Exception | None]:
    """:func:`per_example_ggn_diagonal` over this process's batches, and the error a rank
    of a data-parallel fit met (raised at once in one process).
    """
    try:
        total = per_example_ggn_diagonal(
            model, data.loader, data.likelihood, names, ignore_index=data.ignore_index,
            dict_key_y=data.dict_key_y, device=data.device, progress_bar=data.progress_bar,
            estimator=estimator, generator=generator, output_hessian=output_hessian,
        )  # fmt: skip
    except Exception as err:
        if data.shards is not None:
            return None, err
        if isinstance(err, ValueError):
            raise
        raise ValueError(
            "complement='diag' needs the GGN diagonal: BackPACK cannot compute it for this "
            f"model ({backpack_refusal}) and per-example reverse mode failed "
            f"({type(err).__name__}: {err}). Use complement='zero' or 'prior'."
        ) from err
    return total, None


def _summed_diagonal(
    network: nn.Module, data: _DiagonalPass
) -> tuple[torch.Tensor | None, Exception | None]:
    """The diagonal summed over this process's batches, and the error a rank of a
    data-parallel fit met (raised at once in one process).
    """
    params = [p for p in network.parameters() if p.requires_grad]
    loss_fn, factor = summed_unit_noise_loss(data.likelihood)
    loss_fn = extend(loss_fn)
    total = None
    keys = (data.likelihood, data.ignore_index, data.dict_key_y, data.device)
    try:  # a rank whose pass fails still takes part in the all-reduce (flagged)
        for batch in progress(data.loader, "GGN diagonal", data.progress_bar):
            X, y = _batch_for_diagonal(batch, *keys)
            if X is None:
                continue
            diagonal = _batch_diagonal(network, params, loss_fn, X, y) * factor
            total = diagonal if total is None else total + diagonal
    except BackPACKRefusal:
        raise  # the per-example pass takes over on every rank alike
    except Exception as err:
        if data.shards is None:
            raise
        return None, err
    return total, None


@contextmanager
def _extended_copy(model: nn.Module) -> Iterator[nn.Module]:
    """A copy of ``model`` extended by BackPACK, released whole on exit.

    BackPACK stores each module's input and output for the backward pass and deletes
    them when its extension has run on the module; a backward pass it refuses (a layer
    it does not cover) leaves them behind, and with them a reference cycle (module ->
    stored output -> its autograd node -> the module's backward hook) that Python's
    collector cannot see into, so every refused fit kept its copy alive. On exit the
    stored tensors are deleted and the copy's hook handles removed from BackPACK's
    global list (which otherwise grows by two handles a module a fit).
    """
    first_handle = len(CTX.hook_handles)
    network = extend(copy.deepcopy(model))
    try:
        yield network
    finally:
        for module in network.modules():
            memory_cleanup(module)
        for handle in CTX.hook_handles[first_handle:]:
            handle.remove()
        del CTX.hook_handles[first_handle:]


def _batch_for_diagonal(
    batch: object, likelihood: str, ignore_index: int, dict_key_y: str, device: torch.device | str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(X, y)`` on ``device`` with the padded classification targets left out (None, None
    when nothing is left).
    """
    X, y = scored_pair(
        batch, likelihood, ignore_index, dict_key_y,
        "BackPACK's diagonal takes tensor inputs", BackPACKRefusal,
    )  # fmt: skip
    return (None, None) if X is None else (X.to(device), y.to(device))


def _batch_diagonal(
    network: nn.Module,
    params: list[torch.Tensor],
    loss_fn: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """BackPACK's exact GGN diagonal of ``loss_fn`` on one batch, flattened over ``params``."""
    try:
        with warnings.catch_warnings():  # BackPACK's hooks on inputs without grad
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            network.zero_grad(set_to_none=True)
            loss = loss_fn(network(X), y)
            with backpack(DiagGGNExact()):
                loss.backward()
            return torch.cat([p.diag_ggn_exact.detach().reshape(-1) for p in params])
    except Exception as err:  # BackPACK's refusals come as several exception types
        raise BackPACKRefusal(f"{type(err).__name__}: {err}") from err
