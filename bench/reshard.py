"""Time and bytes of training-layout -> inference-layout resharding (in memory, megatron's
resharding API) against saving and loading a distributed checkpoint for the same pair of
layouts. Runs itself under torchrun with 2 processes.

    .venv/bin/python bench/reshard.py [--size small]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SIZES, free_port, machine  # noqa: E402

PAIRS = [("TP=2 -> TP=1 x2", 2, 1, 1), ("PP=2 -> TP=2", 1, 2, 2), ("TP=1/PP=2 -> TP=1 x2", 1, 2, 1)]


def worker(size: str) -> None:
    import torch
    import torch.distributed as dist

    from megarlhf.config import load_config
    from megarlhf.engine.checkpoint import RoleState, load_checkpoint, save_checkpoint
    from megarlhf.roles.build import build_from_config
    from megarlhf.parallel.launch import init_distributed
    from megarlhf.inference.reshard import Resharder, build_inference_model, inference_layout

    s = SIZES[size]
    rows = []
    for name, tp, pp, rtp in PAIRS:
        cfg = load_config(None, [
            f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
            f"model.num_attention_heads={s['heads']}", f"model.num_query_groups={s['kv_heads']}",
            f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}",
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}", f"rollout.tensor_parallel_size={rtp}"])
        if not dist.is_initialized():
            init_distributed(cfg)
        actor = build_from_config(cfg, kind="lm")
        layout, chunks = actor.layout, actor.chunks
        inf = inference_layout(rtp, actor.spec.model)
        inf_model = build_inference_model(actor.spec, inf)
        resharder = Resharder(chunks, inf_model)
        first = resharder()
        steady = [resharder() for _ in range(5)]
        t_reshard = sorted(x.seconds for x in steady)[2]
        tmp = tempfile.mkdtemp() if dist.get_rank() == 0 else None
        holder = [tmp]
        dist.broadcast_object_list(holder)
        # The alternative: save from the training layout, load into a model built in the
        # inference layout (as a separate inference job would have it). Model building is
        # not timed.
        inf_cfg = load_config(None, [f"model.{k}={v}" for k, v in {
            "num_layers": s["layers"], "hidden_size": s["hidden"],
            "num_attention_heads": s["heads"], "num_query_groups": s["kv_heads"],
            "ffn_hidden_size": s["ffn"], "vocab_size": s["vocab"]}.items()]
            + [f"parallel.tensor_model_parallel_size={rtp}",
               f"rollout.tensor_parallel_size={rtp}"])
        start = time.perf_counter()
        save_checkpoint(holder[0], "b", {"policy": RoleState(chunks)}, layout=layout.describe())
        t_save = time.perf_counter() - start
        target = build_from_config(inf_cfg, kind="lm").chunks
        start = time.perf_counter()
        load_checkpoint(os.path.join(holder[0], "b"), {"policy": RoleState(target)},
                        load_optimizer=False, load_rng=False)
        t_ckpt = t_save + time.perf_counter() - start
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)
        rows.append((name, first.seconds, t_reshard, steady[0].bytes_received, t_ckpt))
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in inf_model.parameters())
        print(f"# reshard: {size} model ({params / 1e6:.2f} M params per inference replica), "
              f"2 processes, gloo; {machine()}")
        print(f"{'layouts':<22} {'first ms':>9} {'reshard ms':>11} {'MB moved':>9} "
              f"{'ckpt save+load ms':>18} {'speed-up':>9}")
        for name, first_s, t, nbytes, tc in rows:
            print(f"{name:<22} {first_s * 1e3:>9.1f} {t * 1e3:>11.1f} {nbytes / 1e6:>9.2f} "
                  f"{tc * 1e3:>18.1f} {tc / t:>9.1f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.size)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                    f"--master-port={free_port()}", os.path.abspath(__file__), "--size",
                    args.size, "--worker"], check=True, env=env)


if __name__ == "__main__":
    main()
