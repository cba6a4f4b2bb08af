"""LoRA on a small GPT-2 SMILES model: GLAS over the adapters against KronLaplace and
last-layer Laplace (the Laplace-LoRA setting).

1. Pre-train a GPT-2 causal language model (a config, no download; ``--n-embd 128
   --n-layer 4``: about 0.8 M weights) on MOSES SMILES **without** a sulfonyl group.
2. The shift: fine-tune LoRA adapters (``r = --rank`` on ``c_attn``, ``c_proj``,
   ``c_fc``; base weights frozen) on a few hundred SMILES that **contain a sulfonyl
   group** ``S(=O)(=O)`` (about 9% of MOSES). Further sulfonyl SMILES form a
   calibration split and a test split.
3. Posteriors over the fine-tuned model, each on the fine-tune training split:

   * MAP: the fine-tuned model's softmax;
   * GLAS over the adapters, mean-loss scaling: k and the prior precision chosen on
     the calibration split as the smallest-set candidate with 90% token coverage
     (``la.calibrate``);
   * GLAS, standard (summed-loss) scaling, chosen the same way;
   * KronLaplace over the adapters (what Laplace-LoRA uses), prior precision by
     laplace-torch's marginal likelihood;
   * last-layer Laplace (laplace-torch, KFAC over the LM head), prior by marginal
     likelihood.

   Predictives: linearised ('glm') with the probit approximation for GLAS and the
   last layer; KronLaplace uses Monte Carlo weight samples ('nn', ``--n-samples``):
   its 'glm' predictive needs the full ``tokens x vocab x D`` Jacobian.

4. Next-token prediction on the test split, per token (padding left out): negative
   log-likelihood, expected calibration error (15 equal-width confidence bins, top-1),
   coverage of the 90% credible set (the most probable tokens up to 90% predictive
   mass), mean set size; and each posterior's fit time and peak RSS (fit plus
   prior / k selection).

The models see one row per scored token (:class:`TokenLogits`: the LM head applied
to the hidden states of the positions whose target is not padding), so laplace-torch's
KFAC and last-layer code, written for ``(batch, classes)`` outputs, apply unchanged.

Data: ``--data PATH`` (default ``../shared/data/smiles/moses_train_20k.smi`` beside the
repository), the first 20,000 SMILES of the MOSES training split (MIT licence). Needs
the ``llm`` extra (``pip install -e ".[llm]"``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from _cli import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/smiles/moses_train_20k.smi"
SHIFT_PATTERN = "S(=O)(=O)"
IGNORE = -100
METHODS = ("MAP", "GLAS mean", "GLAS standard", "KronLaplace", "last-layer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=HelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="SMILES file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny run for the test suite: 1,000 SMILES, a 2 x 32 GPT-2, k <= 3",
    )
    parser.add_argument(
        "--n-smiles", type=int, default=None, help="SMILES read (default: 20000; 1000 with --quick)"
    )
    parser.add_argument(
        "--n-finetune",
        type=int,
        default=None,
        help="shifted SMILES for LoRA training (default: 300; 24 with --quick)",
    )
    parser.add_argument(
        "--n-calib",
        type=int,
        default=None,
        help="calibration SMILES (default: 200; 24 with --quick)",
    )
    parser.add_argument(
        "--n-test", type=int, default=None, help="test SMILES (default: 400; 24 with --quick)"
    )
    parser.add_argument(
        "--n-embd", type=int, default=None, help="GPT-2 width (default: 128; 32 with --quick)"
    )
    parser.add_argument(
        "--n-layer", type=int, default=None, help="GPT-2 blocks (default: 4; 2 with --quick)"
    )
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=None,
        help="AdamW steps of pre-training, 64 SMILES each (default: 1500; 30 with --quick)",
    )
    parser.add_argument(
        "--finetune-epochs",
        type=int,
        default=None,
        help="LoRA epochs over the fine-tune split (default: 30; 5 with --quick)",
    )
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank r")
    parser.add_argument(
        "--solver",
        default="auto",
        choices=["auto", "lanczos", "block"],
        help="GLAS eigen-solver ('block': block Krylov, --block-size columns per data pass)",
    )
    parser.add_argument("--block-size", type=int, default=10, help="block size of --solver block")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per batch")
    parser.add_argument(
        "--k-max", type=int, default=None, help="eigenpairs computed (default: 30; 3 with --quick)"
    )
    parser.add_argument(
        "--n-samples", type=int, default=None, help="MC samples (default: 50; 10 with --quick)"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="seeds of the LoRA fine-tune"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write the table as Markdown to this file"
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help="pre-trained GPT-2 checkpoint: loaded when the file exists (same data and "
        "sizes), else written after pre-training; lets several runs share one pre-training",
    )
    parser.add_argument(
        "--pretrain-only", action="store_true", help="stop after pre-training (with --base)"
    )
    args = parser.parse_args(argv)
    if args.pretrain_only and args.base is None:
        parser.error("--pretrain-only needs --base PATH (where the pre-trained model goes)")
    quick = args.quick
    defaults = {
        "n_smiles": (20000, 1000),
        "n_finetune": (300, 24),
        "n_calib": (200, 24),
        "n_test": (400, 24),
        "n_embd": (128, 32),
        "n_layer": (4, 2),
        "pretrain_steps": (1500, 30),
        "finetune_epochs": (30, 5),
        "k_max": (30, 3),
        "n_samples": (50, 10),
    }
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    return args


if __name__ == "__main__":
    parse_args()  # --help and argument errors answer before torch and laplace load


# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas  # noqa: F401

# isort: split
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader

from laplace_glas.applications.cli import run_example
from laplace_glas.applications.compare import PeakMemory
from laplace_glas.applications.smiles import PAD, SmilesTokenizer, load_smiles
from laplace_glas.huggingface import causal_lm_batch


def require_llm() -> tuple:
    try:
        import peft
        import transformers
    except ImportError as err:
        raise SystemExit(
            f"This example needs the 'llm' extra ({err.name} is missing): pip install -e \".[llm]\""
        ) from None
    transformers.utils.logging.set_verbosity_error()
    return transformers, peft


# ---------------------------------------------------------------------- data
def split_by_pattern(smiles: Sequence[str]) -> tuple[list[str], list[str]]:
    """(without, with) the sulfonyl group: pre-training and fine-tune pools."""
    shifted = [s for s in smiles if SHIFT_PATTERN in s]
    return [s for s in smiles if SHIFT_PATTERN not in s], shifted


def encode(tokenizer: SmilesTokenizer, smiles: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``BOS ... EOS`` ids, right-padded with PAD, and the attention mask."""
    ids = [tokenizer.encode(s) for s in smiles]
    length = max(map(len, ids))
    x = torch.full((len(ids), length), PAD, dtype=torch.long)
    for i, row in enumerate(ids):
        x[i, : len(row)] = torch.tensor(row)
    return x, (x != PAD).long()


def token_batches(
    tokenizer: SmilesTokenizer, smiles: Sequence[str], batch_size: int, trim: bool = True
) -> DataLoader:
    """A loader of next-token dict batches (``causal_lm_batch``) whose ``labels`` are the
    scored targets only (flattened, matching :class:`TokenLogits`' rows).

    ``trim``: cut each batch to its longest sequence (not for calibration, which joins
    the batches).
    """
    ids, mask = encode(tokenizer, smiles)
    batch = causal_lm_batch(ids, mask, ignore_index=IGNORE)
    items = [{key: value[i] for key, value in batch.items()} for i in range(len(smiles))]

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        length = max(int((r["labels"] != IGNORE).sum()) for r in rows) if trim else None
        out = {key: torch.stack([r[key][:length] for r in rows]) for key in rows[0]}
        out["token_mask"] = out["labels"] != IGNORE
        out["labels"] = out["labels"][out["token_mask"]]
        return out

    return DataLoader(items, batch_size=batch_size, shuffle=False, collate_fn=collate)


class TokenCounted:
    """``loader`` as laplace-torch should see it: a data set of scored tokens.

    laplace-torch takes ``N = len(loader.dataset)`` and, through ``dict_key_x``, the
    batch size of each batch; with one output row per token both must count tokens
    (``dict_key_x='labels'``), else its KFAC factors are rescaled by tokens / sequences.
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.dataset = range(sum(int(batch["labels"].numel()) for batch in loader))

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class TokenLogits(nn.Module):
    """GPT-2 body -> hidden states of the scored positions -> LM head: ``(tokens, vocab)``.

    ``body`` is the (LoRA-wrapped) ``GPT2Model``, ``head`` the ``lm_head`` Linear, last
    so that laplace-torch's last-layer Laplace finds it.
    """

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.body(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        return self.head(hidden[batch["token_mask"]])


# ---------------------------------------------------------------------- models
def gpt2_config(transformers, tokenizer, args):
    """The GPT-2 configuration of the pre-trained base (``--n-embd``, ``--n-layer``)."""
    return transformers.GPT2Config(
        vocab_size=tokenizer.vocab_size,
        n_positions=64,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=4,
        n_inner=4 * args.n_embd,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=PAD,
    )


def pretrain(transformers, tokenizer, smiles, args, generator) -> nn.Module:
    model = transformers.GPT2LMHeadModel(gpt2_config(transformers, tokenizer, args))
    ids, mask = encode(tokenizer, smiles)
    data = causal_lm_batch(ids, mask, ignore_index=IGNORE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=args.pretrain_steps)
    model.train()
    for _ in range(args.pretrain_steps):
        idx = torch.randint(0, len(ids), (64,), generator=generator)
        batch = {k: v[idx] for k, v in data.items()}
        length = int(batch["attention_mask"].sum(1).max())
        batch = {k: v[:, :length] for k, v in batch.items()}
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()


def base_meta(tokenizer, args) -> dict:
    """What a saved base must match: vocabulary, sizes, pre-training data and steps."""
    return {
        "vocab": tokenizer.vocab_size,
        "n_embd": args.n_embd,
        "n_layer": args.n_layer,
        "n_smiles": args.n_smiles,
        "pretrain_steps": args.pretrain_steps,
        "data": args.data.name,
    }


def load_or_pretrain(transformers, tokenizer, smiles, args, generator) -> nn.Module:
    """The pre-trained base: read from ``--base`` when that file exists (its vocabulary
    and sizes must match this run's), else pre-trained (and saved there if given)."""
    if args.base is not None and args.base.exists():
        saved = torch.load(args.base, weights_only=True)
        wanted = base_meta(tokenizer, args)
        if saved["meta"] != wanted:
            raise SystemExit(
                f"{args.base} holds a base for {saved['meta']}, this run needs {wanted}."
            )
        model = transformers.GPT2LMHeadModel(gpt2_config(transformers, tokenizer, args))
        model.load_state_dict(saved["state"])
        return model.eval()
    model = pretrain(transformers, tokenizer, smiles, args, generator)
    if args.base is not None:
        args.base.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"meta": base_meta(tokenizer, args), "state": model.state_dict()}, args.base)
    return model


def lora_finetune(peft, base, loader, args, seed) -> TokenLogits:
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,  # GPT-2's Conv1D stores W^T
    )
    body = peft.get_peft_model(base.transformer, config)
    model = TokenLogits(body, base.lm_head)
    model.head.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    lossf = nn.CrossEntropyLoss()
    model.train()
    for _ in range(args.finetune_epochs):
        for batch in loader:
            loss = lossf(model(batch), batch["labels"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


# ---------------------------------------------------------------------- metrics
def metrics(probs: torch.Tensor, y: torch.Tensor, level: float = 0.9) -> dict[str, float]:
    """Token NLL, ECE (15 bins), coverage and mean size of the ``level`` credible set."""
    probs = probs.double()
    if not torch.allclose(probs.sum(-1), torch.ones_like(probs[:, 0]), atol=1e-3):
        raise ValueError("metrics needs predictive probabilities (rows summing to 1).")
    probs = probs.clamp_min(1e-12)
    probs = probs / probs.sum(-1, keepdim=True)
    nll = float(-probs.gather(1, y[:, None]).log().mean())
    conf, pred = probs.max(-1)
    correct = (pred == y).double()
    bins = torch.clamp((conf * 15).long(), max=14)
    ece = sum(
        float(
            (bins == b).double().mean() * (conf[bins == b].mean() - correct[bins == b].mean()).abs()
        )
        for b in range(15)
        if (bins == b).any()
    )
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the more probable tokens
    in_set = before < level
    rank = (order == y[:, None]).double().argmax(-1)
    covered = in_set.gather(1, rank[:, None]).squeeze(1)
    return {
        "nll": nll,
        "ece": ece,
        "coverage": float(covered.double().mean()),
        "set_size": float(in_set.double().sum(-1).mean()),
    }


def predict(predict_fn, loader) -> tuple[torch.Tensor, torch.Tensor]:
    probs, ys = [], []
    for batch in loader:
        probs.append(predict_fn(batch).detach())
        ys.append(batch["labels"])
    return torch.cat(probs), torch.cat(ys)


# ---------------------------------------------------------------------- posteriors
def fit_posterior(name, model, train, calib, args, seed, shared=None):
    """The fitted posterior of ``name`` and its predictive function, with fit time (s)
    and peak RSS (MiB) of fit plus selection. ``shared``: ``(la, fit_time)`` of GLAS
    with mean scaling, whose eigenpairs the standard scaling reuses."""
    generator = torch.Generator().manual_seed(seed)
    ks = sorted({k for k in (1, 2, 3, 5, 10, 20, 30) if k <= args.k_max} | {args.k_max})
    taus = [10.0**e for e in range(-2, 5)]
    t0 = time.perf_counter()
    with PeakMemory() as peak, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("GLAS"):
            if shared is None:
                la = Laplace(
                    model,
                    "classification",
                    subset_of_weights="all",
                    hessian_structure="glas",
                    n_components=args.k_max,
                    loss_scaling="mean",
                    complement="zero",  # the subspace alone, as in the paper
                    seed=seed,
                    solver=args.solver,
                    block_size=args.block_size if args.solver == "block" else None,
                )
                la.fit(train)
                fit_time = time.perf_counter() - t0
            else:  # the eigenpairs do not depend on the scaling: reuse them
                la, fit_time = shared[0].with_loss_scaling("sum"), shared[1]
                t0 -= fit_time
            selection = la.calibrate(
                calib, 0.9, ks=ks, prior_precisions=taus, n_samples=args.n_samples,
                generator=generator,
            )  # fmt: skip
            extra = f"k={selection.k}, tau={selection.prior_precision:.3g}"
            if shared is None:
                info = la.lanczos_info
                extra += (
                    f"; {info.n_products} GGN products, "
                    f"{1e3 * info.wall_time / max(info.n_products, 1):.0f} ms each"
                )

            def predict_fn(batch):
                return la(batch, pred_type="glm", link_approx="probit")

        elif name == "KronLaplace":
            la = Laplace(
                model, "classification", subset_of_weights="all", hessian_structure="kron",
                dict_key_x="labels",
            )  # fmt: skip
            la.fit(TokenCounted(train))
            fit_time = time.perf_counter() - t0
            la.optimize_prior_precision(method="marglik")
            extra = f"tau={float(la.prior_precision):.3g}"

            def predict_fn(batch):
                return la(
                    batch, pred_type="nn", link_approx="mc", n_samples=args.n_samples,
                    generator=generator,
                )  # fmt: skip

        else:  # last-layer
            model.head.weight.requires_grad_(True)
            model.head.bias.requires_grad_(True) if model.head.bias is not None else None
            la = Laplace(
                model,
                "classification",
                subset_of_weights="last_layer",
                hessian_structure="kron",
                last_layer_name="head",
                dict_key_x="labels",
            )
            la.fit(TokenCounted(train))
            fit_time = time.perf_counter() - t0
            la.optimize_prior_precision(method="marglik")
            extra = f"tau={float(la.prior_precision):.3g}"

            def predict_fn(batch):
                return la(batch, pred_type="glm", link_approx="probit")

    total = time.perf_counter() - t0
    return predict_fn, fit_time, total, peak.peak_mb, la, extra


def run_seed(transformers, peft, base_state, config, tokenizer, splits, args, seed):
    base = transformers.GPT2LMHeadModel(config)
    base.load_state_dict(base_state)
    bs = args.batch_size
    train, test = token_batches(tokenizer, splits[0], bs), token_batches(tokenizer, splits[2], bs)
    calib = token_batches(tokenizer, splits[1], bs, trim=False)
    t0 = time.perf_counter()
    model = lora_finetune(peft, base, train, args, seed)
    print(f"  seed {seed}: LoRA fine-tune in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    with torch.no_grad():
        probs, y = predict(lambda batch: torch.softmax(model(batch), -1), test)
    zero = {"fit": 0.0, "select": 0.0, "peak": 0.0, "D": 0, "extra": ""}
    rows.append({"method": "MAP", **metrics(probs, y), **zero})
    shared = None
    for name in METHODS[1:]:
        try:
            predict_fn, fit_time, total, peak, la, extra = fit_posterior(
                name, model, train, calib, args, seed, shared
            )
            D = la.n_params
            if name == "GLAS mean":
                shared = (la, fit_time)
            probs, y = predict(predict_fn, test)
            cost = {"fit": fit_time, "select": total - fit_time, "peak": peak}
            rows.append({"method": name, **metrics(probs, y), **cost, "D": D, "extra": extra})
        finally:
            model.head.weight.requires_grad_(False)
            if model.head.bias is not None:
                model.head.bias.requires_grad_(False)
        print(f"  seed {seed}: {name} done ({total:.1f} s)", flush=True)
    return rows


def format_table(all_rows: list[list[dict]]) -> str:
    def cell(values, spec):
        mean = statistics.fmean(values)
        if len(values) == 1:
            return format(mean, spec)
        return f"{format(mean, spec)} ± {format(statistics.stdev(values), spec)}"

    lines = [
        "| method | D | test NLL | ECE (15 bins) | 90% coverage | set size | fit s | "
        "selection s | peak RSS MiB | chosen (seed 0) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for i, method in enumerate(METHODS):
        rows = [seed_rows[i] for seed_rows in all_rows]
        lines.append(
            f"| {method} | {rows[0]['D'] or '-'} | {cell([r['nll'] for r in rows], '.4f')} | "
            f"{cell([r['ece'] for r in rows], '.4f')} | "
            f"{cell([100 * r['coverage'] for r in rows], '.1f')}% | "
            f"{cell([r['set_size'] for r in rows], '.2f')} | "
            f"{cell([r['fit'] for r in rows], '.1f')} | "
            f"{cell([r['select'] for r in rows], '.1f')} | "
            f"{cell([r['peak'] for r in rows], '.0f')} | {rows[0]['extra']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers, peft = require_llm()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    t_start = time.perf_counter()

    smiles = load_smiles(args.data, limit=args.n_smiles)
    tokenizer = SmilesTokenizer().fit(smiles)
    pool, shifted = split_by_pattern(smiles)
    need = args.n_finetune + args.n_calib + args.n_test
    if len(shifted) < need:
        raise SystemExit(
            f"Only {len(shifted)} SMILES with {SHIFT_PATTERN} among {len(smiles)}; "
            f"{need} needed: read more (--n-smiles) or ask for fewer."
        )
    order = torch.randperm(len(shifted), generator=generator).tolist()
    shifted = [shifted[i] for i in order]
    splits = (
        shifted[: args.n_finetune],
        shifted[args.n_finetune : args.n_finetune + args.n_calib],
        shifted[args.n_finetune + args.n_calib : need],
    )
    print(
        f"{len(smiles)} SMILES, vocab {tokenizer.vocab_size}; pre-training on {len(pool)} "
        f"without {SHIFT_PATTERN}; fine-tune / calibration / test: "
        f"{' / '.join(str(len(s)) for s in splits)} with it"
    )

    t0 = time.perf_counter()
    base = load_or_pretrain(transformers, tokenizer, pool, args, generator)
    n_base = sum(p.numel() for p in base.parameters())
    print(f"pre-trained GPT-2 ({n_base:,} weights) in {time.perf_counter() - t0:.0f} s")
    if args.pretrain_only:
        return
    state = {k: v.clone() for k, v in base.state_dict().items()}

    all_rows = []
    for seed in args.seeds:
        all_rows.append(
            run_seed(transformers, peft, state, base.config, tokenizer, splits, args, seed)
        )
    table = format_table(all_rows)
    header = (
        f"GPT-2 {args.n_layer} x {args.n_embd} ({n_base:,} weights), LoRA r = {args.rank}; "
        f"{len(args.seeds)} seed(s) {args.seeds} (mean ± sd over seeds); test split: "
        f"{len(splits[2])} SMILES ({sum(len(s) for s in splits[2])} characters); "
        f"total {time.perf_counter() - t_start:.0f} s"
    )
    print(header)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python examples/lora_smiles.py " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        args.out.write_text(f"# LoRA SMILES study\n\n`{command}`\n\n{header}\n\n{table}\n")
    if not all(math.isfinite(r["nll"]) for rows in all_rows for r in rows):
        raise SystemExit("A non-finite NLL: see the table.")


if __name__ == "__main__":
    run_example(main)
