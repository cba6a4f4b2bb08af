"""``import laplace_glas`` registers ('all', 'glas') with laplace-torch's ``Laplace`` factory.

laplace-torch 0.3 rebuilds ``{subclass._key: subclass}`` over *all* subclasses of
``BaseLaplace`` (a set, whose order changes from process to process) at every call, and
``_key`` is inherited: an unguarded subclass of ActiveSubspaceLaplace would compete for
('all', 'glas'), and which class won would change between processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from laplace import Laplace
from torch import nn

from laplace_glas import ActiveSubspaceLaplace

N_CALLS = 20


def factory(likelihood: str = "regression", **kwargs):
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))
    return Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=3,
        **kwargs,
    )


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_factory_returns_active_subspace_laplace(likelihood):
    la = factory(likelihood)
    assert type(la) is ActiveSubspaceLaplace
    assert la.likelihood == likelihood
    assert la.n_components == 3


def test_factory_passes_glas_options_through():
    la = factory(loss_scaling="sum", complement="prior", prior_precision=2.5, sigma_noise=0.3)
    assert la.loss_scaling == "sum"
    assert la.complement == "prior"
    torch.testing.assert_close(la.prior_precision, torch.tensor([2.5]))
    torch.testing.assert_close(la.sigma_noise, torch.tensor(0.3))


def test_factory_accepts_the_enum_spelling():
    from laplace.utils.enums import SubsetOfWeights

    la = Laplace(
        nn.Linear(2, 1),
        "regression",
        subset_of_weights=SubsetOfWeights.ALL,
        hessian_structure="glas",
        n_components=1,
    )
    assert type(la) is ActiveSubspaceLaplace


def test_own_key():
    assert ActiveSubspaceLaplace._key == ("all", "glas")


def test_subclass_without_key_does_not_take_over():
    # several competitors: without the guard, each call would pick one of 6 classes
    subclasses = [type(f"Helper{i}", (ActiveSubspaceLaplace,), {}) for i in range(5)]

    class GrandChild(subclasses[0]):
        pass

    subclasses.append(GrandChild)
    for sub in subclasses:
        assert sub._key != ("all", "glas")
        assert "_key" in sub.__dict__  # a private key of its own, not the inherited one
    assert len({sub._key for sub in subclasses}) == len(subclasses)
    for _ in range(N_CALLS):
        assert type(factory()) is ActiveSubspaceLaplace
    # the helpers still work as classes in their own right
    assert isinstance(
        GrandChild(nn.Linear(2, 1), "regression", n_components=1), ActiveSubspaceLaplace
    )


def test_subclass_with_its_own_key_is_registered_under_it():
    class Custom(ActiveSubspaceLaplace):
        _key = ("all", "glas_test_custom")

    la = Laplace(
        nn.Linear(2, 1),
        "regression",
        subset_of_weights="all",
        hessian_structure="glas_test_custom",
        n_components=1,
    )
    assert type(la) is Custom
    assert type(factory()) is ActiveSubspaceLaplace


def test_other_laplace_structures_are_unaffected():
    from laplace import FullLaplace

    la = Laplace(nn.Linear(2, 1), "regression", subset_of_weights="all", hessian_structure="full")
    assert type(la) is FullLaplace


SCRIPT = textwrap.dedent(
    """
    import torch
    from laplace import Laplace
    from torch import nn

    import laplace_glas
    from laplace_glas import ActiveSubspaceLaplace

    helpers = [type(f"Helper{i}", (ActiveSubspaceLaplace,), {}) for i in range(5)]

    class Child(ActiveSubspaceLaplace):
        pass

    class GrandChild(Child):
        pass

    assert all(h._key != ("all", "glas") for h in [*helpers, Child, GrandChild])
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    winners = set()
    for _ in range(20):
        la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                     n_components=2)
        winners.add(type(la).__name__)
    print("WINNERS", sorted(winners))
    assert winners == {"ActiveSubspaceLaplace"}, winners
    """
)


def test_registration_is_stable_across_processes():
    """Three interpreters with different hash seeds (and address layouts) agree."""
    procs = []
    for seed in ("0", "1", "12345"):
        env = {
            **os.environ,
            "PYTHONHASHSEED": seed,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for seed, proc in zip(("0", "1", "12345"), procs):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"PYTHONHASHSEED={seed}:\n{out}\n{err[-3000:]}"
        assert "WINNERS ['ActiveSubspaceLaplace']" in out
