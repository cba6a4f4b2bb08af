"""How well the kept-graph memory estimate predicts a fit's resident memory.

For models the factored GGN does not cover (a GRU regressor over 20 steps in batches of
200, ``gru``, and over 32 steps in batches of 32, ``gru-32``, and the models of
``benchmarks/linearized_cost.py``), each in a fresh process:

* **per batch**: the bytes the linearised operator counts for one batch's kept graphs
  (``SavedBytes``), the resident memory (RSS) that batch's linearisation adds once the
  heap's freed pages are handed back, and their ratio (the first batch separately: it
  carries the process's one-time costs);
* **the fit** at ``memory_budget`` = ``--budget-factor`` times the unbudgeted plan's
  estimate: the strategy taken, its estimate, the measured peak and their ratio, and
  whether the fit warned that it overran the budget.

Prints a Markdown table and the machine. Example::

    python benchmarks/kept_graph_memory.py
    python benchmarks/kept_graph_memory.py --models gru --budget-factor 1.1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODELS = ["gru", "gru-32", "LSTM tagger", "transformer encoder"]


def gru_problem(n: int = 2000, batch: int = 200, hidden: int = 64, steps: int = 20):
    """A GRU (8 inputs, ``hidden`` units) over ``steps`` steps, a linear read-out of the
    last state; random data in a DataLoader."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class GRURegressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.out = nn.GRU(8, hidden, batch_first=True), nn.Linear(hidden, 1)

        def forward(self, x):
            return self.out(self.gru(x)[0][:, -1])

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(n, steps, 8, generator=g), torch.randn(n, 1, generator=g)
    return GRURegressor().eval(), "regression", DataLoader(TensorDataset(X, y), batch_size=batch)


def problem(name: str):
    """``(model, likelihood, loader)`` of a workload."""
    if name == "gru":
        return gru_problem()
    if name == "gru-32":  # storages of a few pages: the heap's page per storage counts
        return gru_problem(batch=32, steps=32)
    sys.path.insert(0, str(Path(__file__).parent))
    import linearized_cost  # benchmarks/linearized_cost.py

    model, loader = linearized_cost.problem(name, 256, 32)
    return model, "classification", loader


def per_batch(name: str) -> dict:
    """Counted and resident MiB of each batch's linearisation (first, then the median)."""
    import gc
    import statistics

    from torch import nn

    from laplace_glas.autodiff.context import autodiff_friendly
    from laplace_glas.curvature.data.losses import TokenCrossEntropy
    from laplace_glas.curvature.memory.budget import HOST_PAGE_BYTES, return_freed_memory
    from laplace_glas.curvature.memory.peak import status_bytes
    from laplace_glas.curvature.operators.graph_bytes import SavedBytes
    from laplace_glas.curvature.operators.linearized import linearize_batch

    model, likelihood, loader = problem(name)
    loss = nn.MSELoss() if likelihood == "regression" else TokenCrossEntropy()
    if name == "transformer encoder":
        loss = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    counter, kept, rows = SavedBytes.beside(model), [], []
    n = len(loader.dataset)
    with autodiff_friendly(model):
        for X, y in loader:
            gc.collect()
            return_freed_memory()
            rss, counted = status_bytes("VmRSS"), counter.bytes
            heap = counter.heap_bytes(HOST_PAGE_BYTES)
            kept.append(linearize_batch(model, loss, params, X, y, num_data=n, counter=counter))
            gc.collect()
            return_freed_memory()
            pages = counter.heap_bytes(HOST_PAGE_BYTES) - heap  # incl. dropped tensors' holes
            grown = status_bytes("VmRSS") - rss
            rows.append([(counter.bytes - counted) / 2**20, pages / 2**20, grown / 2**20])
    later = rows[1:] or rows
    return {
        "first": rows[0],
        "counted": statistics.median(r[0] for r in later),
        "pages": statistics.median(r[1] for r in later),
        "resident": statistics.median(r[2] for r in later),
    }


def fit(name: str, budget: int | None) -> dict:
    """One fit (k = 10) under ``budget`` bytes: its plan, estimate, peak and warnings."""
    import warnings

    import laplace_glas  # noqa: F401

    # isort: split
    from laplace import Laplace

    model, likelihood, loader = problem(name)
    kwargs = {} if budget is None else {"memory_budget": budget}
    la = Laplace(
        model, likelihood, subset_of_weights="all", hessian_structure="glas", n_components=10,
        complement="zero", **kwargs,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la.fit(loader)
    plan = la.lanczos_info.plan
    return {
        "strategy": plan["strategy"],
        "estimate": plan["estimated_peak_bytes"],
        "measured": plan["measured_peak_bytes"],
        "overran": any("measured peak" in str(w.message) for w in caught),
    }


def child(args: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, timeout=1800
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{args}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--models", nargs="+", default=MODELS, help=f"from {MODELS}")
    parser.add_argument("--budget-factor", type=float, default=1.05, help="budget / estimate")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, name, *rest = args.child
        budget = int(rest[0]) if rest and rest[0] != "none" else None
        print(json.dumps(per_batch(name) if kind == "batch" else fit(name, budget)))
        return
    from machine import machine_description  # benchmarks/machine.py

    print(machine_description())
    print(f"\nbudget = {args.budget_factor} x the unbudgeted plan's estimate; k = 10\n")
    print(
        "| model | batch: counted + heap pages / resident MiB (resident / counted; / both) | "
        "first batch: counted / resident | "
        "unbudgeted plan (estimate MiB) | budget MiB | plan | estimate MiB | measured MiB | "
        "measured / estimate | overrun warned |"
    )
    print("| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- |")
    for name in args.models:
        batch = child(["batch", name])
        free = child(["fit", name, "none"])
        budget = int(args.budget_factor * free["estimate"])
        held = child(["fit", name, str(budget)])
        mib = 2**20
        print(
            f"| {name} | {batch['counted']:.2f} + {batch['pages']:.2f} / {batch['resident']:.2f} "
            f"({batch['resident'] / batch['counted']:.3f}; "
            f"{batch['resident'] / (batch['counted'] + batch['pages']):.3f}) | "
            f"{batch['first'][0]:.2f} / {batch['first'][2]:.2f} | "
            f"{free['strategy']} ({free['estimate'] / mib:.1f}) | "
            f"{budget / mib:.1f} | {held['strategy']} | {held['estimate'] / mib:.1f} | "
            f"{held['measured'] / mib:.1f} | "
            f"{held['measured'] / held['estimate']:.3f} | {'yes' if held['overran'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
