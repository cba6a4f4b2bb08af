"""Description of the machine a benchmark ran on (CPU, cores, RAM, versions, threads)."""

from __future__ import annotations

import os
import platform

import torch


def machine_description(threads: int | None = None) -> str:
    """One line: CPU model, cores, RAM, OS, Python/torch versions and thread settings."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as handle:
            kib = int(handle.readline().split()[1])
            mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    threads = torch.get_num_threads() if threads is None else threads
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}; torch threads "
        f"{threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
