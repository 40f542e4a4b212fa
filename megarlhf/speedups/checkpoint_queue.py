"""Start-up of a save: megatron's checkpoint write results kept in this process.

Replaces: the queue megatron's ``torch_dist`` writer returns its write results through,
served by a spawned ``multiprocessing.Manager`` (built for saves that finish in another
process). The server unpickles the results, so it imports torch: 2.2 s of the first save
of each process, and one more process. megarlhf's saves are synchronous (the writer runs
in this process and forks its file writers), so the results may stay in this process.

Bitwise: yes (the same results, another queue).

Measured (2026-11-25, ``bench/speedups.py --size medium --startup``): a fresh process's
launch to its first checkpoint save of a medium PPO session 8.9 s with it, 12.0 s without
(35%); the save itself 2.2 s against 4.6 s.
"""

from __future__ import annotations

import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async


def install() -> None:
    """megatron's ``torch_dist`` writer returns its write results through a queue served by
    a spawned ``multiprocessing.Manager``, built for saves that finish in another process.
    The server unpickles the results, so it imports torch: 2.2 s of the first save of each
    process, and one more process. Saves here are synchronous (the writer runs in this
    process and forks its file writers), so the results may stay in this process."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
