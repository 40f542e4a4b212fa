"""Under torchrun (2 ranks): run.metric_bands decides together. Only rank 0 holds the
metric (as with an evaluation rank 0 alone computes): inside its band no rank stops; outside,
every rank raises - rank 1 too, which never saw the value (without the all-reduce it would
go on to the next collective and wait there)."""

import sys

import torch.distributed as dist

from megarlhf.config import load_config
from megarlhf.engine.optimizer import RunawayError
from megarlhf.parallel.launch import init_distributed
from megarlhf.stages.common import MetricBands

cfg = load_config(None, ["run.metric_bands={eval/gold_score: [-1.0, null]}"])
init_distributed(cfg)
rank = dist.get_rank()
bands = MetricBands(cfg)
bands.check({"eval/gold_score": 0.5} if rank == 0 else {}, "step 1")
try:
    bands.check({"eval/gold_score": -2.0} if rank == 0 else {}, "step 2")
except RunawayError as err:
    print(f"rank {rank} stopped: {err}", flush=True)
else:
    sys.exit(f"rank {rank} went on")
