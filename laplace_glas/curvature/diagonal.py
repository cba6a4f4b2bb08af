"""The diagonal of the summed GGN, for the curvature-aware complement
(``complement='diag'``).

.. math::

    h^{\\mathrm{diag}}_i = \\sum_{n=1}^N \\big(J_n^\\top \\Lambda_n J_n\\big)_{ii}
    = N \\, (G_1)_{ii},

with ``Lambda_n`` the unit-noise loss Hessian in the outputs (``I`` for regression,
``diag(p) - p p^T`` for the softmax cross-entropy): the same convention as the stored
eigenvalues ``h_j = N lambda_j(G_1)``, so the posterior scales both alike. Computed in
one pass over the data by laplace-torch's BackPACK backend (``DiagGGNExact``, on a copy
of the network), summed over the ranks of a data-parallel fit.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable

import torch
from laplace.curvature import BackPackGGN
from torch import nn
from tqdm.auto import tqdm

from laplace_glas.curvature.batches import split_batch
from laplace_glas.curvature.distributed import Shards, all_reduce_sum

__all__ = ["ggn_diagonal"]


def ggn_diagonal(
    model: nn.Module,
    loader: Iterable,
    likelihood: str,
    *,
    dict_key_y: str = "labels",
    device: torch.device | str = "cpu",
    shards: Shards | None = None,
    progress_bar: bool = False,
) -> torch.Tensor:
    """``(D,)`` diagonal of the summed unit-noise GGN over the trainable parameters.

    Parameters
    ----------
    model : torch.nn.Module
        The network at its MAP weights.
    loader : iterable of batches
        ``(X, y)`` tuples with tensor inputs.
    likelihood : {'regression', 'classification'}
        The curvature's likelihood.
    dict_key_y : str
        Key of the targets in mapping batches.
    device : torch.device or str
        Where the batches are moved.
    shards : Shards, optional
        The ranks of a data-parallel fit (the diagonal is summed over them).
    progress_bar : bool
        Show a ``tqdm`` bar over the batches.

    Raises
    ------
    ValueError
        If the model's layers or its outputs are beyond what BackPACK's exact GGN
        diagonal covers (named with BackPACK's own reason).

    """
    # BackPACK extends the modules it is given with hooks that stay (and break
    # torch.func's transforms on them): it gets a copy of the network
    backend = BackPackGGN(copy.deepcopy(model), likelihood, last_layer=False)
    total = None
    for batch in tqdm(loader, disable=not progress_bar, desc="GGN diagonal"):
        X, y = split_batch(batch, dict_key_y)
        if not isinstance(X, torch.Tensor):
            raise ValueError(
                "complement='diag' needs tensor inputs (its GGN diagonal comes from "
                f"BackPACK); got inputs of type {type(X).__name__}."
            )
        try:
            with warnings.catch_warnings():  # BackPACK's hooks on inputs without grad
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                _, diagonal = backend.diag(X.to(device), y.to(device))
        except Exception as err:  # BackPACK's refusals come as several exception types
            raise ValueError(
                "complement='diag' needs the GGN diagonal, which BackPACK cannot compute "
                f"for this model ({type(err).__name__}: {err}). Use complement='zero' or "
                "'prior'."
            ) from err
        diagonal = diagonal.detach()
        total = diagonal if total is None else total + diagonal
    if total is None:
        raise ValueError("The loader is empty: there is no GGN diagonal to compute.")
    return all_reduce_sum(total, shards)
