"""GGN products and GLAS fits on models the factored operator does not cover.

For each model, in one run:

* one GGN product (one column, and a block of ``--block`` columns) from curvlinops'
  ``GGNLinearOperator`` and from GLAS's linearised operator (kept forward graphs),
  median of ``--repeats`` wall times, their ratio and the products' relative difference;
* the GLAS fit (k = ``--k``) with the default ``solver='auto'`` (Lanczos on the
  linearised operator, or on stored per-example Jacobians where they fit the budget:
  the transformer encoder), with ``solver='lanczos'`` (Lanczos on curvlinops' operator,
  the reference) and laplace-torch's KronLaplace fit, with peak resident memory added
  by each fit (``PeakMemory``) and the largest relative eigenvalue difference;
* the bytes the linearised operator keeps (``saved_bytes``).

Models (random weights, random token data, float32): a per-token LSTM tagger, a
transformer encoder classifier and, with the ``llm`` extra, a 4 x 128 GPT-2 with LoRA
adapters (r = 4) scored per token (one output row per token, so that laplace-torch's
KFAC applies; its ``N`` counts sequences, which rescales its factors but not its cost).
KronLaplace's error is printed where it cannot fit a model. Example::

    python benchmarks/linearized_cost.py                          # the caller's environment
    OMP_WAIT_POLICY=PASSIVE python benchmarks/linearized_cost.py  # the tuned policy, beside it
"""

from __future__ import annotations

import laplace_glas  # noqa: F401 (first: registers 'glas', imports laplace-torch quietly)

# isort: split
import argparse
import statistics
import time
import warnings

import torch
from laplace import Laplace
from machine import machine_description  # benchmarks/machine.py
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.compare import PeakMemory
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.losses import TokenCrossEntropy
from laplace_glas.curvature.operators.curvlinops import LossOnData, mean_ggn_operator
from laplace_glas.curvature.operators.linearized import build_linearized_ggn

VOCAB, LENGTH = 30, 40


class Tagger(nn.Module):
    """Embedding -> LSTM (2 x 128) -> Linear: logits per position."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, VOCAB)

    def forward(self, x):
        return self.head(self.lstm(self.embed(x))[0])


class EncoderClassifier(nn.Module):
    """Embedding -> TransformerEncoder (2 x 64, 4 heads) -> mean pool -> 5 classes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class TokenLogits(nn.Module):
    """A GPT-2 body with LoRA adapters and its frozen LM head: ``(batch * T, vocab)``."""

    def __init__(self):
        super().__init__()
        import peft
        import transformers

        transformers.utils.logging.set_verbosity_error()
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=128, n_layer=4, n_head=4
        )
        base = transformers.GPT2LMHeadModel(config)
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True
        )
        self.body = peft.get_peft_model(base.transformer, lora)
        self.head = base.lm_head.requires_grad_(False)
        for module in self.body.modules():  # peft starts B at zero: make the curvature generic
            if hasattr(module, "lora_B"):
                for b in module.lora_B.values():
                    nn.init.normal_(b.weight, std=0.02)

    def forward(self, x):
        hidden = self.body(input_ids=x).last_hidden_state
        return self.head(hidden).reshape(-1, VOCAB)  # one row per token, as KFAC needs


def problem(name: str, n: int, batch: int):
    """The model in eval mode and its loader."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    if name == "LSTM tagger":
        model, y = Tagger(), torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    elif name == "transformer encoder":
        model, y = EncoderClassifier(), torch.randint(0, 5, (n,), generator=g)
    else:
        model, y = TokenLogits(), torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    if name.startswith("GPT-2"):  # targets flattened like the logits (one row per token)

        def collate(rows):
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]).reshape(-1)

        return model.eval(), DataLoader(TensorDataset(x, y), batch_size=batch, collate_fn=collate)
    return model.eval(), DataLoader(TensorDataset(x, y), batch_size=batch)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def product_row(name, model, loader, args) -> dict:
    batches = list(loader)
    params = [p for p in model.parameters() if p.requires_grad]
    D = sum(p.numel() for p in params)
    loss = TokenCrossEntropy("sum")
    n = sum(len(x) for x, _ in batches)
    V = torch.randn(D, args.block, generator=torch.Generator().manual_seed(1))
    with autodiff_friendly(model):
        ref = mean_ggn_operator(model, loss, params, batches, num_data=n)
        t0 = time.perf_counter()
        with PeakMemory() as peak:
            loss_on_data = LossOnData(model, loss, params, batches, num_data=n)
            lin = build_linearized_ggn(loss_on_data, budget_bytes=2**33)
        build = time.perf_counter() - t0
        rows = {"model": name, "D": D, "build": build, "kept MiB": lin.saved_bytes / 2**20}
        rows["build peak MiB"] = peak.peak_mb
        for m in (1, args.block):
            t_ref, GV_ref = timed(lambda m=m: ref @ V[:, :m], args.repeats)
            t_lin, GV_lin = timed(lambda m=m: lin @ V[:, :m], args.repeats)
            err = float((GV_lin - torch.as_tensor(GV_ref)).norm() / torch.as_tensor(GV_ref).norm())
            rows[m] = (t_ref / m, t_lin / m, err)
    return rows


def fit_row(name, model, batches, args) -> dict:
    likelihood = "classification"
    out = {}
    values = {}
    glas = {"hessian_structure": "glas", "n_components": args.k, "complement": "zero"}
    for label, kwargs in (
        ("GLAS auto", glas),
        ("GLAS lanczos", {**glas, "solver": "lanczos"}),
        ("KronLaplace", {"hessian_structure": "kron"}),
    ):
        la = Laplace(model, likelihood, subset_of_weights="all", **kwargs)
        try:
            with warnings.catch_warnings(), PeakMemory() as peak:
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                la.fit(batches)
                seconds = time.perf_counter() - t0
            out[label] = (seconds, peak.peak_mb)
            if label.startswith("GLAS"):
                values[label] = la.lanczos_info.values
                out[label + " operator"] = la.lanczos_info.operator.split(" (")[0]
                out[label + " products"] = la.lanczos_info.n_products
        except Exception as err:  # KronLaplace on some models: report, do not stop
            out[label] = (float("nan"), float("nan"))
            out[label + " error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    if len(values) == 2:
        a, b = values["GLAS auto"], values["GLAS lanczos"]
        out["eig diff"] = float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--n", type=int, default=256, help="sequences per model")
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch")
    parser.add_argument("--k", type=int, default=10, help="eigenpairs of the fits")
    parser.add_argument("--block", type=int, default=10, help="columns of the block product")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each product")
    parser.add_argument("--models", nargs="+", default=None, help="subset of the models")
    args = parser.parse_args()
    names = ["LSTM tagger", "transformer encoder", "GPT-2 4 x 128 + LoRA"]
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        names = names[:2]
        print("(no 'llm' extra: the GPT-2 + LoRA model is skipped)")
    names = [m for m in names if args.models is None or m in args.models]
    print(machine_description())
    print(f"n = {args.n} sequences of {LENGTH} tokens, batches of {args.batch}, k = {args.k}\n")
    print(
        "| model | D | kept MiB | product s: curvlinops / linearised (ratio) | "
        f"{args.block}-column block, s per column (ratio) | rel. diff |"
    )
    print("| --- | ---: | ---: | --- | --- | ---: |")
    fits = []
    for name in names:
        model, batches = problem(name, args.n, args.batch)
        row = product_row(name, model, batches, args)
        one, block = row[1], row[args.block]
        print(
            f"| {name} | {row['D']:,} | {row['kept MiB']:.0f} | {one[0]:.3f} / {one[1]:.3f} "
            f"({one[0] / one[1]:.2f}x) | {block[0]:.3f} / {block[1]:.3f} "
            f"({block[0] / block[1]:.2f}x) | {max(one[2], block[2]):.1e} |",
            flush=True,
        )
        fits.append((name, fit_row(name, model, batches, args)))
    print(
        "\n| model | GLAS auto s (operator, products) | GLAS lanczos s (products) | "
        "KronLaplace s | auto / Kron | lanczos / auto | peak MiB auto / lanczos / Kron | "
        "eig. rel. diff |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | --- | ---: |")
    for name, f in fits:
        auto, ref, kron = f["GLAS auto"], f["GLAS lanczos"], f["KronLaplace"]
        kron_cell = f"{kron[0]:.1f}" if "KronLaplace error" not in f else f["KronLaplace error"]
        print(
            f"| {name} | {auto[0]:.1f} ({f.get('GLAS auto operator')}, "
            f"{f.get('GLAS auto products')}) | {ref[0]:.1f} ({f.get('GLAS lanczos products')}) | "
            f"{kron_cell} | {auto[0] / kron[0]:.2f} | {ref[0] / auto[0]:.2f} | "
            f"{auto[1]:.0f} / {ref[1]:.0f} / {kron[1]:.0f} | "
            f"{f.get('eig diff', float('nan')):.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
