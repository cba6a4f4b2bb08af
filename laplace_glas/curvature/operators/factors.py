"""The per-layer Jacobian factors of the factored GGN and the hooks that record them.

For a weight layer the per-example Jacobian rows of ``Lambda_n^{1/2} J_n`` are sums of
outer products ``sum_t g_{nrt} a_{nt}^T`` of the layer's inputs ``a`` and output-side
gradients ``g`` (:class:`OuterFactor`); an ``nn.Embedding`` has a one-hot input side
(:class:`EmbeddingFactor`); elementwise-affine parameters are stored explicitly
(:class:`ExplicitFactor`). Each factor applies its block of ``S`` and ``S^T``;
:class:`~laplace_glas.curvature.operators.factored.FactoredGGN` sums them. The helpers
here run one batch's forward pass with hooks and its batched backward pass over the
``R`` rows of ``Lambda^{1/2}``; :mod:`~laplace_glas.curvature.operators.factor_join`
joins the batches' factors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from laplace_glas.autodiff.checkpoints import watch_reentrant_checkpoints
from laplace_glas.curvature.data.batches import batch_size
from laplace_glas.validation import check_model_output

if TYPE_CHECKING:
    from laplace_glas.curvature.data.output_hessian import PosteriorAveragedHessian

__all__ = [
    "CONV_LAYERS",
    "EXPLICIT_ROWS_SHARE",
    "FACTORED_LAYERS",
    "EmbeddingFactor",
    "ExplicitFactor",
    "ForwardRecorder",
    "NotFactorable",
    "OuterFactor",
    "batch_factors",
    "explicit_rows_are_smaller",
    "explicit_rows_numel",
    "factor_jacobian",
    "loss_hessian_rows",
    "owning_modules",
    "parameter_offsets",
    "row_vectors",
    "stored_bytes",
]

_MAX_ROWS = 1024  # R = output rows per example above which the factors are not built
_CACHE_ELEMENTS = 2**19  # numbers of a product's per-chunk temporaries kept in cache
CONV_LAYERS = (nn.Conv1d, nn.Conv2d)
_NORM = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)
FACTORED_LAYERS = (nn.Linear, *CONV_LAYERS, *_NORM, nn.Embedding)


# ---------------------------------------------------------------------- factors
@dataclass
class OuterFactor:
    """A weight whose per-example Jacobian rows are ``sum_t g_{nrt} a_{nt}^T``.

    ``a``: ``(N, T, d_in)`` layer inputs (unfolded patches for a convolution);
    ``g``: ``(N, R, T, d_out)`` output-side factors, ``Lambda^{1/2}`` and ``1/sqrt(N)``
    included; the weight occupies ``D``-positions ``offset : offset + d_out * d_in``
    as a row-major ``(d_out, d_in)`` matrix. A bias (at ``bias_offset``, ``d_out``
    positions) is the weight of a constant input 1: its rows are ``sum_t g_{nrt}``.
    ``positions``: the positions ``T_c`` of one call of the layer where every call, in
    every batch, had the same (KFAC's 'expand' input covariance divides by it), else
    None (``T`` joins the calls, and batches of other lengths are zero-padded to it).

    Where a layer has many positions and few weights (an early convolution), its
    explicit Jacobian rows ``J_{nr} = sum_t g_{nrt} a_{nt}^T`` (and ``sum_t g_{nrt}``
    for the bias) are much smaller than ``a`` and ``g``
    (:func:`explicit_rows_are_smaller`). The products then use them, one GEMM each way,
    instead of reading ``g``. They are formed on the first product and kept; ``a`` and
    ``g`` stay for KFAC's factors and the dual solve's Gram matrix.
    """

    offset: int
    a: torch.Tensor
    g: torch.Tensor
    bias_offset: int | None = None
    positions: int | None = None
    _rows: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        """``(d_out, d_in)``."""
        return self.g.shape[-1], self.a.shape[-1]

    @property
    def numel(self) -> int:
        """Number of weights."""
        return self.shape[0] * self.shape[1]

    @property
    def _input_side(self) -> bool:
        """One row per example (``R = T = 1``), fewer inputs than outputs: contract ``g``
        with the weights first (temporaries of ``N d_in``, not ``N d_out``, numbers).
        """
        return self.g.shape[1] == 1 and self.a.shape[1] == 1 and self.shape[1] < self.shape[0]

    def _weights_and_bias(self, X: torch.Tensor) -> torch.Tensor:
        """``(d_out, m (d_in + 1))``: the columns' ``W_j`` side by side, then their biases
        (zero without a bias).
        """
        d_out, d_in = self.shape
        m = X.shape[0]
        W = X[:, self.offset : self.offset + self.numel].reshape(m, d_out, d_in)
        off = self.bias_offset
        b = X.new_zeros(m, d_out) if off is None else X[:, off : off + d_out]
        return torch.cat([W.permute(1, 0, 2).reshape(d_out, m * d_in), b.T], 1)

    def explicit_rows(self) -> torch.Tensor | None:
        """``(N R, d_out d_in [+ d_out])``: the layer's explicit Jacobian rows, weights
        row-major then the bias, where :func:`explicit_rows_are_smaller` says they pay
        (formed once, one batched GEMM over the examples per row ``r``, so that no copy
        of ``g`` is made); else None.
        """
        if self._rows is not None or not self.rows_bytes():
            return self._rows
        N, d_in = self.a.shape[0], self.a.shape[-1]
        R, d_out = self.g.shape[1], self.g.shape[-1]
        weights = d_out * d_in
        J = self.a.new_empty(N, R, weights + (d_out if self.bias_offset is not None else 0))
        for r in range(R):  # sum_t g_nrt a_nt^T
            J[:, r, :weights] = torch.bmm(self.g[:, r].transpose(1, 2), self.a).view(N, -1)
        if self.bias_offset is not None:
            torch.sum(self.g, 2, out=J[:, :, weights:])
        self._rows = J.view(N * R, -1)
        return self._rows

    def rows_bytes(self) -> int:
        """Bytes of :meth:`explicit_rows` where the products use them (formed or not
        yet), else 0.
        """
        N, T, d_in = self.a.shape
        R, d_out = self.g.shape[1], self.g.shape[-1]
        numel = explicit_rows_numel(N, T, d_in, d_out, R, self.bias_offset is not None)
        return numel * self.a.element_size()

    def _apply_rows(self, X: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
        d_out = self.shape[0]
        W = X[:, self.offset : self.offset + self.numel]
        if self.bias_offset is not None:
            W = torch.cat([W, X[:, self.bias_offset : self.bias_offset + d_out]], 1)
        return (W @ J.T).view(X.shape[0], self.a.shape[0], self.g.shape[1])

    def _apply_transpose_rows(self, Y: torch.Tensor, out: torch.Tensor, J: torch.Tensor) -> None:
        numel = self.numel
        grad = Y.reshape(Y.shape[0], -1) @ J  # (m, numel [+ d_out])
        out[:, self.offset : self.offset + numel] += grad[:, :numel]
        if self.bias_offset is not None:
            out[:, self.bias_offset : self.bias_offset + self.shape[0]] += grad[:, numel:]

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        """``(m, N, R)`` rows of ``S x`` for ``X`` of shape ``(m, D)``."""
        J = self.explicit_rows()
        if J is not None:
            return self._apply_rows(X, J)
        d_out, d_in = self.shape
        N, T = self.a.shape[:2]
        m = X.shape[0]
        if self._input_side:  # (g_n^T W_j) a_n + g_n^T b_j
            H = self.g.reshape(N, d_out) @ self._weights_and_bias(X)  # (N, m (d_in + 1))
            Ha = torch.bmm(H[:, : m * d_in].view(N, m, d_in), self.a.view(N, d_in, 1))
            return (Ha.view(N, m) + H[:, m * d_in :]).T.unsqueeze(2)
        W = X[:, self.offset : self.offset + self.numel].reshape(m * d_out, d_in).T
        off = self.bias_offset
        b = None if off is None else X[:, off : off + d_out]
        g = self.g.reshape(N, -1, T * d_out)
        out = X.new_empty(N, g.shape[1], m)
        # examples in chunks whose P (below) stays in cache: one GEMM over all N rows
        # wrote P to memory and read it back (41 ms against 21 ms at N = 16,000, 300 x 300)
        rows = max(1, _CACHE_ELEMENTS // (T * m * d_out))
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            # one GEMM: P[n, t, j, o] = a_nt . W_j[o, :]
            P = self.a[n0:n1].reshape(-1, d_in) @ W
            if b is not None:
                P = P.view(-1, m, d_out).add_(b).view(-1, m * d_out)
            if T == 1:  # (n, m, d_out) is a view
                P = P.view(n1 - n0, m, d_out)
            else:
                P = P.view(n1 - n0, T, m, d_out).transpose(1, 2).reshape(n1 - n0, m, T * d_out)
            # (n, R, m); the transposed operand needs no copy
            torch.bmm(g[n0:n1], P.transpose(1, 2), out=out[n0:n1])
        return out.permute(2, 0, 1)

    def apply_transpose(self, Y: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``S^T y`` to ``out (m, D)`` for ``Y`` of shape ``(m, N, R)``."""
        J = self.explicit_rows()
        if J is not None:
            self._apply_transpose_rows(Y, out, J)
            return
        d_out, d_in = self.shape
        N, T = self.a.shape[:2]
        m, R = Y.shape[0], Y.shape[2]
        if self._input_side:  # W_j += g^T diag(y_j) a, b_j += g^T y_j: one GEMM
            y = Y.reshape(m, N).T.contiguous()  # (N, m)
            Ay = torch.cat([(y.unsqueeze(2) * self.a.view(N, 1, d_in)).view(N, -1), y], 1)
            M = Ay.T @ self.g.reshape(N, d_out)  # (m (d_in + 1), d_out)
            W = out[:, self.offset : self.offset + self.numel].view(m, d_out, d_in)
            W += M[: m * d_in].view(m, d_in, d_out).transpose(1, 2)
            if self.bias_offset is not None:
                out[:, self.bias_offset : self.bias_offset + d_out] += M[m * d_in :]
            return
        g = self.g.reshape(N, R, T * d_out)
        if R == 1:  # an outer product per example: broadcast, not N tiny GEMMs
            Q = Y.permute(1, 0, 2).contiguous() * g  # (N, m, T*o)
        else:
            Q = torch.bmm(Y.permute(1, 0, 2), g)
        if T == 1:
            Q = Q.view(N, m * d_out)
        else:
            Q = Q.view(N, m, T, d_out).transpose(1, 2).reshape(N * T, m * d_out)
        grad = Q.T @ self.a.reshape(N * T, d_in)  # (m * d_out, d_in): row-major W_j
        out[:, self.offset : self.offset + self.numel] += grad.view(m, -1)
        if self.bias_offset is not None:
            out[:, self.bias_offset : self.bias_offset + d_out] += Q.sum(0).view(m, d_out)

    def cost(self) -> int:
        """Flops of one column of ``S`` and of ``S^T`` together."""
        rows = self.rows_bytes() // self.a.element_size()
        if rows:  # the products multiply by the explicit rows
            return 4 * rows
        N, T = self.a.shape[:2]
        return 4 * N * T * self.numel + 4 * N * T * self.g.shape[1] * self.shape[0]


EXPLICIT_ROWS_SHARE = 0.25
"""The largest share of a layer's factors ``a`` and ``g`` (numbers per example) that its
explicit Jacobian rows may take for the products to use them (the rows are kept
beside the factors, so the share bounds the memory they add). On the digits CNN of the
predictive benchmark, whose first convolution has 64 positions and 80 weights a row, the
rows take 14% of its factors, and a product of the whole network fell from 11.9 ms to
5.3 ms."""


def explicit_rows_numel(N: int, T: int, d_in: int, d_out: int, R: int, bias: bool) -> int:
    """Numbers of a layer's explicit Jacobian rows, ``N R (d_out d_in [+ d_out])``, where
    :func:`explicit_rows_are_smaller` says its products use them, else 0.
    """
    if not explicit_rows_are_smaller(T, d_in, d_out, R, bias):
        return 0
    return N * _rows_per_example(d_in, d_out, R, bias)


def stored_bytes(factor: Any) -> int:
    """Bytes a factor holds once its products have run: its tensors, with an
    :class:`OuterFactor`'s explicit rows counted whether formed yet or not.
    """
    tensors = {k: v for k, v in vars(factor).items() if isinstance(v, torch.Tensor)}
    tensors.pop("_rows", None)
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    return held + (factor.rows_bytes() if isinstance(factor, OuterFactor) else 0)


def explicit_rows_are_smaller(T: int, d_in: int, d_out: int, R: int, bias: bool) -> bool:
    """Whether a layer's explicit Jacobian rows, ``R (d_out d_in + d_out)`` numbers per
    example, take at most :data:`EXPLICIT_ROWS_SHARE` of its factors' ``T (d_in + R
    d_out)``: true for layers with many positions and few weights, never for ``T = 1``.
    """
    rows = _rows_per_example(d_in, d_out, R, bias)
    return T > 1 and rows <= EXPLICIT_ROWS_SHARE * T * (d_in + R * d_out)


def _rows_per_example(d_in: int, d_out: int, R: int, bias: bool) -> int:
    """``R (d_out d_in [+ d_out])``: one example's explicit Jacobian rows of a layer."""
    return R * (d_out * d_in + (d_out if bias else 0))


@dataclass
class EmbeddingFactor:
    """An embedding table: rows ``sum_t onehot(idx_{nt}) g_{nrt}^T``.

    ``idx``: ``(N, T)`` token indices; ``g``: ``(N, R, T, dim)`` (zero at
    ``padding_idx``); the table occupies ``offset : offset + num * dim``.
    """

    offset: int
    num: int
    idx: torch.Tensor
    g: torch.Tensor

    @property
    def numel(self) -> int:
        """Number of weights."""
        return self.num * self.g.shape[-1]

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        """``(m, N, R)`` rows of ``S x``."""
        E = X[:, self.offset : self.offset + self.numel].reshape(X.shape[0], self.num, -1)
        return torch.einsum("nrtd,mntd->mnr", self.g, E[:, self.idx])

    def apply_transpose(self, Y: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``S^T y`` to ``out``."""
        m = Y.shape[0]
        Q = torch.einsum("mnr,nrtd->mntd", Y, self.g)
        table = out[:, self.offset : self.offset + self.numel].view(m, self.num, -1)
        table.index_add_(1, self.idx.reshape(-1), Q.reshape(m, -1, Q.shape[-1]))

    def cost(self) -> int:
        """Flops of one column of ``S`` and of ``S^T`` together."""
        return 4 * self.g.numel()


@dataclass
class ExplicitFactor:
    """Parameters with explicit per-example Jacobian rows ``J (N, R, d)`` (normalisation
    affines, a bias whose weight is frozen); column ``j`` belongs to ``D``-position ``index[j]``.
    """

    index: torch.Tensor
    J: torch.Tensor

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        """``(m, N, R)`` rows of ``S x``."""
        N, R, d = self.J.shape
        return (X[:, self.index] @ self.J.reshape(N * R, d).T).reshape(-1, N, R)

    def apply_transpose(self, Y: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``S^T y`` to ``out``."""
        N, R, d = self.J.shape
        out.index_add_(1, self.index, Y.reshape(-1, N * R) @ self.J.reshape(N * R, d))

    def cost(self) -> int:
        """Flops of one column of ``S`` and of ``S^T`` together."""
        return 4 * self.J.numel()


def owning_modules(model: nn.Module) -> dict[int, tuple[str, nn.Module, str]]:
    """``id(parameter) -> (qualified name, owning module, attribute)``."""
    owners = {}
    for mod_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (f"{mod_name}.{attr}".lstrip("."), module, attr))
    return owners


# ---------------------------------------------------------------------- build
def row_vectors(
    out: torch.Tensor, y: torch.Tensor, likelihood: str, ignore_index: int, scale: float
) -> torch.Tensor:
    """``(R, B, *out.shape[1:])``: the rows of ``Lambda_n^{1/2} / sqrt(N)`` per example.

    Regression (unit noise): the identity's ``R = out[0].numel()`` rows. Softmax
    cross-entropy: ``C - 1`` rows per position. ``Lambda = diag(p) - p p^T =
    D_s (I - s s^T) D_s`` with ``s = sqrt(p)`` (a unit vector), and ``I - s s^T = Q Q^T``
    with ``Q`` the ``C - 1`` columns of the Householder reflector
    ``H = I - 2 u u^T / u^T u``, ``u = s + e_C`` (``s_C >= 0``), other than its last
    (``H e_C = -s``); so ``Lambda = (Q^T D_s)^T (Q^T D_s)``, one row fewer than
    ``diag(sqrt p)(I - 1 p^T)`` (exactly: no eigen-decomposition). Every quantity built
    from the rows (``S^T S``, its diagonal, KFAC's output-side factor ``sum_r g_r g_r^T``,
    the non-zero spectrum of ``S S^T``) is the same for any such square root.
    """
    B = out.shape[0]
    if likelihood == "regression":
        R = out[0].numel()
        eye = torch.eye(R, dtype=out.dtype, device=out.device) * scale
        return eye.reshape(R, 1, *out.shape[1:]).expand(R, B, *out.shape[1:])
    C = out.shape[-1]
    P = out[0].numel() // C
    if C < 2:  # one class: Lambda = 0, a zero row per position
        return out.new_zeros(P, B, *out.shape[1:])
    s = torch.softmax(out.detach().reshape(B, P, C), dim=-1).sqrt()
    u = s.clone()
    u[..., -1] += 1.0  # s_C >= 0: no cancellation in u^T u >= 1
    H = -2.0 * u[..., :, None] * u[..., None, :] / (u * u).sum(-1)[..., None, None]
    H.diagonal(dim1=-2, dim2=-1).add_(1.0)
    mask = (y.reshape(B, P) != ignore_index).to(out.dtype) * scale
    half = H[..., :, : C - 1].transpose(-1, -2) * (s * mask[..., None])[..., None, :]
    if P == 1:
        V = half[:, 0].permute(1, 0, 2)  # (C - 1, B, C)
    else:  # (B, P, C-1, C) -> block-diagonal rows over the positions
        eye = torch.eye(P, dtype=out.dtype, device=out.device)
        V = torch.einsum("tu,btcd->tcbud", eye, half)
    return V.reshape(P * (C - 1), B, *out.shape[1:])


def loss_hessian_rows(
    X: Any,
    out: torch.Tensor,
    y: torch.Tensor,
    likelihood: str,
    ignore_index: int,
    scale: float,
    output_hessian: PosteriorAveragedHessian | None = None,
) -> torch.Tensor:
    """The rows of ``Lambda_n^{1/2}`` times ``scale`` of a batch with outputs ``out``:
    :func:`row_vectors` at the outputs, or ``output_hessian.rows`` (a
    :class:`~laplace_glas.curvature.data.output_hessian.PosteriorAveragedHessian`).
    """
    if output_hessian is None:
        return row_vectors(out, y, likelihood, ignore_index, scale)
    return output_hessian.rows(X, out, y, ignore_index, scale)


def _same_padding(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """Pad ``x`` for ``padding='same'``/``'valid'``; return it with the unfold padding."""
    if not isinstance(module.padding, str):
        return x, module.padding
    if module.padding == "valid":
        return x, (0,) * len(module.kernel_size)
    pads = []
    for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):
        total = d * (k - 1)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads), (0,) * len(module.kernel_size)


def _weight_and_bias(w_off, b_off, a, g, explicit):
    """A weight's outer factor, its bias folded in (a column of ones on the input side);
    a bias without its weight gets an explicit Jacobian.
    """
    if w_off is not None:
        return ("outer", w_off, a, g, b_off), explicit
    if b_off is not None:
        explicit.append((b_off, g.sum(2)))
    return None, explicit


def _layer_factors(module, x, z, grad, offsets, R, B):
    """Factors of one call of ``module``: ``(outer/embedding or None, [(offset, J)])``."""
    grad = grad.detach()
    explicit = []
    w_off, b_off = offsets.get("weight"), offsets.get("bias")
    if isinstance(module, nn.Linear):
        d_in, d_out = module.in_features, module.out_features
        a = x.detach().reshape(B, -1, d_in)
        g = grad.reshape(R, B, -1, d_out).transpose(0, 1)
        return _weight_and_bias(w_off, b_off, a, g, explicit)
    if isinstance(module, CONV_LAYERS):
        if x.dim() != len(module.kernel_size) + 2:
            raise NotFactorable("an unbatched convolution input")
        x, padding = _same_padding(module, x.detach())
        if isinstance(module, nn.Conv1d):
            x = x.unsqueeze(2)
            kwargs = dict(
                kernel_size=(1, *module.kernel_size),
                dilation=(1, *module.dilation),
                padding=(0, *padding),
                stride=(1, *module.stride),
            )
        else:
            kwargs = dict(
                kernel_size=module.kernel_size,
                dilation=module.dilation,
                padding=padding,
                stride=module.stride,
            )
        a = F.unfold(x, **kwargs).transpose(1, 2)  # (B, L, C_in * prod(kernel))
        g = grad.reshape(R, B, module.out_channels, -1).permute(1, 0, 3, 2)  # (B, R, L, C_out)
        return _weight_and_bias(w_off, b_off, a, g, explicit)
    if isinstance(module, nn.Embedding):
        idx = x.reshape(B, -1)
        g = grad.reshape(R, B, -1, module.embedding_dim).transpose(0, 1)
        if module.padding_idx is not None:
            g = g * (idx != module.padding_idx)[:, None, :, None].to(g.dtype)
        return ("embedding", w_off, module.num_embeddings, idx, g), explicit
    # normalisation layers: explicit Jacobians of the elementwise affine
    x = x.detach()
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        d = int(np.prod(shape))
        xhat = F.layer_norm(x, shape, None, None, module.eps).reshape(B, -1, d)
        g = grad.reshape(R, B, -1, d).transpose(0, 1)  # (B, R, T, d)
    else:  # BatchNorm in eval mode: per-channel affine of the normalised input
        ch = module.num_features
        view = (1, ch) + (1,) * (x.dim() - 2)
        xhat = (x - module.running_mean.view(view)) / torch.sqrt(
            module.running_var.view(view) + module.eps
        )
        xhat = xhat.reshape(B, ch, -1).transpose(1, 2)  # (B, S, ch)
        g = grad.reshape(R, B, ch, -1).permute(1, 0, 3, 2)  # (B, R, S, ch)
    if w_off is not None:
        explicit.append((w_off, torch.einsum("brtd,btd->brd", g, xhat.to(g.dtype))))
    if b_off is not None:
        explicit.append((b_off, g.sum(2)))
    return None, explicit


class NotFactorable(Exception):
    """The model cannot be factored; the message says why."""


class ForwardRecorder:
    """Forward hooks keeping each hooked module's input and output, per call."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.calls: dict[nn.Module, list] = {}
        self.handles = []
        self.recording = True
        for module in modules:
            self.calls[module] = []
            self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module, args, output):
        if not self.recording:
            return None
        self.calls[module].append((args[0], output))
        return output.clone()  # in-place ops downstream must not touch ``output``

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forward passes inside record nothing (e.g. a posterior's predictive on the
        same model while a batch's factors are being built).
        """
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def reset(self) -> None:
        """Forget the recorded calls (the hooks stay)."""
        for calls in self.calls.values():
            calls.clear()

    def remove(self) -> None:
        """Remove the forward hooks."""
        for handle in self.handles:
            handle.remove()


def _without_graph(recorder, offsets) -> list[torch.Tensor]:
    """The fitted parameters of layers the forward pass did not call with a graph to
    their output (a reentrant checkpoint's segment; or not called at all).
    """
    missing = []
    for module, attrs in offsets.items():
        calls = recorder.calls.get(module, [])
        if not calls or not all(z.requires_grad for _, z in calls):
            missing += [getattr(module, attr) for attr in attrs]
    return missing


def batch_factors(
    model, recorder, X, y, likelihood, ignore_index, scale, offsets, dict_key_x, output_hessian=None
):
    """Forward pass, batched backward over the rows of ``Lambda^{1/2}``
    (:func:`row_vectors` at the outputs, or ``output_hessian.rows``, e.g. a
    :class:`~laplace_glas.curvature.data.output_hessian.PosteriorAveragedHessian`),
    per-layer factors of one batch.
    """
    B = batch_size(X, dict_key_x)
    recorder.reset()
    with torch.enable_grad():
        with watch_reentrant_checkpoints() as watch:
            out = check_model_output(model(X))
        watch.check(model, _without_graph(recorder, offsets))
        if any(not z.requires_grad for calls in recorder.calls.values() for _, z in calls):
            raise NotFactorable("a layer called without gradients (under torch.no_grad)")
        if out.shape[0] != B:
            raise NotFactorable(
                f"model outputs whose first axis ({out.shape[0]}) is not the batch ({B})"
            )
        if out[0].numel() > _MAX_ROWS:
            raise NotFactorable(
                f"{out[0].numel()} output rows per example (more than {_MAX_ROWS}) for "
                "the factored operator"
            )
        with recorder.paused():  # an averaged Hessian runs its posteriors' predictives
            rows = loss_hessian_rows(X, out, y, likelihood, ignore_index, scale, output_hessian)
        R = rows.shape[0]
        calls = [(m, x, z) for m, cs in recorder.calls.items() for x, z in cs]
        for _, x, _ in calls:
            if x.shape[0] != B:
                raise NotFactorable("a layer input whose first axis is not the batch")
        zs = [z for _, _, z in calls]
        try:
            grads = torch.autograd.grad(out, zs, rows, is_grads_batched=True, allow_unused=True)
        except RuntimeError:  # an op without a batching rule: one backward per row
            per_row = [
                torch.autograd.grad(out, zs, rows[r], retain_graph=True, allow_unused=True)
                for r in range(R)
            ]
            grads = [
                None if per_row[0][i] is None else torch.stack([pr[i] for pr in per_row])
                for i in range(len(zs))
            ]
    layers: dict[nn.Module, list] = {}
    explicit: list = []
    for (module, x, z), grad in zip(calls, grads):
        if grad is None:
            grad = torch.zeros(R, *z.shape, dtype=z.dtype, device=z.device)
        big, small = _layer_factors(module, x, z, grad, offsets[module], R, B)
        if big is not None:
            layers.setdefault(module, []).append(big)
        explicit.extend(small)
    return out.detach(), rows, layers, explicit, R


def parameter_offsets(
    model: nn.Module, params: list[torch.Tensor]
) -> tuple[dict[nn.Module, dict[str, int]], list[str], int]:
    """Where each layer's weight and bias start in the ``D``-vector, the parameters'
    qualified names, and ``D``.
    """
    owners = owning_modules(model)
    offsets: dict[nn.Module, dict[str, int]] = {}
    start = 0
    for p in params:
        _, module, attr = owners[id(p)]
        offsets.setdefault(module, {})[attr] = start
        start += p.numel()
    return offsets, [owners[id(p)][0] for p in params], start


def factor_jacobian(
    factors: list, B: int, R: int, D: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``(B, R, D)``: the rows of ``S`` of one batch, formed from its per-layer factors
    (:func:`batch_factors` assembled): ``g_t a_t^T`` summed over the positions ``t``
    of a weight layer's calls, ``sum_t g_t`` for its bias, the gradients scattered into
    an embedding's rows, the explicit columns as they are. With the regression rows
    (``Lambda = I``, scale 1) ``S`` is the Jacobian of the outputs.
    """
    J = torch.zeros(B, R, D, dtype=dtype, device=device)
    for f in factors:
        if isinstance(f, OuterFactor):
            d_out, d_in = f.shape
            block = J[:, :, f.offset : f.offset + f.numel].view(B, R, d_out, d_in)
            T = f.a.shape[1]
            g = f.g.transpose(2, 3).reshape(B, R * d_out, T)
            block.copy_(torch.bmm(g, f.a).view(B, R, d_out, d_in))
            if f.bias_offset is not None:
                J[:, :, f.bias_offset : f.bias_offset + d_out] += f.g.sum(2)
        elif isinstance(f, EmbeddingFactor):
            dim = f.g.shape[-1]
            table = J[:, :, f.offset : f.offset + f.numel].view(B, R, f.num, dim)
            index = f.idx[:, None, :, None].expand(B, R, f.idx.shape[1], dim)
            table.scatter_add_(2, index, f.g)
        else:
            J[:, :, f.index] += f.J
    return J
