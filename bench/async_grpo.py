"""Asynchronous GRPO on this machine's two cores: synchronous colocated against split
placement (one rollout process, one training process) at staleness k = 0, 1, 2.

The shape is generation-heavy, as GRPO has it: the long-tailed responses of
``bench/ppo_vs_trl.py``'s ``longtail`` variant (up to 256 tokens, median ~40: the same
policy, reward model, prompts and tokenizer, built by its ``prepare``), groups of 4, one
optimizer step per batch (the whole batch one mini-batch, one epoch), packed micro-batches,
no critic, the KL as a loss term, old log-probs recomputed (the decoupled loss at k > 0
needs them; the synchronous rows recompute them too, so every row does the same passes).
Each row is one ``megarlhf ppo`` run of ``--iterations`` iterations, the rows one after the
other; the first ``--warmup`` iterations are not counted. Rows:

- ``sync``: colocated, one process with 2 threads (``run.num_threads=2``);
- ``sync-k1``: colocated at k = 1 (the schedule alone: nothing overlaps);
- ``split-k0`` / ``split-k1`` / ``split-k2``: ``rollout.placement.mode=split``, 2 processes of
  1 thread: process 1 samples, process 0 scores and trains; at k >= 1 they overlap;
- ``sync-slots`` / ``split-k1-slots``: ``sync`` / ``split-k1`` with continuous batching,
  8 decode slots for the 16 samples (``rollout.decode_slots``);
- ``split-k1-partial`` / ``split-k2-partial`` / ``split-k1-slots-partial``: with partial
  rollouts (``rollout.placement.partial``: each update taken by the batch being sampled, its keys
  and values recomputed); ``split-k1-partial-keep``: the keys and values kept;
- ``trl-grpo``: TRL's ``GRPOTrainer`` at the same shape (:func:`trl_grpo`), 2 threads.

Reported per row: the median seconds per iteration, tokens (prompt + response) per second
of wall clock, and the phases (generation: the sampler's own time, on the rollout process
under split; wait: how long training waited for a batch; sync w: the weight sync), the
median staleness, the share of idle decode slots (rows fed after they stopped), the
mean response length, the share of tokens sampled after an in-flight update (partial)
and the mean |sampler - trainer| log-prob of the batch's tokens (lp diff: a stale token
differs by its policy's lag; a kept KV cache adds its own error). The rows sample different batches (at k >= 1 an older policy
samples each), so their lengths differ: compare tokens per second, not seconds. From the ``sync`` row's phases
timed alone, also the step time the same run would have with rollout and training on
separate devices: max(generation, the rest) - the cluster case, where neither side shares
cores with the other.

    .venv/bin/python bench/async_grpo.py [--size small] [--iterations 8] [--warmup 2]
        [--batch 16] [--rows sync split-k0 split-k1 split-k2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_vs_trl as bench  # noqa: E402
from common import ROOT, machine  # noqa: E402

GROUP = 4
SPLIT = ["rollout.placement.mode=split", "rollout.placement.ranks=1"]
ROWS = {
    "sync": (1, ["run.num_threads=2"]),
    "sync-k1": (1, ["run.num_threads=2", "ppo.max_staleness=1"]),
    "split-k0": (2, ["run.num_threads=1", *SPLIT]),
    "split-k1": (2, ["run.num_threads=1", *SPLIT, "ppo.max_staleness=1"]),
    "split-k2": (2, ["run.num_threads=1", *SPLIT, "ppo.max_staleness=2"]),
    # continuous batching: half the batch's rows decode at once, freed slots refilled
    "sync-slots": (1, ["run.num_threads=2", "rollout.decode_slots=8"]),
    "split-k1-slots": (2, ["run.num_threads=1", *SPLIT, "ppo.max_staleness=1",
                           "rollout.decode_slots=8"]),
    # partial rollouts: each update is taken by the batch being sampled, between two decode
    # steps (the keys and values recomputed, or kept)
    "split-k1-partial": (2, ["run.num_threads=1", *SPLIT, "ppo.max_staleness=1",
                             "rollout.placement.partial=true"]),
    "split-k1-partial-keep": (2, ["run.num_threads=1", *SPLIT, "ppo.max_staleness=1",
                                  "rollout.placement.partial=true", "rollout.placement.partial_kv=keep"]),
    "split-k2-partial": (2, ["run.num_threads=1", *SPLIT, "ppo.max_staleness=2",
                             "rollout.placement.partial=true"]),
    "split-k1-slots-partial": (2, ["run.num_threads=1", *SPLIT, "ppo.max_staleness=1",
                                   "rollout.decode_slots=8", "rollout.placement.partial=true"]),
}


def overrides(folder: str, iterations: int, batch: int) -> list[str]:
    """GRPO at the bench's shape (see the module docstring)."""
    base = [o for o in bench.megarlhf_overrides(folder, "longtail")
            if not o.startswith(("ppo.rollout_batch_size=", "ppo.mini_batch_size=",
                                 "ppo.micro_batch_size=", "ppo.ppo_epochs=",
                                 "ppo.num_iterations=", "ppo.kl.controller=",
                                 "ppo.kl.init_coef=", "rollout.recompute_logprobs=",
                                 "run.num_threads=", "ppo.critic_init=",
                                 "optimizer.critic_lr=", "rollout.forward_micro_batch_size="))]
    longest = bench.PROMPT + bench.RESPONSE
    return base + [
        "ppo.advantage_estimator=grpo", f"ppo.group_size={GROUP}",
        f"ppo.rollout_batch_size={batch // GROUP}", f"ppo.mini_batch_size={batch}",
        f"ppo.micro_batch_size={batch}", "ppo.ppo_epochs=1", f"ppo.num_iterations={iterations}",
        "ppo.kl.controller=fixed", "ppo.kl.init_coef=0", "ppo.kl.loss_coef=0.04",
        "rollout.recompute_logprobs=true", "checkpoint.save_interval=0",
        f"ppo.eval_interval={iterations}", "ppo.num_eval_prompts=4",
        f"data.eval_path={os.path.join(folder, 'prompts.jsonl')}",
        f"ppo.max_tokens_per_micro_batch={batch // 2 * longest}",
        f"rollout.forward_max_tokens_per_micro_batch={batch * longest}"]


def run_row(name: str, folder: str, iterations: int, batch: int, log) -> list[dict]:
    procs, extra = ROWS[name]
    argv = ["ppo", os.path.join(folder, "policy_mrl/config.yaml"),
            *overrides(folder, iterations, batch), *extra, f"run.name={name}"]
    if procs == 1:
        cmd = [sys.executable, "-m", "megarlhf.cli", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
               "--standalone", "-m", "megarlhf.cli", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if procs > 1 else "2",
           "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - start
    path = os.path.join(folder, "run_megarlhf", name, "metrics.jsonl")
    records = [json.loads(line) for line in open(path) if line.strip()]
    out = [r for r in records if r.get("step", 0) >= 1]
    out[0]["_wall"] = wall
    return out


def trl_grpo(folder: str, iterations: int, batch: int) -> None:
    """TRL's ``GRPOTrainer`` (no gc.collect() per step to turn off) at the same shape: the
    same HF policy (the longtail bias) and reward model, groups of 4, one step per batch
    (``steps_per_generation=1``, ``num_iterations=1``), KL coefficient 0.04, 2 threads.
    Prints one JSON line per step: seconds, and prompt + response tokens."""
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    path = lambda name: os.path.join(folder, name)  # noqa: E731
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path("policy_hf"))
    tok.padding_side = "left"
    policy = transformers.AutoModelForCausalLM.from_pretrained(path("policy_hf"))
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(path("reward_hf"))
    # the prompts megarlhf samples from: BOS, then the words (the word-level tokenizer adds
    # no BOS of its own; without it the policy's stop probability, biased for the prompts
    # with BOS, differs and TRL's responses ran ~2x as long)
    with open(path("prompts.jsonl")) as f:
        prompts = Dataset.from_dict({"prompt": ["<s> " + json.loads(line)["prompt"]
                                                for line in f]})
    args = GRPOConfig(
        output_dir=path("run_trl"), per_device_train_batch_size=batch, num_generations=GROUP,
        steps_per_generation=1, num_iterations=1, max_completion_length=bench.RESPONSE,
        beta=0.04, learning_rate=bench.LR, lr_scheduler_type="constant", temperature=1.0,
        max_steps=iterations, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=1234, dataloader_num_workers=0, bf16=False)
    clock = {}

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            clock["start"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            clock["end"] = time.perf_counter()

    class Report(transformers.TrainerCallback):
        last = [0.0]

        def on_log(self, args, state, control, logs=None, **k):
            total = (logs or {}).get("num_tokens")
            if total is None or "end" not in clock:
                return
            print("@@ " + json.dumps({"timing/iteration": clock["end"] - clock["start"],
                                      "tokens": total - self.last[0]}), flush=True)
            self.last[0] = total

    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=prompts,
                          processing_class=tok, reward_processing_classes=tok,
                          callbacks=[Timer(), Report()])
    trainer.train()


def run_trl(folder: str, iterations: int, batch: int, log) -> list[dict]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker", folder,
                           "--iterations", str(iterations), "--batch", str(batch)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2",
                                         "PYTHONWARNINGS": "ignore"},
                          stdout=subprocess.PIPE, stderr=log, text=True, check=True)
    wall = time.perf_counter() - start
    out = []
    for line in proc.stdout.splitlines():
        if line.startswith("@@ "):
            r = json.loads(line[3:])
            r["perf/tokens_per_s"] = r["tokens"] / r["timing/iteration"]
            out.append(r)
    out[0]["_wall"] = wall
    return out


def report(rows: dict[str, list[dict]], warmup: int) -> None:
    def med(name, key, default=0.0):
        return statistics.median(r.get(key, default) for r in rows[name][warmup:])

    print(f"{'row':10s} {'s/iter':>8s} {'tok/s':>8s} {'vs sync':>8s} {'generate':>9s} "
          f"{'wait':>7s} {'train':>7s} {'sync w':>7s} {'staleness':>9s} {'idle':>5s} "
          f"{'resp':>5s} {'partial':>7s} {'lp diff':>8s} {'wall s':>7s}")
    base = None
    for name in rows:
        it = med(name, "timing/iteration")
        tokens = med(name, "perf/tokens_per_s") * it
        rate = tokens / it
        base = base or rate
        print(f"{name:10s} {it:8.2f} {rate:8.0f} {rate / base:7.2f}x "
              f"{med(name, 'timing/generate'):9.2f} {med(name, 'timing/rollout_wait'):7.2f} "
              f"{med(name, 'timing/train'):7.2f} {med(name, 'timing/weight_sync'):7.3f} "
              f"{med(name, 'rollout/staleness_mean'):9.1f} "
              f"{med(name, 'rollout/idle_decode_slots'):5.2f} "
              f"{med(name, 'rollout/response_len_mean'):5.0f} "
              f"{med(name, 'rollout/partial_tokens'):7.2f} "
              f"{med(name, 'rollout/logprob_diff_mean'):8.5f} {rows[name][0]['_wall']:7.1f}")
    if "sync" in rows:
        it = med("sync", "timing/iteration")
        gen = med("sync", "timing/generate") + med("sync", "timing/reshard")
        rest = it - gen
        print(f"sync's phases timed alone: generation {gen:.2f} s (reshard included), the rest "
              f"{rest:.2f} s; on separate devices (k >= 1) an iteration would take "
              f"max = {max(gen, rest):.2f} s: {it / max(gen, rest):.2f}x the synchronous one")
    for name in rows:
        gold = [r["eval/gold_score"] for r in rows[name] if "eval/gold_score" in r]
        if gold:
            print(f"  {name}: gold score at the end {gold[-1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="samples per batch (groups of 4)")
    parser.add_argument("--rows", nargs="+", choices=[*ROWS, "trl-grpo"],
                        default=["sync", "split-k0", "split-k1", "split-k2", "trl-grpo"])
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    bench.configure(args.batch, bench.LONGTAIL_RESPONSE)
    if args.trl_worker:
        trl_grpo(args.trl_worker, args.iterations, args.batch)
        return
    print(f"# {machine()}")
    print(f"# GRPO, {args.size}, long-tailed responses (<= {bench.LONGTAIL_RESPONSE} tokens), "
          f"batch {args.batch} = {args.batch // GROUP} prompts x {GROUP}, one update per "
          f"batch; {args.iterations} iterations, the first {args.warmup} not counted")
    with tempfile.TemporaryDirectory() as folder:
        note = bench.prepare(args.size, "longtail", folder)["note"]
        print(f"# {note}")
        rows = {}
        with open(os.path.join(folder, "runs.log"), "w") as log:
            for name in args.rows:
                try:
                    rows[name] = run_trl(folder, args.iterations, args.batch, log) \
                        if name == "trl-grpo" else \
                        run_row(name, folder, args.iterations, args.batch, log)
                except subprocess.CalledProcessError:
                    log.flush()
                    print(open(os.path.join(folder, "runs.log")).read()[-3000:])
                    raise
        report(rows, args.warmup)


if __name__ == "__main__":
    main()
