"""The mean-loss GGN in factored form: per-example Jacobians as per-layer outer products.

For an ``nn.Linear`` layer ``z = W a + b`` (applied over any leading positions ``t``)
the Jacobian of the network output row ``r`` of example ``n`` with respect to ``W`` is a
sum of outer products,

.. math::

    \\frac{\\partial f_{nr}}{\\partial W} = \\sum_t g_{nrt}\\, a_{nt}^\\top ,
    \\qquad g_{nrt} = \\frac{\\partial f_{nr}}{\\partial z_{nt}} .

One forward pass with hooks keeps the layer inputs ``a``; one batched backward pass
(``torch.autograd.grad(..., is_grads_batched=True)``) over the ``R`` rows of
``Lambda_n^{1/2}`` gives the output-side factors ``g``. With them,

.. math::

    S = \\frac{1}{\\sqrt N} \\begin{bmatrix} \\vdots \\\\ \\Lambda_n^{1/2} J_n \\\\
    \\vdots \\end{bmatrix} \\in \\mathbb{R}^{NR \\times D},
    \\qquad G_1 = S^\\top S = \\frac1N \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

and a product ``G_1 V = S^T (S V)`` costs one pair of GEMMs per layer (about
``4 N T D`` flops per column) and no further pass through the network. ``Lambda_n^{1/2}``
is the identity for regression (unit noise) and ``diag(sqrt(p)) (I - 1 p^T)`` for
softmax cross-entropy (``S^T S = diag(p) - p p^T``), one block per position of a
sequence output, zero for ``ignore_index`` targets.

Supported parameters: the weight and bias of ``nn.Linear`` (any leading dimensions),
``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``, zero padding; patches via ``unfold``; the
bias is the weight of a constant input 1, so it adds no factor of its own), the
elementwise affine parameters of ``nn.LayerNorm`` and of ``nn.BatchNorm1d/2d`` in eval
mode with running statistics (their Jacobians are stored explicitly, ``N R d`` numbers),
and ``nn.Embedding`` (one-hot input side: gather / ``index_add``). A model with any
other trainable parameter, a custom ``loss_fn``, or factors above the memory budget is
not factored: :func:`build_factored_ggn` returns the reason instead, and the caller
falls back to curvlinops. A forward-mode check on the first batch (``S v`` against
``Lambda^{1/2} J v`` from ``torch.func.jvp``) catches what the layer list cannot see
(a weight also used outside its module, a batch axis that is not the first).

Memory: the factors hold ``N * sum_l T_l (d_in,l + R d_out,l)`` numbers for the weight
layers plus ``N R d`` for the explicit parameters, i.e. the activations times ``R``; they
are built only while they stay below ``budget_bytes`` (default
:func:`default_factor_budget`: ``max(2 GiB, 4 k D itemsize)``). A product with ``m``
columns needs ``m N T d_out`` more per layer, in column chunks of at most
``_CHUNK_ELEMENTS`` numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jvp
from torch.nn import functional as F
from tqdm.auto import tqdm

from laplace_glas.curvature.batches import batch_size, split_batch
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES, TorchOperator
from laplace_glas.validation import check_model_output

__all__ = [
    "EmbeddingFactor",
    "ExplicitFactor",
    "FactoredGGN",
    "OuterFactor",
    "build_factored_ggn",
    "default_factor_budget",
    "factored_jacobian_directions",
    "unsupported_reason",
]

_CHUNK_ELEMENTS = 2**25  # temporaries of one product chunk: 128 MiB in float32
_MAX_ROWS = 1024  # R = output rows per example above which the factors are not built
_PREDICTIVE_BUDGET = 2**29  # factors of one prediction batch: 512 MiB
_CONV = (nn.Conv1d, nn.Conv2d)
_NORM = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)
_SUPPORTED = (nn.Linear, *_CONV, *_NORM, nn.Embedding)


def default_factor_budget(k: int, n_params: int, itemsize: int) -> int:
    """Bytes the factors may take: ``max(2 GiB, 4 k D itemsize)``."""
    return max(2 * 2**30, 4 * k * n_params * itemsize)


# ---------------------------------------------------------------------- factors
@dataclass
class OuterFactor:
    """A weight whose per-example Jacobian rows are ``sum_t g_{nrt} a_{nt}^T``.

    ``a``: ``(N, T, d_in)`` layer inputs (unfolded patches for a convolution);
    ``g``: ``(N, R, T, d_out)`` output-side factors, ``Lambda^{1/2}`` and ``1/sqrt(N)``
    included; the weight occupies ``D``-positions ``offset : offset + d_out * d_in``
    as a row-major ``(d_out, d_in)`` matrix. A bias (at ``bias_offset``, ``d_out``
    positions) is the weight of a constant input 1: its rows are ``sum_t g_{nrt}``.
    """

    offset: int
    a: torch.Tensor
    g: torch.Tensor
    bias_offset: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(d_out, d_in)``."""
        return self.g.shape[-1], self.a.shape[-1]

    @property
    def numel(self) -> int:
        """Number of weights."""
        return self.shape[0] * self.shape[1]

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        """``(m, N, R)`` rows of ``S x`` for ``X`` of shape ``(m, D)``."""
        d_out, d_in = self.shape
        N, T = self.a.shape[:2]
        m = X.shape[0]
        W = X[:, self.offset : self.offset + self.numel].reshape(m, d_out, d_in)
        # one GEMM: P[n, t, j, o] = a_nt . W_j[o, :]
        P = self.a.reshape(N * T, d_in) @ W.reshape(m * d_out, d_in).T
        if self.bias_offset is not None:
            b = X[:, self.bias_offset : self.bias_offset + d_out]
            P = P.view(N * T, m, d_out).add_(b).view(N * T, m * d_out)
        P = P.view(N, T, m, d_out).permute(0, 1, 3, 2).reshape(N, T * d_out, m)
        return torch.bmm(self.g.reshape(N, -1, T * d_out), P).permute(2, 0, 1)

    def apply_transpose(self, Y: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``S^T y`` to ``out (m, D)`` for ``Y`` of shape ``(m, N, R)``."""
        d_out, d_in = self.shape
        N, T = self.a.shape[:2]
        m = Y.shape[0]
        Q = torch.bmm(Y.permute(1, 0, 2), self.g.reshape(N, -1, T * d_out))  # (N, m, T*o)
        Q = Q.view(N, m, T, d_out).transpose(1, 2).reshape(N * T, m * d_out)
        grad = Q.T @ self.a.reshape(N * T, d_in)  # (m * d_out, d_in): row-major W_j
        out[:, self.offset : self.offset + self.numel] += grad.view(m, -1)
        if self.bias_offset is not None:
            out[:, self.bias_offset : self.bias_offset + d_out] += Q.sum(0).view(m, d_out)

    def cost(self) -> int:
        """Flops of one column of ``S`` and of ``S^T`` together."""
        N, T = self.a.shape[:2]
        return 4 * N * T * self.numel + 4 * N * T * self.g.shape[1] * self.shape[0]


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


# ---------------------------------------------------------------------- operator
class FactoredGGN(TorchOperator):
    """``G_1 = S^T S`` from per-layer factors, as a SciPy operator (and in torch).

    Parameters
    ----------
    factors : sequence
        :class:`OuterFactor`, :class:`EmbeddingFactor` and :class:`ExplicitFactor`
        blocks covering all ``D`` parameters once.
    n_params : int
        ``D``.
    n_rows : int
        ``R``, rows of ``Lambda^{1/2} J_n`` per example.

    Notes
    -----
    ``matmat_torch(V)`` returns ``G_1 V`` for ``V (D, m)`` in the factors' dtype and
    device; the SciPy interface converts to and from NumPy. ``apply_S`` and
    ``apply_transpose`` expose ``S X^T`` and ``S^T Y`` for the dual (Gram) solve.

    """

    def __init__(self, factors: Sequence, n_params: int, n_rows: int):
        ref = next(f.g if hasattr(f, "g") else f.J for f in factors)
        super().__init__(dtype=NUMPY_DTYPES[ref.dtype], shape=(n_params, n_params))
        self.factors = list(factors)
        self.n_rows = int(n_rows)
        self.n_examples = int(ref.shape[0])
        self.torch_dtype = ref.dtype
        self.device = ref.device
        self.n_products = 0

    # -- torch
    @property
    def column_cost(self) -> int:
        """Flops of one product column ``G_1 v``."""
        return sum(f.cost() for f in self.factors)

    def _chunk(self, m: int) -> int:
        widest = max(
            (
                f.a.shape[0] * f.a.shape[1] * f.shape[0]
                for f in self.factors
                if isinstance(f, OuterFactor)
            ),
            default=1,
        )
        return max(1, min(m, _CHUNK_ELEMENTS // max(widest, 1)))

    def apply_S(self, X: torch.Tensor) -> torch.Tensor:
        """``(m, N, R)``: row ``i`` is ``S x_i`` for ``X (m, D)``."""
        chunk = self._chunk(X.shape[0])
        parts = []
        for start in range(0, X.shape[0], chunk):
            Xc = X[start : start + chunk]
            parts.append(sum(f.apply(Xc) for f in self.factors))
        return torch.cat(parts)

    def apply_transpose(self, Y: torch.Tensor) -> torch.Tensor:
        """``(m, D)``: row ``i`` is ``S^T y_i`` for ``Y (m, N, R)``."""
        out = torch.zeros(Y.shape[0], self.shape[0], dtype=Y.dtype, device=Y.device)
        chunk = self._chunk(Y.shape[0])
        for start in range(0, Y.shape[0], chunk):
            for f in self.factors:
                f.apply_transpose(Y[start : start + chunk], out[start : start + chunk])
        return out

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``G_1 V`` for ``V (D, m)``."""
        X = V.to(device=self.device, dtype=self.torch_dtype).T.contiguous()
        self.n_products += X.shape[0]
        return self.apply_transpose(self.apply_S(X)).T


# ---------------------------------------------------------------------- support
def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module, str]]:
    """``id(parameter) -> (qualified name, owning module, attribute)``."""
    owners = {}
    for mod_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (f"{mod_name}.{attr}".lstrip("."), module, attr))
    return owners


def _module_issue(module: nn.Module) -> str | None:
    if not isinstance(module, _SUPPORTED):
        return f"{type(module).__name__} parameters"
    if isinstance(module, _CONV):
        if module.groups != 1:
            return f"{type(module).__name__} with groups={module.groups}"
        if module.padding_mode != "zeros":
            return f"{type(module).__name__} with padding_mode={module.padding_mode!r}"
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        if module.training or not module.track_running_stats or module.running_mean is None:
            return "BatchNorm outside eval mode with running statistics"
    if isinstance(module, nn.Embedding) and (
        module.max_norm is not None or module.scale_grad_by_freq
    ):
        return "nn.Embedding with max_norm or scale_grad_by_freq"
    return None


def unsupported_reason(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    likelihood: str,
    loss_fn: nn.Module | None = None,
) -> str | None:
    """Why the factored operator cannot serve this model (``None`` if it can).

    Checks the loss and that every parameter in ``params`` is the weight or bias of a
    supported layer; what the layer list cannot see is checked numerically while the
    factors are built.
    """
    if loss_fn is not None:
        return "a custom loss_fn"
    if likelihood not in ("regression", "classification"):
        return f"likelihood {likelihood!r}"
    owners = _owners(model)
    for p in params:
        if id(p) not in owners:
            return "a parameter that is not one of the model's"
        name, module, attr = owners[id(p)]
        issue = _module_issue(module)
        if issue is not None:
            return f"{issue} ({name})"
        if attr not in ("weight", "bias"):
            return f"parameter {name}"
    return None


# ---------------------------------------------------------------------- build
def _row_vectors(
    out: torch.Tensor, y: torch.Tensor, likelihood: str, ignore_index: int, scale: float
):
    """``(R, B, *out.shape[1:])``: row ``r`` of ``Lambda_n^{1/2} / sqrt(N)`` per example."""
    B = out.shape[0]
    if likelihood == "regression":
        R = out[0].numel()
        eye = torch.eye(R, dtype=out.dtype, device=out.device) * scale
        return eye.reshape(R, 1, *out.shape[1:]).expand(R, B, *out.shape[1:])
    C = out.shape[-1]
    P = out[0].numel() // C
    p = torch.softmax(out.detach().reshape(B, P, C), dim=-1)
    mask = (y.reshape(B, P) != ignore_index).to(out.dtype) * scale
    eye = torch.eye(C, dtype=out.dtype, device=out.device)
    # rows of diag(sqrt p)(I - 1 p^T): sqrt(p_c) (e_c - p)
    half = (p.sqrt() * mask[..., None])[..., :, None] * (eye - p[..., None, :])  # (B,P,C,C)
    if P == 1:
        V = half[:, 0].permute(1, 0, 2)  # (C, B, C)
    else:
        V = torch.einsum("tu,btcd->tcbud", torch.eye(P, dtype=out.dtype, device=out.device), half)
    return V.reshape(P * C, B, *out.shape[1:])


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
    if isinstance(module, _CONV):
        if x.dim() != len(module.kernel_size) + 2:
            raise _Unsupported("an unbatched convolution input")
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


class _Unsupported(Exception):
    """The model cannot be factored; the message says why."""


class _Recorder:
    """Forward hooks keeping each hooked module's input and output, per call."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.calls: dict[nn.Module, list] = {}
        self.handles = []
        for module in modules:
            self.calls[module] = []
            self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module, args, output):
        self.calls[module].append((args[0], output))
        return output.clone()  # in-place ops downstream must not touch ``output``

    def reset(self) -> None:
        for calls in self.calls.values():
            calls.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _batch_factors(model, recorder, X, y, likelihood, ignore_index, scale, offsets, dict_key_x):
    """Forward pass, batched backward over the rows, per-layer factors of one batch."""
    B = batch_size(X, dict_key_x)
    recorder.reset()
    with torch.enable_grad():
        out = check_model_output(model(X))
        if out.shape[0] != B:
            raise _Unsupported(
                f"model outputs whose first axis ({out.shape[0]}) is not the batch ({B})"
            )
        if out[0].numel() > _MAX_ROWS:
            raise _Unsupported(
                f"{out[0].numel()} output rows per example (more than {_MAX_ROWS}) for "
                "the factored operator"
            )
        rows = _row_vectors(out, y, likelihood, ignore_index, scale)
        R = rows.shape[0]
        calls = [(m, x, z) for m, cs in recorder.calls.items() for x, z in cs]
        for _, x, _ in calls:
            if x.shape[0] != B:
                raise _Unsupported("a layer input whose first axis is not the batch")
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


def _merge_calls(calls: list) -> tuple:
    """Several calls of one module: concatenate the positions (axis ``T``)."""
    if len(calls) == 1:
        return calls[0]
    kind, off = calls[0][:2]
    if kind == "outer":
        a = torch.cat([c[2] for c in calls], 1)
        return kind, off, a, torch.cat([c[3] for c in calls], 2), calls[0][4]
    return (
        kind,
        off,
        calls[0][2],
        torch.cat([c[3] for c in calls], 1),
        torch.cat([c[4] for c in calls], 2),
    )


def _assemble(layers: dict, explicit: list) -> list:
    """Factor objects of one batch (or of the concatenated batches)."""
    factors = []
    for calls in layers.values():
        merged = _merge_calls(calls)
        if merged[0] == "outer":
            factors.append(
                OuterFactor(merged[1], merged[2].contiguous(), merged[3].contiguous(), merged[4])
            )
        else:
            factors.append(EmbeddingFactor(merged[1], merged[2], merged[3], merged[4].contiguous()))
    if explicit:
        summed: dict[int, torch.Tensor] = {}
        for off, J in explicit:  # repeated calls of one module add up
            summed[off] = summed[off] + J if off in summed else J
        offs = sorted(summed)
        J = torch.cat([summed[o] for o in offs], dim=-1)
        index = torch.cat([torch.arange(o, o + summed[o].shape[-1]) for o in offs]).to(J.device)
        factors.append(ExplicitFactor(index, J.contiguous()))
    return factors


def _nbytes(layers: dict, explicit: list) -> int:
    total = sum(J.numel() * J.element_size() for _, J in explicit)
    for calls in layers.values():
        for c in calls:
            total += sum(t.numel() * t.element_size() for t in c if isinstance(t, torch.Tensor))
    return total


def _check_first_batch(model, params, names, X, out, rows, factors, n_params, dtype) -> None:
    """``S v`` from the factors against ``Lambda^{1/2} J v`` by forward mode."""
    gen = torch.Generator().manual_seed(1234)
    v = torch.randn(n_params, generator=gen, dtype=torch.float64).to(dtype=dtype, device=out.device)
    owners = _owners(model)
    tangents, start = [], 0
    for p in params:
        t = v[start : start + p.numel()].view_as(p).clone()
        module = owners[id(p)][1]
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            t[module.padding_idx] = 0  # backward mode leaves the padding row out; so do we
        tangents.append(t)
        start += p.numel()
    v = torch.cat([t.reshape(-1) for t in tangents])
    base = {n: p.detach() for n, p in model.named_parameters()}

    def f(*ps):
        return functional_call(model, {**base, **dict(zip(names, ps))}, (X,))

    with torch.no_grad():
        _, Jv = jvp(f, tuple(p.detach() for p in params), tuple(tangents))
    reference = torch.einsum("rb...,b...->br", rows, Jv)
    op = FactoredGGN(factors, n_params, rows.shape[0])
    ours = op.apply_S(v.unsqueeze(0))[0]
    err = torch.linalg.vector_norm(ours - reference) / torch.linalg.vector_norm(
        reference
    ).clamp_min(torch.finfo(dtype).tiny)
    if not err <= 10 * torch.finfo(dtype).eps ** 0.5:
        raise _Unsupported(
            f"the factored Jacobian of the first batch differs from forward mode (rel. {err:.1e}):"
            " a weight used outside its layer, or a batch axis that is not the first"
        )


def _parameter_offsets(
    model: nn.Module, params: list[torch.Tensor]
) -> tuple[dict[nn.Module, dict[str, int]], list[str], int]:
    """Where each layer's weight and bias start in the ``D``-vector, the parameters'
    qualified names, and ``D``.
    """
    owners = _owners(model)
    offsets: dict[nn.Module, dict[str, int]] = {}
    start = 0
    for p in params:
        _, module, attr = owners[id(p)]
        offsets.setdefault(module, {})[attr] = start
        start += p.numel()
    return offsets, [owners[id(p)][0] for p in params], start


def build_factored_ggn(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    loader: Iterable,
    likelihood: str,
    n_terms: int,
    *,
    ignore_index: int = -100,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    device: torch.device | str = "cpu",
    budget_bytes: int | None = None,
    loss_fn: nn.Module | None = None,
    progress_bar: bool = False,
) -> FactoredGGN | str:
    """One pass over ``loader``: the factored unit-noise mean-loss GGN, or why not.

    Parameters
    ----------
    model, params : nn.Module, sequence of tensors
        The network (in eval mode) and the trainable parameters, in the order of the
        ``D``-vector (laplace-torch's ``la.params``).
    loader : iterable
        ``(X, y)`` batches or mappings (the target under ``dict_key_y``).
    likelihood : {'regression', 'classification'}
        Unit-noise Gaussian (``Lambda = I``) or softmax cross-entropy.
    n_terms : int
        ``N``, the number of likelihood terms (points, or tokens that are not
        ``ignore_index``) the GGN averages over.
    ignore_index : int
        Classification targets left out (their rows of ``Lambda^{1/2}`` are zero).
    dict_key_x, dict_key_y : str
        Keys of the input (for the batch size) and target of mapping batches.
    device : torch.device or str
        Where the batches go (the model's device).
    budget_bytes : int, optional
        Largest size of the factors (default ``2 GiB``); above it, the reason is
        returned and the caller falls back to curvlinops.
    loss_fn : nn.Module, optional
        A custom loss is not factored (the reason is returned).
    progress_bar : bool
        Show a ``tqdm`` bar over the batches.

    Returns
    -------
    FactoredGGN or str
        The operator of ``G_1 = (1/N) sum_n J_n^T Lambda_n J_n``, or a sentence saying
        why the model does not qualify.

    """
    reason = unsupported_reason(model, params, likelihood, loss_fn)
    if reason is not None:
        return reason
    params = list(params)
    offsets, names, n_params = _parameter_offsets(model, params)
    budget = default_factor_budget(1, n_params, 4) if budget_bytes is None else budget_bytes
    scale = float(n_terms) ** -0.5
    recorder = _Recorder(offsets)
    all_layers: dict[nn.Module, list] = {}
    all_explicit: list = []
    used, R = 0, None
    try:
        batches = tqdm(loader, desc="[GLAS] factored GGN", disable=not progress_bar)
        for i, data in enumerate(batches):
            X, y = split_batch(data, dict_key_y)
            X = X.to(device) if isinstance(X, torch.Tensor) else X
            y = y.to(device)
            out, rows, layers, explicit, R = _batch_factors(
                model, recorder, X, y, likelihood, ignore_index, scale, offsets, dict_key_x
            )
            if i == 0:
                recorder.remove()
                try:
                    _check_first_batch(
                        model,
                        params,
                        names,
                        X,
                        out,
                        rows,
                        _assemble(layers, explicit),
                        n_params,
                        out.dtype,
                    )
                finally:
                    recorder = _Recorder(offsets)
            used += _nbytes(layers, explicit)
            if used > budget:
                return (
                    f"factors above the memory budget ({budget / 2**20:.0f} MiB) for the "
                    "factored operator"
                )
            for module, calls in layers.items():
                all_layers.setdefault(module, []).append(calls)
            all_explicit.append(explicit)
    except _Unsupported as err:
        return str(err)
    finally:
        recorder.remove()
    if R is None:
        return "an empty loader"
    return FactoredGGN(_concatenate(all_layers, all_explicit), n_params, R)


def _pad_positions(tensors: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
    """Zero-pad the position axis to the longest batch (sequences of varying length)."""
    T = max(t.shape[axis] for t in tensors)
    out = []
    for t in tensors:
        if t.shape[axis] < T:
            shape = list(t.shape)
            shape[axis] = T - t.shape[axis]
            t = torch.cat([t, t.new_zeros(shape)], axis)
        out.append(t)
    return out


def _concatenate(all_layers: dict, all_explicit: list) -> list:
    """Join the batches' factors along the example axis."""
    layers = {}
    for module, per_batch in all_layers.items():
        merged = [_merge_calls(calls) for calls in per_batch]
        kind, off = merged[0][:2]
        if kind == "outer":
            a = torch.cat(_pad_positions([m[2] for m in merged], 1))
            g = torch.cat(_pad_positions([m[3] for m in merged], 2))
            layers[module] = [(kind, off, a, g, merged[0][4])]
        else:
            idx = torch.cat(_pad_positions([m[3] for m in merged], 1))
            g = torch.cat(_pad_positions([m[4] for m in merged], 2))
            layers[module] = [(kind, off, merged[0][2], idx, g)]
    factors = _assemble(layers, [])
    if all_explicit and all_explicit[0]:
        per_batch = [_assemble({}, e)[0] for e in all_explicit]
        factors.append(ExplicitFactor(per_batch[0].index, torch.cat([f.J for f in per_batch])))
    return factors


def factored_jacobian_directions(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    x: torch.Tensor | dict,
    directions: torch.Tensor,
    *,
    dict_key_x: str = "input_ids",
    budget_bytes: int = _PREDICTIVE_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``f(x)`` and ``J(x) V`` from the factors of one batch, or why not.

    The 'glm' predictive's ``J(x) U`` at the model's current weights: one forward pass
    with hooks and one batched backward pass over the ``R`` output rows give the
    per-example Jacobian in factored form (:class:`FactoredGGN` with ``Lambda = I``,
    ``N = 1``, so ``S = J``); then ``J(x) V = S V`` is one pair of GEMMs per layer
    instead of ``k`` forward-mode JVPs, each a pass through the network. The same
    forward-mode check as for the fit guards the factorisation. Factors above
    ``budget_bytes`` (default 512 MiB; ``B R`` times the activations) are not built.

    Parameters
    ----------
    model, params : nn.Module, sequence of tensors
        The network in eval mode at the weights to linearise at, and the parameters
        in the order of ``V``'s rows.
    x : torch.Tensor or mapping
        One input batch (on the model's device).
    directions : torch.Tensor
        ``(D, k)`` directions ``V``.
    dict_key_x : str
        Key of the input in mapping batches (for the batch size).
    budget_bytes : int
        Largest size of the factors.

    Returns
    -------
    (f, JV) or str
        ``f`` of shape ``(batch, *out)`` and ``JV`` of shape ``(batch, *out, k)``, or a
        sentence saying why the model does not qualify (the caller then uses JVPs).

    """
    reason = unsupported_reason(model, params, "regression")
    if reason is not None:
        return reason
    params = list(params)
    offsets, names, start = _parameter_offsets(model, params)
    recorder = _Recorder(offsets)
    try:
        B = batch_size(x, dict_key_x)
        y = torch.zeros(B, device=directions.device)  # unused by the regression rows
        out, rows, layers, explicit, R = _batch_factors(
            model, recorder, x, y, "regression", -100, 1.0, offsets, dict_key_x
        )
        recorder.remove()
        if _nbytes(layers, explicit) > budget_bytes:
            return f"factors above the predictive's budget ({budget_bytes / 2**20:.0f} MiB)"
        factors = _assemble(layers, explicit)
        _check_first_batch(model, params, names, x, out, rows, factors, start, out.dtype)
    except _Unsupported as err:
        return str(err)
    finally:
        recorder.remove()
    S = FactoredGGN(factors, start, R)
    JV = S.apply_S(directions.T.to(dtype=out.dtype).contiguous())  # (k, B, R)
    return out, JV.permute(1, 2, 0).reshape(*out.shape, directions.shape[1])
