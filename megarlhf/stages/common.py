"""What the stages share: the run directory, rank-0 printing, the progress bar."""

from __future__ import annotations

import os

from megarlhf.config import Config
from megarlhf.parallel import watchdog
from megarlhf.parallel.rank import is_first, launcher_rank
from megarlhf.stages import runlock


def run_dir(cfg: Config) -> str:
    return os.path.join(cfg.run.output_dir, cfg.run.name)


def check_writable(cfg: Config) -> str:
    """The run directory exists, takes a file and is this run's alone (``runlock``) -
    before any model is built."""
    path = run_dir(cfg)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"the run directory {path} is not writable ({err.strerror}): set "
                         "run.output_dir to a writable place") from None
    watchdog.set_run_dir(path)
    if launcher_rank() == 0:  # one lock per run, taken by its first rank
        runlock.acquire(path)
    return path


def print0(*args) -> None:
    """Print on the job's first rank only (also before the process group exists)."""
    if is_first():
        print(*args, flush=True)


def progress(total: int, initial: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, disable=not (enabled and is_first()),
                dynamic_ncols=True)
