"""PPO iteration throughput: megarlhf against TRL 1.12.0's ``PPOTrainer``, side by side.

Both frameworks load the same Hugging Face checkpoints (megarlhf through
``tools/convert_hf_to_megatron.py``): a Llama policy (actor and reference) and a Llama
sequence-classification reward model (reward model, and where the critic starts). Each
framework runs in its own worker process at 2 threads; the driver hands out iterations in
turn, so every row sees the same machine. The first ``--warmup`` iterations of each are not
counted. Rows (``--rows``):

- ``megarlhf``: defaults (``optimizer.use_distributed_optimizer=auto``: plain at DP=1;
  packed micro-batches at the ``auto`` token budgets, which here are ``mrl-packed``'s);
- ``mrl-packed``: packed micro-batches (``ppo.max_tokens_per_micro_batch``,
  ``rollout.forward_max_tokens_per_micro_batch``) at the token budgets of the padded ones:
  a mini-batch's micro-batch of rows x (prompt + longest response) tokens for training, the
  whole batch's for the experience passes - no more memory than padded;
- ``mrl-padded``: padded micro-batches (``ppo.max_tokens_per_micro_batch=null``), the
  default before packing was;
- ``mrl-distopt``: megatron's distributed optimizer forced at DP=1 (the old default);
- ``mrl-lora``: the actor trains LoRA adapters of rank 16 on every projection (its
  reference is then the actor with the adapters off; the critic trains whole);
- ``mrl-bf16``: every role in bf16 (``model.params_dtype=bfloat16``), fp32 master weights
  and Adam state in the optimizer, as on a GPU;
- ``trl``: TRL as shipped; ``trl-nogc``: TRL with its per-iteration ``gc.collect()``
  disabled; ``trl-bf16``: ``trl-nogc`` with ``bf16=True`` (autocast).

Settings (the issue's): prompts of 32 tokens, responses of up to ``--response`` (32), batch
``--batch`` (16), 4 PPO epochs x 2 mini-batches, one optimizer step per mini-batch, fp32,
fixed KL coefficient. Both use the sampler's log-probs as the old log-probs and keep the
frozen models resident (megarlhf: ``rollout.recompute_logprobs=false``,
``rollout.offload_frozen_models=false``), and run the experience passes in one forward
micro-batch of the whole batch (TRL: ``local_rollout_forward_batch_size``; megarlhf:
``rollout.forward_micro_batch_size``). Variant ``fixed`` samples every token (no stop
token); variant ``stop`` ends responses at EOS, whose output row was biased so that
responses average half the length; variant ``longtail`` (responses up to 256 tokens unless
``--response`` says otherwise) biases it so that the median sampled response has 40
tokens: a near-constant stop probability per token, so lengths fall off geometrically (a
95th percentile near 3 medians, as reasoning responses have). Both frameworks sample from
the same weights the same way. Column ``pad``: the share of the token positions the
training passes computed that were padding (megarlhf: ``perf/padding_fraction/train``;
TRL: its batches are the prompt + the longest response wide). megarlhf rows also print
their train phase's peak memory and the actor's activations (``logging.memory_metrics``,
on by default: the accounting of docs/memory.md).

    .venv/bin/python bench/ppo_vs_trl.py [--sizes tiny small] [--variants fixed stop]
        [--iterations 4] [--warmup 1] [--rows megarlhf trl trl-nogc ...]
        [--batch 16] [--response 32]

Phases: generation (megarlhf: reshard + sampling; TRL: ``batch_generation``), experience
(reference, reward and value passes, rewards, GAE), training (PPO epochs), other (the rest of
the iteration: TRL's gc.collect() and logging, megarlhf's bookkeeping). Figures are medians.
This VM's speed drifts by 25% within minutes, so each pair of rows is also compared round
by round (the rows of one round run back to back): the median and range of those ratios.
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
from common import ROOT, SIZES, convert, llama_config, machine, qwen3_moe_config  # noqa: E402

BATCH, PROMPT, RESPONSE, EPOCHS, MINI_BATCHES = 16, 32, 32, 4, 2
PAD, BOS, EOS = 0, 1, 2
LR, KL_COEF = 1e-5, 0.05
TAG = "@@ "  # worker lines meant for the driver
# row -> megarlhf overrides (None: a TRL row)
MEGARLHF_ROWS = {
    "megarlhf": [],
    "mrl-packed": None,  # the budgets follow the shape: packed_overrides()
    "mrl-padded": ["ppo.max_tokens_per_micro_batch=null"],
    "mrl-distopt": ["optimizer.use_distributed_optimizer=true"],
    "mrl-lora": ["model.lora.rank=16", "model.lora.alpha=32"],
    "mrl-bf16": ["model.params_dtype=bfloat16", "roles.reference.model.params_dtype=bfloat16",
                 "roles.reward.model.params_dtype=bfloat16",
                 "roles.critic.model.params_dtype=bfloat16"],
}
TRL_ROWS = ("trl", "trl-nogc", "trl-bf16")
# "baseline": megarlhf's default row from another checkout (--baseline DIR, e.g. a
# ``git worktree`` of an older commit), its own bench/ppo_vs_trl.py as the worker
BASELINE = "baseline"
ROWS = (*MEGARLHF_ROWS, BASELINE, *TRL_ROWS)
DEFAULT_ROWS = ("megarlhf", "mrl-distopt", "trl", "trl-nogc")


LONGTAIL_RESPONSE, LONGTAIL_MEDIAN = 256, 40


def configure(batch: int, response: int) -> None:
    """The shape every worker and the driver use (module-wide, as the settings above)."""
    global BATCH, RESPONSE
    BATCH, RESPONSE = batch, response


def packed_overrides() -> list[str]:
    """Packed micro-batches at the padded ones' token budgets (see the module docstring)."""
    longest = PROMPT + RESPONSE
    return [f"ppo.max_tokens_per_micro_batch={BATCH // MINI_BATCHES * longest}",
            f"rollout.forward_max_tokens_per_micro_batch={BATCH * longest}"]


# ------------------------------------------------------------------ shared inputs

def _tokenizer(vocab: int, folder: str):
    """A word-level tokenizer over 'w3 ... w{vocab-1}' plus <pad>, <s>, </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def _llama_config(size: str):
    return llama_config(size, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, num_labels=1)


def _policy(size: str):
    """The policy: Llama, or Qwen3-MoE for a size with experts (both peers run it)."""
    import transformers
    if "experts" in SIZES[size]:
        return transformers.Qwen3MoeForCausalLM(qwen3_moe_config(
            size, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD))
    return transformers.LlamaForCausalLM(_llama_config(size))


def _response_lengths(responses: torch.Tensor, stop: bool) -> torch.Tensor:
    """Tokens per row up to and including the first EOS (all of them without a stop)."""
    stops = responses == EOS if stop else torch.zeros_like(responses, dtype=torch.bool)
    return torch.where(stops.any(1), stops.float().argmax(1) + 1, RESPONSE)


@torch.no_grad()
def _bias_towards_eos(policy, prompts: torch.Tensor, target_length: float,
                      statistic=torch.mean) -> float:
    """Point the EOS output row along the mean final hidden state of the policy's own
    sampled responses, scaled (by bisection) so that the ``statistic`` (mean, median) of
    the lengths of responses sampled with EOS as the stop token is ``target_length``
    tokens. Returns that statistic."""
    ones = torch.ones_like(prompts)

    def sample(**kw):
        torch.manual_seed(7)
        return policy.generate(prompts, attention_mask=ones, do_sample=True, top_k=0,
                               max_new_tokens=RESPONSE, pad_token_id=PAD, **kw)[:, PROMPT:]

    tokens = torch.cat([prompts, sample(min_new_tokens=RESPONSE)], 1)
    hidden = policy(tokens, output_hidden_states=True).hidden_states[-1][:, PROMPT - 1:-1]
    mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)
    direction = mean / mean.square().sum()

    def mean_length(scale):
        policy.lm_head.weight[EOS] = scale * direction
        return float(statistic(_response_lengths(sample(eos_token_id=EOS), stop=True).float()))

    low, high = 0.0, 100.0
    for _ in range(16):
        mid = (low + high) / 2
        low, high = (mid, high) if mean_length(mid) > target_length else (low, mid)
    return mean_length((low + high) / 2)


def prepare(size: str, variant: str, folder: str) -> dict:
    """HF policy + reward model + tokenizer + prompts, converted for megarlhf."""
    import transformers
    vocab = SIZES[size]["vocab"]
    hf_policy, hf_reward = os.path.join(folder, "policy_hf"), os.path.join(folder, "reward_hf")
    gen = torch.Generator().manual_seed(11)
    prompts = [[BOS] + torch.randint(3, vocab, (PROMPT - 1,), generator=gen).tolist()
               for _ in range(256)]
    torch.manual_seed(0)
    policy = _policy(size).eval()
    note = "no stop token: every response has 32 tokens"
    if variant == "stop":
        length = _bias_towards_eos(policy, torch.tensor(prompts[:BATCH]), RESPONSE / 2)
        note = f"EOS row biased so that sampled responses averaged {length:.1f} tokens"
    elif variant == "longtail":
        length = _bias_towards_eos(policy, torch.tensor(prompts[:64]), LONGTAIL_MEDIAN,
                                   statistic=torch.median)
        note = f"EOS row biased so that the median sampled response had {length:.0f} tokens"
    torch.manual_seed(1)
    reward = transformers.LlamaForSequenceClassification(_llama_config(size)).eval()
    for model, path in ((policy, hf_policy), (reward, hf_reward)):
        model.save_pretrained(path)
        _tokenizer(vocab, path)
    convert(hf_policy, os.path.join(folder, "policy_mrl"))
    convert(hf_reward, os.path.join(folder, "reward_mrl"), "--role", "reward")
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in p[1:])}) + "\n")
    with open(os.path.join(folder, "prompt_ids.json"), "w") as f:
        json.dump(prompts, f)
    return {"note": note}


# ------------------------------------------------------------------ workers

class Channel:
    """The worker side of the driver protocol: wait for 'go', answer one JSON line."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # everything else the frameworks print goes to the log

    def send(self, payload) -> None:
        self.out.write(TAG + json.dumps(payload) + "\n")

    def wait(self) -> bool:
        """True for 'go', False for 'stop'."""
        return sys.stdin.readline().strip() == "go"


def megarlhf_overrides(folder: str, variant: str) -> list[str]:
    """The bench's PPO settings as megarlhf config overrides (on the converted policy's
    config.yaml)."""
    from megarlhf.config import RolloutConfig

    mrl = lambda name: os.path.join(folder, name)  # noqa: E731
    # the experience passes in one forward micro-batch, as TRL's; megarlhf before this
    # setting existed (profile_ppo.py on older code) ran them in micro-batches of 8
    forward = [f"rollout.forward_micro_batch_size={BATCH}"] \
        if "forward_micro_batch_size" in RolloutConfig.__dataclass_fields__ else []
    return forward + [
        f"run.output_dir={mrl('run_megarlhf')}", "run.num_threads=2",
        f"data.train_path={mrl('prompts.jsonl')}", f"data.max_prompt_len={PROMPT}",
        f"ppo.sft_checkpoint={mrl('policy_mrl')}", f"ppo.reward_checkpoint={mrl('reward_mrl')}",
        "ppo.critic_init=reward", f"ppo.rollout_batch_size={BATCH}",
        f"ppo.mini_batch_size={BATCH // MINI_BATCHES}",
        f"ppo.micro_batch_size={BATCH // MINI_BATCHES}", f"ppo.ppo_epochs={EPOCHS}",
        "ppo.num_iterations=1000", "ppo.kl.controller=fixed", f"ppo.kl.init_coef={KL_COEF}",
        f"rollout.max_new_tokens={RESPONSE}", "rollout.temperature=1.0",
        f"rollout.stop_at_eos={str(variant != 'fixed').lower()}",
        # TRL's missing_eos_penalty=None: a response cut at the length limit keeps its score
        # (megarlhf's default replaces it by -1, which teaches the policy to stop early)
        "ppo.missing_stop_penalty=null",
        "rollout.recompute_logprobs=false", "rollout.offload_frozen_models=false",
        f"optimizer.lr={LR}", f"optimizer.critic_lr={LR}", "optimizer.lr_schedule=constant",
        "logging.tensorboard=false", "logging.progress_bar=false"]


def megarlhf_worker(folder: str, variant: str, overrides: list[str]) -> None:
    from megarlhf.config import load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.ppo.session import PPOSession

    channel = Channel()
    base = megarlhf_overrides(folder, variant)
    if any(o.startswith("rollout.forward_max_tokens_per_micro_batch=") for o in overrides):
        base = [o for o in base if not o.startswith("rollout.forward_micro_batch_size=")]
    cfg = load_config(os.path.join(folder, "policy_mrl/config.yaml"), base + overrides)
    session = PPOSession(cfg, load_tokenizer(cfg.tokenizer))
    channel.send("ready")
    it = 0
    while channel.wait():
        m, exp, _ = session.iteration(it)
        it += 1
        generation = m["timing/rollout"]
        experience = m["timing/experience"] + m["timing/reward"]  # the RM's pass included
        channel.send({
            "generation": generation, "experience": experience,
            "training": m["timing/train"],
            "other": m["timing/iteration"] - generation - experience - m["timing/train"],
            "iteration": m["timing/iteration"],
            "padding": m["perf/padding_fraction/train"],
            **({"memory_train": m["memory/train/total"],
                "activations": m["memory/train/actor/activations"]}
               if "memory/train/total" in m else {}),
            "response_tokens": float(exp.response_mask_BT.sum()),
            "tokens": float(exp.response_mask_BT.sum() + exp.prompt_mask_BP.sum())})
    session.close()


def trl_worker(folder: str, variant: str, collect_garbage: bool, iterations: int,
               bf16: bool = False) -> None:
    import types

    import transformers
    from datasets import Dataset
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    channel = Channel()
    torch.set_num_threads(2)
    path = lambda name: os.path.join(folder, name)  # noqa: E731
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path("policy_hf"))
    policy = transformers.AutoModelForCausalLM.from_pretrained(path("policy_hf"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path("policy_hf"))
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(path("reward_hf"))
    value = transformers.AutoModelForSequenceClassification.from_pretrained(path("reward_hf"))
    with open(path("prompt_ids.json")) as f:
        prompts = Dataset.from_dict({"input_ids": json.load(f)})
    args = PPOConfig(
        output_dir=path("run_trl"), per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1, num_mini_batches=MINI_BATCHES, num_ppo_epochs=EPOCHS,
        local_rollout_forward_batch_size=BATCH, response_length=RESPONSE,
        total_episodes=BATCH * iterations, learning_rate=LR, lr_scheduler_type="constant",
        bf16=bf16, fp16=False, gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        stop_token=None if variant == "fixed" else "eos", missing_eos_penalty=None,
        temperature=1.0, kl_coef=KL_COEF, num_sample_generations=0, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=1234,
        dataloader_num_workers=0)

    clock = {}

    def timed_generation(*a, **k):
        start = time.perf_counter()
        out = generate_fn(*a, **k)
        clock["generation"] = time.perf_counter() - start
        clock["generation_end"] = time.perf_counter()
        clock["response_tokens"] = float(_response_lengths(out[0][:, PROMPT:],
                                                           stop=variant != "fixed").sum())
        clock["width"] = out[0].shape[1]  # the batches' width: prompt + longest response
        return out

    def timed_forward(model, *a, **k):
        if isinstance(model, ppo_module.PolicyAndValueWrapper) and "training_start" not in clock:
            clock["training_start"] = time.perf_counter()
        return forward_fn(model, *a, **k)

    generate_fn, forward_fn = ppo_module.batch_generation, ppo_module.forward
    ppo_module.batch_generation, ppo_module.forward = timed_generation, timed_forward
    if not collect_garbage:
        ppo_module.gc = types.SimpleNamespace(collect=lambda *a, **k: 0)

    class Handoff(transformers.TrainerCallback):
        def _go(self):
            if not channel.wait():
                return False
            clock.clear()
            clock["start"] = time.perf_counter()
            return True

        def on_train_begin(self, *a, **k):
            channel.send("ready")
            self._go()

        def on_log(self, *a, **k):
            clock.setdefault("training_end", time.perf_counter())

        def on_step_end(self, *a, **k):
            end = time.perf_counter()
            experience = clock["training_start"] - clock["generation_end"]
            training = clock["training_end"] - clock["training_start"]
            total = end - clock["start"]
            channel.send({"generation": clock["generation"], "experience": experience,
                          "training": training,
                          "other": total - clock["generation"] - experience - training,
                          "iteration": total, "response_tokens": clock["response_tokens"],
                          "padding": 1 - (clock["response_tokens"] + BATCH * PROMPT)
                          / (BATCH * clock["width"]),
                          "tokens": clock["response_tokens"] + BATCH * PROMPT})
            self._go()

    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref,
                         reward_model=reward, train_dataset=prompts, value_model=value,
                         eval_dataset=prompts, callbacks=[Handoff()])
    trainer.train()


# ------------------------------------------------------------------ driver

class Worker:
    def __init__(self, kind: str, folder: str, variant: str, iterations: int, log,
                 baseline: str | None = None):
        tree = baseline if kind == BASELINE else ROOT
        cmd = [sys.executable, os.path.join(tree, "bench", "ppo_vs_trl.py"), "--worker",
               "megarlhf" if kind == BASELINE else kind, "--folder", folder,
               "--variant", variant, "--iterations", str(iterations), "--batch", str(BATCH),
               "--response", str(RESPONSE)]
        env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.kind, self.log = kind, log
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, env=env, cwd=tree)

    def receive(self):
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        raise RuntimeError(f"{self.kind} worker exited (rc {self.proc.wait()}); "
                           f"see {self.log.name}")

    def command(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()


def run_pair(size: str, variant: str, iterations: int, warmup: int, folder: str,
             rows: tuple = DEFAULT_ROWS, baseline: str | None = None) -> dict:
    info = prepare(size, variant, folder)
    total = warmup + iterations
    log = open(os.path.join(folder, "workers.log"), "w")
    workers = [Worker(k, folder, variant, total, log, baseline) for k in rows]
    for w in workers:
        assert w.receive() == "ready"
    results = {w.kind: [] for w in workers}
    lengths = {w.kind: [] for w in workers}  # mean response tokens, warm-up included
    for it in range(total):
        for w in workers:
            time.sleep(0.5)  # let the previous worker's threads go idle
            w.command("go")
            result = w.receive()
            lengths[w.kind].append(result["response_tokens"] / BATCH)
            if it >= warmup:
                results[w.kind].append(result)
    for w in workers:
        w.command("stop")
        w.proc.wait(timeout=120)
    log.close()
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return {"note": info["note"], "lengths": lengths, "rounds": results,
            "medians": {k: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
                        for k, rs in results.items()}}


def report(size: str, variant: str, out: dict) -> None:
    med = out["medians"]
    rows = list(med)
    ours_rows = [k for k in rows if k in MEGARLHF_ROWS or k == BASELINE]
    rate = {k: med[k]["tokens"] / med[k]["iteration"] for k in rows}
    print(f"\n## {size}, {variant}, batch {BATCH}, response <= {RESPONSE} ({out['note']})")
    print(f"{'':>12} {'generation s':>12} {'experience s':>12} {'training s':>10} "
          f"{'other s':>8} {'iteration s':>11} {'resp tok':>8} {'pad':>5} {'tokens/s':>9} "
          + " ".join(f"{ours + ' vs it':>16}" for ours in ours_rows))
    for kind in rows:
        m = med[kind]
        print(f"{kind:>12} {m['generation']:>12.3f} {m['experience']:>12.3f} "
              f"{m['training']:>10.3f} {m['other']:>8.3f} {m['iteration']:>11.3f} "
              f"{m['response_tokens'] / BATCH:>8.1f} {m.get('padding', float('nan')):>5.2f} "
              f"{rate[kind]:>9.0f} "
              + " ".join(f"{rate[ours] / rate[kind]:>15.2f}x" for ours in ours_rows))
    for kind in rows:
        if "memory_train" in med[kind]:
            print(f"  {kind}: train phase peak {med[kind]['memory_train']:.1f} MiB, actor "
                  f"activations {med[kind]['activations']:.1f} MiB (memory accounting)")
    if variant != "fixed":
        print("  mean response tokens per iteration (warm-up first): " + "; ".join(
            f"{kind} " + " ".join(f"{x:.1f}" for x in out["lengths"][kind]) for kind in rows))
    pairs = [(ours, kind) for ours in ours_rows for kind in rows if kind in TRL_ROWS]
    if "megarlhf" in rows and BASELINE in rows:
        pairs.insert(0, ("megarlhf", BASELINE))
    for ours, kind in pairs:
        paired = sorted(a["tokens"] / a["iteration"] / (b["tokens"] / b["iteration"])
                        for a, b in zip(out["rounds"][ours], out["rounds"][kind], strict=True))
        print(f"  {ours} vs {kind}, tokens/s ratio of each round (rows run back to "
              f"back): median {statistics.median(paired):.2f}x, range "
              f"{paired[0]:.2f}-{paired[-1]:.2f}x")
        print(f"  phase speed-up {ours} vs {kind}: " + ", ".join(
            f"{phase} {med[kind][phase] / med[ours][phase]:.2f}x"
            for phase in ("generation", "experience", "training")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["tiny", "small"])
    parser.add_argument("--variants", nargs="+", choices=["fixed", "stop", "longtail"],
                        default=["fixed", "stop"])
    parser.add_argument("--iterations", type=int, default=4, help="measured iterations")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted first iterations")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(DEFAULT_ROWS),
                        help="what runs side by side (the first megarlhf rows are the "
                             "numerators of the ratio columns)")
    parser.add_argument("--batch", type=int, default=BATCH, help="rollout batch")
    parser.add_argument("--response", type=int, default=None,
                        help=f"longest response (default {RESPONSE}; longtail "
                             f"{LONGTAIL_RESPONSE})")
    parser.add_argument("--baseline", default=None,
                        help="another checkout for the 'baseline' row (e.g. a git worktree)")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if BASELINE in args.rows and not args.baseline:
        parser.error("the baseline row needs --baseline DIR")
    def response(variant: str) -> int:
        return args.response or (LONGTAIL_RESPONSE if variant == "longtail" else RESPONSE)

    configure(args.batch, response(args.variant or "fixed"))
    if args.worker in MEGARLHF_ROWS:
        overrides = MEGARLHF_ROWS[args.worker]
        return megarlhf_worker(args.folder, args.variant,
                               packed_overrides() if overrides is None else overrides)
    if args.worker:
        return trl_worker(args.folder, args.variant, args.worker == "trl", args.iterations,
                          bf16=args.worker == "trl-bf16")
    torch.set_num_threads(2)
    print(f"# PPO iteration, megarlhf vs TRL PPOTrainer: batch {BATCH}, prompt {PROMPT}, "
          f"{EPOCHS} epochs x {MINI_BATCHES} mini-batches; "
          f"median of {args.iterations} iterations after {args.warmup} warm-up; {machine()}")
    print("# tokens/s counts prompt + response tokens of the rollout batch per iteration second")
    for size in args.sizes:
        for variant in args.variants:
            configure(args.batch, response(variant))
            folder = tempfile.mkdtemp(prefix=f"ppo_vs_trl_{size}_{variant}_")
            report(size, variant, run_pair(size, variant, args.iterations, args.warmup, folder,
                                           tuple(args.rows), args.baseline))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
