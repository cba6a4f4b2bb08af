"""Cost at scale: GLAS (default and memory-budgeted) against a KronLaplace fit.

The workloads of issue 24, each fit in a **fresh process** (the script re-invokes itself
with ``--one``), best of ``--repeats``:

* ``lora-seqcls``: GPT-2 (``GPT2Config(vocab_size=1000, n_positions=64, n_embd=64,
  n_layer=2, n_head=4, num_labels=4)``) for sequence classification, peft LoRA r = 8,
  alpha 16 on ``c_attn``, ``c_proj``, ``c_fc``, ``modules_to_save=["score"]``
  (D = 16,640), 512 random sequences of 32 tokens, batch 32, under
  :class:`~laplace_glas.huggingface.LogitsModel`, k = 10;
* ``mlp16k``: 10-300-300-1 tanh MLP (D = 93,901), N = 16,000, batch 500,
  regression, k = 10;
* ``c1-k10``, ``c1-k50``, ``c10-k10``: the fit-cost problems (``benchmarks/fit_cost.py``,
  10-300-300-C MLP, N = 2,000);
* ``lora-tokens`` (only when named in ``--cases``): the per-token causal-LM LoRA fit of
  ``examples/lora_smiles.py`` at its default sizes (4 x 128 GPT-2, r = 4, 300 sulfonyl
  SMILES, batch 32, k = 30, mean-loss scaling), on a randomly initialised base (the
  pre-training takes ~12 min and does not change the cost of a fit); needs the SMILES
  file beside the repository (skipped otherwise).

For each: GLAS with its defaults, GLAS with ``memory_budget=64 * 2**20`` (``--budget``
MiB; 'n/a' when the constructor has no such argument) and KronLaplace. Reported: the
wall time of ``fit``;
its peak memory (CPU: ``VmHWM`` above the RSS just before ``fit``, reset through
``/proc/self/clear_refs``; ``--device cuda``: ``torch.cuda.max_memory_allocated`` above
the memory allocated before ``fit``); GLAS's operator, solver and plan
(``la.lanczos_info``); the largest relative difference between the budgeted and the
default fit's eigenvalues. ``--load N`` runs N CPU-bound processes (single-threaded
NumPy matrix products) beside the fits; several values (``--load 0 2``) measure each
level in one run and end with the change of each ratio to Kron. ``--wait-policy unset
passive`` runs the fits' processes without ``OMP_WAIT_POLICY`` (OpenMP's default) and
with ``PASSIVE`` in one run and ends with the ratios side by side (``PASSIVE`` slowed
KronLaplace's fits 1.6-2.6x on these workloads). Example::

    python benchmarks/scale.py                      # the five default workloads
    python benchmarks/scale.py --cases c1-k10 --wait-policy unset passive
    python benchmarks/scale.py --cases c1-k50 --load 0 2
    python benchmarks/scale.py --cases lora-tokens  # ~15-25 min on 2 cores
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
BUDGET = 64 * 2**20
DEFAULT_CASES = ["lora-seqcls", "mlp16k", "c1-k10", "c1-k50", "c10-k10"]
ALL_CASES = [*DEFAULT_CASES, "lora-tokens"]
METHODS = ["glas", "glas-budget", "kron"]
WAIT_POLICIES = ("inherit", "unset", "passive", "active")
BUSY = "import numpy as np\na = np.random.rand(200, 200)\nwhile True:\n    a @ a\n"


# ---------------------------------------------------------------------- workloads
def _mlp(C: int, n: int, args) -> tuple:
    """fit_cost's 10-w-w-C problem; the trained weights come from the cache when given."""
    from fit_cost import problem  # benchmarks/fit_cost.py

    width, n = (50, min(n, 500)) if args.quick else (300, n)
    trained = args.cache is not None and Path(args.cache).exists()
    model, lik, loader = problem(C, width, n, 0 if trained else args.steps)
    if trained:
        import torch

        model.load_state_dict(torch.load(args.cache, weights_only=True))
    return model, lik, loader, {}, {}


def _lora_seqcls(args) -> tuple:
    """GPT-2 sequence classifier with LoRA adapters (random weights and data)."""
    import peft
    import torch
    import transformers
    from torch.utils.data import DataLoader

    from laplace_glas.huggingface import LogitsModel

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4, num_labels=4
    )
    config.pad_token_id = 0  # batches of more than one sequence need it; no 0 in the data
    lora = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["c_attn", "c_proj", "c_fc"],
        modules_to_save=["score"],
        lora_dropout=0.0,
        fan_in_fan_out=True,  # GPT-2's Conv1D stores W^T
        task_type="SEQ_CLS",
    )
    body = peft.get_peft_model(transformers.GPT2ForSequenceClassification(config), lora)
    with torch.no_grad():  # lora_B starts at zero: move off it so that every adapter counts
        for name, p in body.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model = LogitsModel(body).eval()
    n = 64 if args.quick else 512
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (n, 32), generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    rows = [
        {
            "input_ids": ids[i],
            "attention_mask": torch.ones(32, dtype=torch.long),
            "labels": labels[i],
        }
        for i in range(n)
    ]
    loader = DataLoader(rows, batch_size=32)
    return model, "classification", loader, {}, {}


def _lora_tokens(args) -> tuple:
    """examples/lora_smiles.py's per-token LoRA fit (untrained base; see the docstring)."""
    sys.path.insert(0, str(EXAMPLES))
    import lora_smiles as ls
    import torch

    from laplace_glas.applications.smiles import SmilesTokenizer, load_smiles

    study = ls.parse_args(["--quick"] if args.quick else [])
    if not study.data.exists():
        raise FileNotFoundError(f"the SMILES file {study.data} is absent")
    transformers, peft = ls.require_llm()
    smiles = load_smiles(study.data, limit=study.n_smiles)
    tokenizer = SmilesTokenizer().fit(smiles)
    _, shifted = ls.split_by_pattern(smiles)
    order = torch.randperm(len(shifted), generator=torch.Generator().manual_seed(0)).tolist()
    train = ls.token_batches(
        tokenizer, [shifted[i] for i in order[: study.n_finetune]], study.batch_size
    )
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(ls.gpt2_config(transformers, tokenizer, study))
    trained = args.cache is not None and Path(args.cache).exists()
    study.finetune_epochs = 0 if trained else 1  # one epoch: adapters off their zero start
    model = ls.lora_finetune(peft, base, train, study, seed=0)
    if trained:
        model.load_state_dict(torch.load(args.cache, weights_only=True))
    glas = {"loss_scaling": "mean", "n_components": study.k_max}
    kron = {"dict_key_x": "labels", "_wrap": ls.TokenCounted}
    return model, "classification", train, glas, kron


def build(case: str, args) -> tuple:
    """``(model, likelihood, loader, glas_kwargs, kron_kwargs, k)`` of a workload."""
    if case == "lora-seqcls":
        out, k = _lora_seqcls(args), 10
    elif case == "mlp16k":
        out, k = _mlp(1, 16000, args), 10
    elif case in ("c1-k10", "c1-k50", "c10-k10"):
        C, k = (int(x) for x in case[1:].split("-k"))
        out = _mlp(C, 2000, args)
    elif case == "lora-tokens":
        out = _lora_tokens(args)
        k = out[3].pop("n_components")
    else:
        raise ValueError(f"unknown case {case!r}; choose from {ALL_CASES}")
    return (*out, k)


def budget_supported() -> bool:
    """Whether ``ActiveSubspaceLaplace`` takes ``memory_budget``."""
    from laplace_glas import ActiveSubspaceLaplace

    return "memory_budget" in inspect.signature(ActiveSubspaceLaplace.__init__).parameters


# ---------------------------------------------------------------------- one fit
def _peak_probe(device: str):
    """A context manager measuring the MiB a block adds at its peak (``.peak_mb``)."""
    if device == "cpu":
        from laplace_glas.applications.compare import PeakMemory

        return PeakMemory()
    import torch

    class CudaPeak:
        def __enter__(self):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
            return self

        def __exit__(self, *exc):
            torch.cuda.synchronize()
            self.peak_mb = (torch.cuda.max_memory_allocated() - self.before) / 2**20

    return CudaPeak()


def run_one(case: str, method: str, args) -> dict:
    """Build the workload, fit one posterior, return the measurements."""
    import laplace_glas  # noqa: F401 (first: registers 'glas', imports laplace-torch quietly)

    # isort: split
    import torch
    from laplace import Laplace

    model, lik, loader, glas_kw, kron_kw, k = build(case, args)
    model = model.to(args.device)
    if args.device != "cpu" and hasattr(loader, "dataset") and hasattr(loader.dataset, "tensors"):
        from torch.utils.data import DataLoader, TensorDataset

        tensors = [t.to(args.device) for t in loader.dataset.tensors]
        loader = DataLoader(TensorDataset(*tensors), batch_size=loader.batch_size)
    D = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if method == "kron":
        wrap = kron_kw.pop("_wrap", None)
        la = Laplace(model, lik, subset_of_weights="all", hessian_structure="kron", **kron_kw)
        data = wrap(loader) if wrap is not None else loader
    else:
        kw = dict(glas_kw, n_components=k)
        if args.complement is not None:
            kw["complement"] = args.complement
        if method == "glas-budget":
            if not budget_supported():
                return {"na": True, "D": D}
            kw["memory_budget"] = args.budget * 2**20
        la = Laplace(model, lik, subset_of_weights="all", hessian_structure="glas", **kw)
        data = loader
    with warnings.catch_warnings(), _peak_probe(args.device) as probe:
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        la.fit(data)
        if args.device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    out = {"time": seconds, "peak": probe.peak_mb, "D": D, "k": k}
    info = getattr(la, "lanczos_info", None)
    if info is not None:
        out.update(
            values=[float(v) for v in info.raw_values],
            operator=str(info.operator),
            solver=str(info.solver),
            products=int(info.n_products),
            plan=info.plan if isinstance(info.plan, dict) else None,
        )
    return out


def child_env(policy: str) -> dict[str, str]:
    """The environment of a fit's process under OpenMP wait ``policy``: ``'inherit'``
    (this process's), ``'unset'`` (OpenMP's default: workers spin a while, then sleep),
    ``'passive'`` or ``'active'``.
    """
    env = dict(os.environ)
    if policy == "unset":
        env.pop("OMP_WAIT_POLICY", None)
    elif policy != "inherit":
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


def spawn(case: str, method: str, args, cache: Path | None, policy: str = "inherit") -> dict:
    """One fit in a fresh interpreter; its JSON line, or ``{'error': ...}``."""
    cmd = [sys.executable, __file__, "--one", case, method, "--device", args.device]
    cmd += ["--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    cmd += ["--complement", args.complement] if args.complement is not None else []
    cmd += ["--budget", str(args.budget)]
    cmd += ["--cache", str(cache)] if cache is not None else []
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.timeout, env=child_env(policy)
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:120]}
    return json.loads(lines[-1])


def prepare(case: str, args, folder: Path) -> Path | None:
    """Train a workload's weights once (in a fresh process) and cache them for the fits."""
    if case == "lora-seqcls":
        return None  # random weights: rebuilding is as cheap as loading
    path = folder / f"{case}.pt"
    cmd = [sys.executable, __file__, "--save", case, "--cache", str(path)]
    cmd += ["--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    cmd += ["--complement", args.complement] if args.complement is not None else []
    cmd += ["--budget", str(args.budget)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(tail)
    return path


# ---------------------------------------------------------------------- report
def best(runs: list[dict]) -> dict:
    """The fastest run, with the smallest peak over the runs."""
    good = [r for r in runs if "time" in r]
    if not good:
        return runs[0]
    out = dict(min(good, key=lambda r: r["time"]))
    out["peak"] = min(r["peak"] for r in good)
    return out


def describe(r: dict) -> str:
    """Operator / solver and the plan's choice of a GLAS fit."""
    if "operator" not in r:
        return r.get("error", "n/a" if r.get("na") else "-")
    text = f"{r['solver']} / {r['operator']}"
    if "products" in r:
        text += f", {r['products']} products"
    plan = r.get("plan") or {}
    extra = {key: plan[key] for key in ("strategy", "estimate", "estimate_bytes") if key in plan}
    extra.update({key: plan[key] for key in plan if "peak" in key})
    return text + (f" ({', '.join(f'{a}={b}' for a, b in extra.items())})" if extra else "")


def eig_diff(a: dict, b: dict) -> float:
    """Largest relative difference of the eigenvalues of two fits."""
    if "values" not in a or "values" not in b:
        return math.nan
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a["values"], b["values"]))


def fmt(r: dict, key: str, spec: str) -> str:
    if key in r:
        return format(r[key], spec)
    return "n/a" if r.get("na") else "err"


def ratio(a: dict, b: dict, key: str) -> float:
    return a[key] / b[key] if key in a and key in b and b[key] > 0 else math.nan


def times(x: float, spec: str = ".2f") -> str:
    """``x`` as a ratio cell (``n/a`` when undefined)."""
    return "n/a" if math.isnan(x) else f"{x:{spec}}x"


def table(rows: list[tuple[str, dict]]) -> str:
    lines = [
        "| case | D | k | GLAS s | budgeted s | Kron s | GLAS / Kron | budgeted / Kron | "
        "peak MiB GLAS / budgeted / Kron | peak GLAS / Kron | budgeted / Kron | "
        "GLAS plan | budgeted plan | eig. rel. diff |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- "
        "| --- | ---: |",
    ]
    for case, r in rows:
        g, b, kr = r["glas"], r["glas-budget"], r["kron"]
        D = next((x["D"] for x in (g, b, kr) if "D" in x), 0)
        k = next((x["k"] for x in (g, b) if "k" in x), "")
        lines.append(
            f"| {case} | {D:,} | {k} | {fmt(g, 'time', '.2f')} | {fmt(b, 'time', '.2f')} | "
            f"{fmt(kr, 'time', '.2f')} | {times(ratio(g, kr, 'time'))} | "
            f"{times(ratio(b, kr, 'time'))} | {fmt(g, 'peak', '.0f')} / {fmt(b, 'peak', '.0f')} / "
            f"{fmt(kr, 'peak', '.0f')} | {times(ratio(g, kr, 'peak'), '.1f')} | "
            f"{times(ratio(b, kr, 'peak'), '.1f')} | {describe(g)} | {describe(b)} | "
            f"{'n/a' if math.isnan(eig_diff(b, g)) else format(eig_diff(b, g), '.1e')} |"
        )
    return "\n".join(lines)


def start_load(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-bound processes (single-threaded matrix products)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return [
        subprocess.Popen(
            [sys.executable, "-c", BUSY],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(n)
    ]


def measure(
    cases: list[str], caches: dict, load: int, args, policy: str = "inherit"
) -> list[tuple[str, dict]]:
    busy = start_load(load)
    try:
        time.sleep(0.5 if busy else 0.0)
        rows = []
        for case in cases:
            runs = {m: [] for m in METHODS}
            for _ in range(args.repeats):  # interleaved: drifts in the load hit all alike
                for m in METHODS:
                    if m == "glas-budget" and not args.budget_supported:
                        runs[m].append({"na": True})
                        continue
                    runs[m].append(spawn(case, m, args, caches.get(case), policy))
            rows.append((case, {m: best(v) for m, v in runs.items()}))
            print(f"  {case} (load {load}) done", file=sys.stderr, flush=True)
        return rows
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--cases", nargs="+", default=None, choices=ALL_CASES, metavar="CASE")
    parser.add_argument("--repeats", type=int, default=2, help="fresh-process fits per method")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    parser.add_argument("--quick", action="store_true", help="small sizes (for the tests)")
    parser.add_argument(
        "--load", type=int, nargs="+", default=[0], help="CPU-bound processes beside the fits"
    )
    parser.add_argument("--steps", type=int, default=100, help="Adam steps of the MLPs")
    parser.add_argument(
        "--budget", type=int, default=BUDGET // 2**20, help="the budgeted fits' MiB (default 64)"
    )
    parser.add_argument(
        "--complement",
        default=None,
        help="GLAS's complement (default: the library's; 'zero' times the eigen-solve alone)",
    )
    parser.add_argument(
        "--wait-policy",
        nargs="+",
        default=["inherit"],
        choices=WAIT_POLICIES,
        help="OMP_WAIT_POLICY of the fits' processes ('unset': OpenMP's default); several "
        "values are measured in one run",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per fit")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--save", metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args)), flush=True)
        return
    if args.save:
        import torch

        model = build(args.save, argparse.Namespace(**{**vars(args), "cache": None}))[0]
        torch.save(model.state_dict(), args.cache)
        return
    from machine import machine_description  # benchmarks/machine.py

    args.budget_supported = budget_supported()
    cases = args.cases or DEFAULT_CASES
    print(f"machine: {machine_description()}")
    print(
        f"each fit in a fresh process, best of {args.repeats}; device {args.device}; "
        f"{'quick sizes; ' if args.quick else ''}budget {args.budget} MiB; GLAS complement "
        f"{args.complement or 'default'}"
        f"{'' if args.budget_supported else ' (n/a: no memory_budget argument)'}\n"
    )
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        caches = {}
        for case in cases:
            try:
                caches[case] = prepare(case, args, Path(folder))
            except RuntimeError as err:
                print(f"{case}: skipped ({err})\n")
        cases = [c for c in cases if c in caches]
        for policy in args.wait_policy:
            for load in args.load:
                rows = measure(cases, caches, load, args, policy)
                results[policy, load] = dict(rows)
                print(
                    f"### {load} CPU-bound processes beside the fits, OMP_WAIT_POLICY "
                    f"{policy_name(policy)}\n\n{table(rows)}\n",
                    flush=True,
                )
    if len(args.load) > 1:
        for policy in args.wait_policy:
            load_changes(results, cases, args.load, policy)
    if len(args.wait_policy) > 1:
        policy_changes(results, cases, args.wait_policy, args.load[0])


def policy_name(policy: str) -> str:
    """How a table's heading names the fits' wait policy."""
    if policy == "inherit":
        return os.environ.get("OMP_WAIT_POLICY", "unset") + " (inherited)"
    return policy.upper() if policy != "unset" else "unset (OpenMP's default)"


def load_changes(results: dict, cases: list[str], loads: list[int], policy: str) -> None:
    """Each GLAS / Kron time ratio under load relative to its value at the first load."""
    quiet, *others = loads
    print(
        f"GLAS / Kron time ratio under load, relative to its value at load {quiet} "
        f"(OMP_WAIT_POLICY {policy_name(policy)}):\n"
    )
    print("| case | " + " | ".join(f"load {n}" for n in others) + " |")
    print("| --- |" + " ---: |" * len(others))
    for case in cases:
        quiet_row = results[policy, quiet][case]
        base = ratio(quiet_row["glas"], quiet_row["kron"], "time")
        cells = [
            ratio(results[policy, n][case]["glas"], results[policy, n][case]["kron"], "time") / base
            for n in others
        ]
        print(f"| {case} | " + " | ".join(times(c) for c in cells) + " |")
    print()


def policy_changes(results: dict, cases: list[str], policies: list[str], load: int) -> None:
    """GLAS / Kron time ratios and both sides' times under each wait policy, side by side."""
    print(f"GLAS / Kron time ratio by OMP_WAIT_POLICY (load {load}; GLAS s / Kron s):\n")
    print("| case | " + " | ".join(policy_name(p) for p in policies) + " |")
    print("| --- |" + " ---: |" * len(policies))
    for case in cases:
        cells = []
        for policy in policies:
            row = results[policy, load][case]
            glas, kron = row["glas"].get("time"), row["kron"].get("time")
            seconds = f" ({glas:.2f} / {kron:.2f})" if glas and kron else ""
            cells.append(times(ratio(row["glas"], row["kron"], "time")) + seconds)
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
