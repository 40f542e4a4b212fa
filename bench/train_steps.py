"""Where the PPO training phase goes, per step: megarlhf alone on ppo_vs_trl.py's shape
(same checkpoints and overrides), the median wall time of each role's forward/backward
micro-batch pass and of the joint optimizer step, over a few iterations.

    .venv/bin/python bench/train_steps.py [--size small] [--iterations 3] [--hf]

``--hf``: after each megarlhf iteration, as many steps of transformers models loaded from
the same checkpoints (what TRL trains), on one mini-batch of the same shape: the policy's
forward/backward with TRL's loss inputs (logits at the response positions, their log-probs
and, without gradient, their entropy), the value model's (TRL's
``AutoModelForSequenceClassification`` backbone and score head), and torch's AdamW step,
as TRL's PPOTrainer takes them. TRL's loss arithmetic itself (a
few (B, T) operations) is left out, so these are a floor of TRL's steps. TRL does not clip
gradients in PPO; its optimizer is transformers' default (fused AdamW, eps 1e-8).

Medians over many steps are steadier on this noisy VM than a phase total. To compare two
checkouts, run each with its own tree first on the path, alternating (BENCHMARKS.md):

    PYTHONPATH=/tmp/before .venv/bin/python /tmp/before/bench/train_steps.py --size tiny
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_vs_trl as pv  # noqa: E402
from common import SIZES, machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations")
    parser.add_argument("--hf", action="store_true",
                        help="also time transformers' steps of the same shape, interleaved")
    args = parser.parse_args()
    torch.set_num_threads(2)

    from megarlhf.config import load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.ppo import learner, session as ppo_session

    folder = tempfile.mkdtemp(prefix=f"train_steps_{args.size}_")
    pv.prepare(args.size, "fixed", folder)
    cfg = load_config(os.path.join(folder, "policy_mrl/config.yaml"),
                      pv.megarlhf_overrides(folder, "fixed"))
    session = ppo_session.PPOSession(cfg, load_tokenizer(cfg.tokenizer))
    times = collections.defaultdict(list)

    def timed(name_of, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            times[name_of(*a)].append(time.perf_counter() - start)
            return out
        return wrapper

    names = {id(session.actor.trained): "actor forward/backward",
             id(session.critic.trained): "critic forward/backward"}
    learner.forward_backward = timed(lambda role, *_: names[id(role)], learner.forward_backward)
    learner.step_together = timed(lambda *_: "optimizer step (both)", learner.step_together)
    hf_step = _hf_steps(folder, times) if args.hf else None
    steps = cfg.ppo.ppo_epochs * (pv.BATCH // cfg.ppo.mini_batch_size)
    session.iteration(0)  # warm-up
    for _ in range(2 if hf_step else 0):
        hf_step()
    times.clear()
    train = []
    for it in range(1, 1 + args.iterations):
        train.append(session.iteration(it)[0]["timing/train"])
        for _ in range(steps if hf_step else 0):
            hf_step()
    print(f"# megarlhf PPO training steps, {args.size}/fixed, ppo_vs_trl.py's shape; {machine()}")
    print(f"training phase per iteration (s): {', '.join(f'{t:.3f}' for t in train)}")
    for name, values in times.items():
        print(f"{name:>24}: {len(values)} calls, median {statistics.median(values) * 1e3:.1f} ms, "
              f"{sum(values) / args.iterations * 1e3:.0f} ms per iteration")
    session.close()


def _hf_steps(folder: str, times: dict):
    """One TRL-shaped training step of transformers' policy and value models, timed into
    ``times`` by part."""
    import transformers

    policy = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(folder, "policy_hf"), attn_implementation="sdpa")
    value = transformers.AutoModelForSequenceClassification.from_pretrained(
        os.path.join(folder, "reward_hf"), attn_implementation="sdpa")
    params = list(policy.parameters()) + list(value.parameters())
    optimizer = torch.optim.AdamW(params, lr=pv.LR, eps=1e-8, fused=True)
    rows, width = pv.BATCH // pv.MINI_BATCHES, pv.PROMPT + pv.RESPONSE
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, policy.config.vocab_size, (rows, width), generator=gen)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[: rows // 2, : pv.PROMPT // 4] = 0  # left padding, as short prompts have
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    response = tokens[:, pv.PROMPT:]

    def step() -> None:
        start = time.perf_counter()
        logits = policy(input_ids=tokens, attention_mask=mask, position_ids=positions,
                        return_dict=True).logits[:, pv.PROMPT - 1:-1]
        logprobs = torch.gather(logits.log_softmax(-1), 2, response.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            (torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)).mean()
        (-logprobs.mean()).backward()
        middle = time.perf_counter()
        hidden = value.model(input_ids=tokens, attention_mask=mask,
                             position_ids=positions).last_hidden_state
        values = value.score(hidden).squeeze(-1)[:, pv.PROMPT - 1:-1]
        (values ** 2).mean().backward()
        end = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        times["hf policy forward/backward"].append(middle - start)
        times["hf value forward/backward"].append(end - middle)
        times["hf optimizer step (both)"].append(time.perf_counter() - end)

    return step


if __name__ == "__main__":
    main()
