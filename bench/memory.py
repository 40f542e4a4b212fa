"""Memory per PPO phase with each trained-role offload level, the plan against it, the
cost of offloading, and offload/reload time per GB.

Part 1 (``phases``): the PPO set-up of ``bench/ppo_vs_trl.py`` (a Llama policy and reward
model of ``--size``, converted from Hugging Face; actor, critic, reference and reward
model) runs ``--iterations`` iterations once per level of ``roles.actor.offload`` /
``roles.critic.offload`` (none, optimizer, optimizer+grads, all; the frozen roles are
offloaded in every run). Per level: the largest rank's measured total per phase (MiB,
``memory/<phase>/total``), what ``megarlhf plan`` predicted for the same shapes, and the
median iteration time. One more run at level none with ``logging.memory_metrics=false``
gives the accounting's own cost.

Part 2 (``transfer``): a trained role of ``--transfer-size`` layers x hidden (distributed
optimizer, after one step) is offloaded and reloaded part by part; time per GB of each.
On CPU both ends are host memory: these are memcpy rates, and offloading does not lower
the process's resident memory - the accounting counts device-resident bytes. On a GPU the
same code copies to pinned host memory.

    .venv/bin/python bench/memory.py [--size small] [--iterations 3] [--transfer-size 8x1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine  # noqa: E402
from ppo_vs_trl import BATCH, EPOCHS, MINI_BATCHES, PROMPT, RESPONSE, prepare  # noqa: E402

LEVELS = ("none", "optimizer", "optimizer+grads", "all")
PHASES = ("rollout", "experience", "train", "save")
MIB = 2**20


def ppo_config(folder: str, level: str, accounting: bool = True):
    from megarlhf.config import load_config

    mrl = lambda name: os.path.join(folder, name)  # noqa: E731
    return load_config(mrl("policy_mrl/config.yaml"), [
        f"run.output_dir={mrl('run')}", "run.num_threads=2",
        f"data.train_path={mrl('prompts.jsonl')}", f"data.max_prompt_len={PROMPT}",
        f"ppo.sft_checkpoint={mrl('policy_mrl')}", f"ppo.reward_checkpoint={mrl('reward_mrl')}",
        "ppo.critic_init=reward", f"ppo.rollout_batch_size={BATCH}",
        f"ppo.mini_batch_size={BATCH // MINI_BATCHES}",
        f"ppo.micro_batch_size={BATCH // MINI_BATCHES}", f"ppo.ppo_epochs={EPOCHS}",
        "ppo.kl.controller=fixed", f"rollout.max_new_tokens={RESPONSE}",
        "rollout.stop_at_eos=false", "logging.tensorboard=false",
        "logging.progress_bar=false", f"logging.memory_metrics={str(accounting).lower()}",
        f"roles.actor.offload={level}", f"roles.critic.offload={level}"])


def phases(size: str, iterations: int) -> None:
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.memory.plan import plan_ppo
    from megarlhf.ppo.session import PPOSession

    folder = tempfile.mkdtemp(prefix=f"bench_memory_{size}_")
    prepare(size, "fixed", folder)
    print(f"## memory per phase, {size} policy/critic/reference/reward, batch {BATCH}, "
          f"prompt {PROMPT} + response {RESPONSE}; MiB on the largest rank; "
          f"measured / planned; median iteration of {iterations}")
    print(f"{'offload':16s}" + "".join(f"{p:>20s}" for p in PHASES) + f"{'s/iteration':>14s}")
    for level, accounting in [(lvl, True) for lvl in LEVELS] + [("none", False)]:
        cfg = ppo_config(folder, level, accounting)
        session = PPOSession(cfg, load_tokenizer(cfg.tokenizer))
        times, metrics = [], {}
        for it in range(iterations):
            metrics, exp, _ = session.iteration(it)
            times.append(metrics["timing/iteration"])
        seconds = statistics.median(times[1:] or times)
        if not accounting:
            print(f"{'none, no metrics':16s}" + "".join(f"{'-':>20s}" for _ in PHASES)
                  + f"{seconds:14.3f}")
            session.close()
            continue
        session.hooks.before_save()
        metrics = session.tracker.metrics(whole_run=True)
        plan = plan_ppo(cfg, 1, specs=session.specs, prompt_len=exp.prompt_tokens_BP.shape[1],
                        response_len=exp.response_tokens_BT.shape[1])
        cells = [f"{metrics.get(f'memory/{phase}/total', 0):8.1f} / "
                 f"{plan.measurable[0][phase] / MIB:7.1f}" for phase in PHASES]
        print(f"{level:16s}" + "".join(f"{c:>20s}" for c in cells) + f"{seconds:14.3f}")
        session.close()


def transfer(shape: str) -> None:
    from megarlhf.config import load_config
    from megarlhf.roles.offload import Offloader, TrainedOffloader
    from megarlhf.engine.optimizer import ensure_optimizer_state
    from megarlhf.roles.build import build_from_config
    from megarlhf.parallel.launch import init_distributed

    layers, hidden = (int(x) for x in shape.split("x"))
    cfg = load_config(None, [f"model.num_layers={layers}", f"model.hidden_size={hidden}",
                             f"model.num_attention_heads={hidden // 64}",
                             "model.vocab_size=32000", "run.num_threads=2"])
    init_distributed(cfg)
    role = build_from_config(cfg, kind="lm", trained=True)
    ensure_optimizer_state(role.trained.optimizer)
    n = sum(p.numel() for p in role.parameters)
    print(f"## offload / reload, a {layers}x{hidden} Llama ({n / 1e6:.0f} M parameters, fp32, "
          "distributed optimizer at DP=1); median of 3")
    print(f"{'part':12s}{'bytes':>12s}{'offload s':>12s}{'reload s':>12s}"
          f"{'offload s/GB':>14s}{'reload s/GB':>14s}")
    for part in ("optimizer", "grads", "params"):
        off = TrainedOffloader(role, "all")
        out, back, size = [], [], 0
        for _ in range(4):
            t0 = time.perf_counter()
            size = off.release((part,))
            t1 = time.perf_counter()
            off.restore((part,))
            out.append(t1 - t0)
            back.append(time.perf_counter() - t1)
        o, b = statistics.median(out[1:]), statistics.median(back[1:])
        gb = size / 1e9
        print(f"{part:12s}{size:12d}{o:12.4f}{b:12.4f}{o / gb:14.4f}{b / gb:14.4f}")
    # a frozen role's first offload: its host buffers are allocated (page faults)
    frozen = Offloader(role.chunks, enabled=True)
    t0 = time.perf_counter()
    frozen.offload()
    t1 = time.perf_counter()
    frozen.reload()
    t2 = time.perf_counter()
    size = sum(p.numel() * p.element_size() for p in role.parameters)
    print(f"{'frozen-1st':12s}{size:12d}{t1 - t0:12.4f}{t2 - t1:12.4f}"
          f"{(t1 - t0) / (size / 1e9):14.4f}{(t2 - t1) / (size / 1e9):14.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--transfer-size", default="8x1024", help="LAYERSxHIDDEN")
    parser.add_argument("--parts", default="phases,transfer")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"# bench/memory.py; {machine()}")
    if "phases" in args.parts:
        phases(args.size, args.iterations)
    if "transfer" in args.parts:
        transfer(args.transfer_size)


if __name__ == "__main__":
    main()
