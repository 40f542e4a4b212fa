"""Why megarlhf's generation slows down after the first distributed-optimizer step on CPU.

A large ``all_gather_into_tensor`` over gloo - what megatron's distributed optimizer does
after every step, even with one data-parallel rank - leaves one more OS thread in the
process (gloo's worker thread running a parallel copy gets its own OpenMP team), and from
then on small parallel ops - a decode step's matmuls - take about 2x as long for the rest
of the process. An all-reduce or a small all-gather does not do this. The after-figure
equals what ``OMP_WAIT_POLICY=PASSIVE`` gives from the start, which fits libgomp switching
to its short "throttled" spin once it manages more threads than there are CPUs (our
reading; not confirmed in libgomp's source here).

    OMP_NUM_THREADS=2 .venv/bin/python bench/gloo_omp_throttle.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, machine  # noqa: E402


def small_matmul_us(a: torch.Tensor, b: torch.Tensor, n: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        a @ b
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", os.environ.get("OMP_NUM_THREADS", "2"))))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    a, b = torch.randn(16, 256), torch.randn(256, 1376)  # one decode-step matmul, small model
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    small_matmul_us(a, b)
    print(f"# small matmul (16x256 @ 256x1376) before/after one collective; {machine()}")
    print(f"{'collective':>36} {'before us':>10} {'after us':>9} {'OS threads':>11}")
    for name, numel, op in (
            ("all_reduce, 5M elements", 5_000_000, lambda t, o: dist.all_reduce(t)),
            ("all_gather_into_tensor, 1k elements", 1_000,
             lambda t, o: dist.all_gather_into_tensor(o, t)),
            ("all_gather_into_tensor, 5M elements", 5_000_000,
             lambda t, o: dist.all_gather_into_tensor(o, t))):
        before, n_before = small_matmul_us(a, b), threads()
        op(torch.zeros(numel), torch.zeros(numel))
        print(f"{name:>36} {before:>10.1f} {small_matmul_us(a, b):>9.1f} "
              f"{n_before:>5} -> {threads():<4}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
