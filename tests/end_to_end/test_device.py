"""Device handling: no hidden host round trips in the hot paths; CUDA when available.

A GPU is not needed for the suite. :func:`host_transfers` wraps ``Tensor.cpu`` and
``Tensor.numpy`` and records every call on a tensor of at least ``D`` elements (a
weight-space vector or bigger). On a CPU tensor ``.cpu()`` is a no-op, but the call is
still made, so a ``.cpu()`` slipped into a hot path shows up here exactly as it would
cost a device-to-host copy on a GPU. The Lanczos solver is exempt by design: ARPACK
runs on the host and takes one weight-space vector across per product (documented);
the block solver, the predictives, sampling and the evidence must not.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from conftest import fit_glas, loader
from laplace import Laplace

import laplace_glas


@contextlib.contextmanager
def host_transfers(min_numel: int) -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Record ``Tensor.cpu()`` / ``Tensor.numpy()`` calls on tensors with
    ``numel() >= min_numel`` as ``(method, shape)``.
    """
    calls: list[tuple[str, tuple[int, ...]]] = []
    originals = {name: getattr(torch.Tensor, name) for name in ("cpu", "numpy")}

    def recording(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            if self.numel() >= min_numel:
                calls.append((name, tuple(self.shape)))
            return original(self, *args, **kwargs)

        return method

    try:
        for name in originals:
            setattr(torch.Tensor, name, recording(name))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_recorder_sees_a_cpu_call():
    """The recorder itself works (else the tests below could not fail)."""
    x = torch.zeros(100)
    with host_transfers(100) as calls:
        x.cpu()
        x[:10].cpu()
        x.numpy()
    assert calls == [("cpu", (100,)), ("numpy", (100,))]


def test_block_fit_and_predictives_stay_on_device(toy_regression):
    model, X, y = toy_regression
    D = sum(p.numel() for p in model.parameters())
    with host_transfers(D) as calls:
        la = fit_glas(model, X, y, n_components=5, solver="block")
        la.optimize_prior_precision(method="marglik")
        la.log_marginal_likelihood()
        la(X[:20], pred_type="glm")
        la(
            X[:20],
            pred_type="nn",
            link_approx="mc",
            n_samples=10,
            generator=torch.Generator().manual_seed(0),
        )
        la.sample(5, generator=torch.Generator().manual_seed(0))
        la.posterior_covariance @ torch.ones(D)
    assert calls == [], f"weight-space tensors copied to the host: {calls}"


def test_predictives_after_a_lanczos_fit_stay_on_device(toy_regression):
    """ARPACK's vectors cross per product during the fit (by design); what the fit
    leaves behind is on the model's device, so prediction and sampling copy nothing.
    """
    model, X, y = toy_regression
    D = sum(p.numel() for p in model.parameters())
    la = fit_glas(model, X, y, n_components=5)
    with host_transfers(D) as calls:
        la(X[:20], pred_type="glm")
        la.sample(3, generator=torch.Generator().manual_seed(0))
    assert calls == []


def test_sequence_glm_predictive_stays_on_device():
    from laplace_glas.applications.smiles import PAD, SmilesLSTM

    torch.manual_seed(0)
    model = SmilesLSTM(7, 6, 5, 1).eval()
    x = torch.randint(3, 7, (12, 8))
    y = torch.roll(x, -1, 1)
    y[:, -2:] = PAD
    D = model.n_params
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure="glas",
            n_components=4,
            solver="block",
            ignore_index=PAD,
        )
        with host_transfers(D) as calls:
            la.fit(loader(x, y, 6))
            probs = la(x[:3], pred_type="glm", link_approx="mc", n_samples=20)
    assert probs.shape == (3, 8, 7)
    assert calls == []


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("solver", ["lanczos", "block"])
def test_cuda_fit_and_predict_match_cpu(toy_regression, solver):
    model, X, y = toy_regression
    la_cpu = fit_glas(model, X, y, n_components=5, solver=solver, seed=0)
    gpu_model = copy.deepcopy(model).to("cuda")
    la_gpu = fit_glas(gpu_model, X.cuda(), y.cuda(), n_components=5, solver=solver, seed=0)
    assert la_gpu.eigenvectors.device.type == "cuda"
    torch.testing.assert_close(
        la_gpu.eigenvalues.cpu(), la_cpu.eigenvalues, rtol=1e-3, atol=1e-4 * la_cpu.eigenvalues[0]
    )
    mean_gpu, var_gpu = la_gpu(X[:10].cuda(), pred_type="glm")
    mean_cpu, var_cpu = la_cpu(X[:10], pred_type="glm")
    assert mean_gpu.device.type == "cuda"
    torch.testing.assert_close(mean_gpu.cpu(), mean_cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(var_gpu.cpu(), var_cpu, rtol=1e-2, atol=1e-6)
    samples = la_gpu.sample(4, generator=torch.Generator("cuda").manual_seed(0))
    assert samples.device.type == "cuda"


@cuda
def test_cuda_lstm_fit_and_glm_match_cpu():
    """On a GPU the LSTM runs through laplace_glas.autodiff.rnn (fused cells have no JVP)."""
    from laplace_glas.applications.smiles import PAD, SmilesLSTM

    torch.manual_seed(0)
    model = SmilesLSTM(7, 6, 5, 2).double().eval()
    x = torch.randint(3, 7, (12, 8))
    y = torch.roll(x, -1, 1)
    kwargs = dict(
        subset_of_weights="all", hessian_structure="glas", n_components=4, ignore_index=PAD
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        la_cpu = Laplace(model, "classification", **kwargs)
        la_cpu.fit(loader(x, y, 6))
        probs_cpu = la_cpu(x[:3], pred_type="glm")
        gpu_model = copy.deepcopy(model).cuda()
        la_gpu = Laplace(gpu_model, "classification", **kwargs)
        la_gpu.fit(loader(x.cuda(), y.cuda(), 6))
        probs_gpu = la_gpu(x[:3].cuda(), pred_type="glm")
    torch.testing.assert_close(la_gpu.eigenvalues.cpu(), la_cpu.eigenvalues, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(probs_gpu.cpu(), probs_cpu, rtol=1e-6, atol=1e-9)
    assert "forward" not in gpu_model.lstm.__dict__  # the swap is undone
