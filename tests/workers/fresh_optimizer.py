"""Rewrite a supervised run's checkpoint with a fresh optimizer: ``fresh_optimizer.py SRC
DEST_DIR TAG [key=value ...]`` (one process; the overrides are those of the run).

The weights, the data position, the step counter, the RNG and the (constant) learning
rate are the checkpoint's; only Adam's moments and step count start again, as they would
if a resume lost them. tests/test_engine.py shows such a resume is caught by its
tolerance.
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import sys

from megarlhf.config import load_config
from megarlhf.engine.checkpoint import load_checkpoint, read_meta, save_checkpoint
from megarlhf.roles.build import build_from_config
from megarlhf.parallel.launch import init_distributed, shutdown


def main() -> None:
    src, dest, tag, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    cfg = load_config("configs/sft_tiny.yaml", [*overrides, f"checkpoint.load={src}"])
    init_distributed(cfg)
    meta = read_meta(src)
    (name,) = meta["roles"]
    role = build_from_config(cfg, kind="lm", trained=True, name=name)
    state = role.state()
    loaded = load_checkpoint(src, {name: state}, load_optimizer=False,
                             layout=meta["layout"])
    assert loaded["rng_restored"], "the copy keeps the run's RNG"
    state.extra.update({k: v for k, v in meta["roles"][name].items()
                        if k not in ("trained", "optimizer_format")})
    save_checkpoint(dest, tag, {name: state}, trainer_state=meta["trainer"],
                    config=meta["config"], layout=meta["layout"])


if __name__ == "__main__":
    main()
    shutdown()  # the process group closed on every rank before the process exits
