"""Start-up of a save: megatron's checkpoint write results kept in this process.

Replaces: the queue megatron's ``torch_dist`` writer returns its write results through,
served by a spawned ``multiprocessing.Manager`` (built for saves that finish in another
process). The server unpickles the results, so it imports torch: 2.2 s of the first save
of each process, and one more process. megarlhf's saves are synchronous (the writer runs
in this process and forks its file writers), so the results may stay in this process.

Bitwise: yes (the same results, another queue).

Measured: the first checkpoint save of a medium PPO session 1.74 s instead of 3.76 s
(start-up plus first save 35% shorter; ``bench/speedups.py --size medium --startup``).
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
