"""Elementary-op recurrent layers (laplace_glas.autodiff.rnn) against PyTorch's own, on the CPU.

Off the CPU, GLAS runs LSTM/GRU/RNN layers through ``elementary_rnn_forward`` (the
fused GPU cells have no forward-mode derivative). Here the same code is forced on the
CPU and compared with PyTorch's layers: outputs, final states, JVPs and a whole GLAS fit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import loader
from laplace import Laplace
from torch import nn
from torch.func import functional_call, jvp

import laplace_glas
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.autodiff.rnn import elementary_rnn_forward, elementary_rnns

CASES = {
    "lstm": lambda: nn.LSTM(3, 4, num_layers=2, batch_first=True),
    "lstm-bidir-proj": lambda: nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2),
    "lstm-nobias": lambda: nn.LSTM(3, 4, bias=False, batch_first=True),
    "gru-bidir": lambda: nn.GRU(3, 4, num_layers=2, batch_first=True, bidirectional=True),
    "rnn-relu": lambda: nn.RNN(3, 4, num_layers=2, nonlinearity="relu"),
    "rnn-tanh": lambda: nn.RNN(3, 4),
}


def _states_close(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("with_state", [False, True])
def test_outputs_and_states_match_pytorch(name, with_state):
    torch.manual_seed(0)
    module = CASES[name]().double().eval()
    batch_first = module.batch_first
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    hx = None
    if with_state:
        n = module.num_layers * (2 if module.bidirectional else 1)
        h_size = getattr(module, "proj_size", 0) or module.hidden_size
        h0 = torch.randn(n, 2, h_size, dtype=torch.float64)
        c0 = torch.randn(n, 2, module.hidden_size, dtype=torch.float64)
        hx = (h0, c0) if isinstance(module, nn.LSTM) else h0
    out_ref, state_ref = module(x, hx)
    out, state = elementary_rnn_forward(module, x, hx)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    _states_close(state, state_ref)


def test_unbatched_input_matches_pytorch():
    torch.manual_seed(0)
    module = nn.LSTM(3, 4, num_layers=2).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    out_ref, state_ref = module(x)
    out, state = elementary_rnn_forward(module, x)
    torch.testing.assert_close(out, out_ref)
    _states_close(state, state_ref)


class Tagger(nn.Module):
    """Embedding -> LSTM -> Linear, outputs (batch, seq, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.lstm = nn.LSTM(3, 4, num_layers=2, batch_first=True)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.lstm(self.embed(x))[0])


def test_jvp_through_elementary_lstm_matches_pytorch_cpu_path():
    torch.manual_seed(0)
    model = Tagger().double().eval()
    x = torch.randint(0, 5, (3, 7))
    params = {n: p.detach() for n, p in model.named_parameters()}
    tangents = {n: torch.randn_like(p) for n, p in params.items()}

    def f(p):
        return functional_call(model, p, (x,))

    with autodiff_friendly(model):  # on the CPU: oneDNN off, PyTorch's own LSTM
        assert "forward" not in model.lstm.__dict__
        out_ref, jvp_ref = jvp(f, (params,), (tangents,))
    with elementary_rnns(model, only_off_cpu=False):
        assert "forward" in model.lstm.__dict__
        out, jvp_out = jvp(f, (params,), (tangents,))
    assert "forward" not in model.lstm.__dict__  # restored
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(jvp_out, jvp_ref)


def test_cpu_models_keep_their_own_forward():
    model = Tagger()
    with autodiff_friendly(model):
        assert "forward" not in model.lstm.__dict__


def test_glas_fit_with_elementary_rnns_matches_default():
    torch.manual_seed(0)
    model = Tagger().double().eval()
    x = torch.randint(0, 5, (12, 6))
    y = torch.randint(0, 5, (12, 6))

    def fitted():
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure="glas",
            n_components=5,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
            la.fit(loader(x, y, 4))
        return la, la(x[:2], pred_type="glm")

    reference, probs_ref = fitted()
    with elementary_rnns(model, only_off_cpu=False):
        forced, probs = fitted()
    torch.testing.assert_close(forced.eigenvalues, reference.eigenvalues, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(probs, probs_ref, rtol=1e-9, atol=1e-12)


def test_errors():
    with pytest.raises(TypeError, match="LSTM"):
        elementary_rnn_forward(nn.Linear(2, 2), torch.zeros(1, 2))
    packed = nn.utils.rnn.pack_padded_sequence(torch.zeros(2, 3, 3), [3, 2], batch_first=True)
    with pytest.raises(NotImplementedError, match="PackedSequence"):
        elementary_rnn_forward(nn.LSTM(3, 4, batch_first=True), packed)
