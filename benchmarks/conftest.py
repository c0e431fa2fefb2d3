"""Benchmark session setup (benchmarks/ is not collected by the default test run).

- torch uses the machine default number of threads (os.cpu_count()), or
  KVCERT_BENCH_THREADS when set (e.g. 1, to compare without OpenMP barriers
  on a machine whose cores are busy with other work).
- glibc's allocator is told to keep freed memory (``mallopt``: M_MMAP_THRESHOLD
  at its 32 MiB maximum, M_TRIM_THRESHOLD at 1 GiB), as a caching allocator
  would: otherwise each
  fresh multi-MB tensor (an eviction's output cache, for every method alike)
  is page-faulted in again on every call, which on this VM costs about 1.5 us
  per 4 KiB page and drowns the compute being compared. Set
  KVCERT_BENCH_MALLOPT=0 to measure with the allocator defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def _keep_freed_memory() -> bool:
    if os.environ.get("KVCERT_BENCH_MALLOPT", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    return bool(ok)


MALLOPT = _keep_freed_memory()
THREADS = int(os.environ.get("KVCERT_BENCH_THREADS", "0")) or (os.cpu_count() or 1)  # default: the machine's
torch.set_num_threads(THREADS)


def pytest_report_header(config):
    return (f"kvcert benchmarks: torch {torch.__version__}, threads {torch.get_num_threads()}, "
            f"mallopt keep-freed-memory {MALLOPT}, load average {os.getloadavg()}")
