"""Forks a child as megatron's checkpoint writers are forked (multiprocessing, fork), prints
its pid and waits to be killed. argv: on|off (signals.die_with_parent first or not)."""

import multiprocessing as mp
import sys
import time

from megarlhf.parallel.signals import die_with_parent


def child():
    time.sleep(300)


if __name__ == "__main__":
    if sys.argv[1] == "on":
        die_with_parent()
    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    print(proc.pid, flush=True)
    time.sleep(300)
