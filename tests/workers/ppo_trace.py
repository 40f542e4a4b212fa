"""PPO iterations traced step by step, for the independent references of
tests/test_ppo_reference.py: ``ppo_trace.py CASES.json OUT_DIR`` (one process).

For every case the worker builds a ``PPOSession`` from its ``config`` (default
configs/demo/ppo.yaml) plus the case's overrides (padded micro-batches,
``ppo.max_tokens_per_micro_batch=null``, unless they set a budget), runs its iterations (the case's ``iterations``, default 1) and writes
``OUT_DIR/<name>.pt``: the tokenized prompts (``prompts``), the run's ``seed`` and, for
each iteration, in ``iterations``:

- ``raw``: the sampler's generation before truncation, ``gen``: the one trained on,
  ``raw_scores``: the reward model's normalised scores before the score rules;
  ``samplings``: every rollout made during the iteration, in order, each with its
  ``raw`` generation and ``raw_scores`` (dynamic sampling's rounds);
  ``ptx_examples``: PPO-ptx's pretraining rows, (tokens, loss weights) each;
  ``kl_coef``: the KL coefficient the iteration started with, ``kl_coef_after`` the one
  the controller left; ``experience``: every field of the experience batch; ``metrics``;
- ``calls``: one entry per ``forward_backward`` call of a trained role, in order - the
  micro-batches it was given, the logs its loss functions returned, and the role's own
  outputs on the same micro-batches at the weights it had just before (``before``) and
  just after the optimizer step that followed (``after``): log-probs and entropy for
  the actor, values for the critic; ``ptx_before`` / ``ptx_after`` the same for PPO-ptx's
  micro-batches (next-token log-probs). These come from the plain forward-only scoring
  step, not from the loss under test;
- ``params``: the actor's and the critic's weights before the iteration and after every
  optimizer step; ``ema``: the EMA actor's averages at the end (when ``ppo.ema_decay``).

The recording only observes: it wraps the two names the PPO stage calls
(``forward_backward``, ``step_together``) and scores with forward-only passes, which
consume no random numbers.
"""

from __future__ import annotations

# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

import dataclasses
import json
import os
import sys

import torch

from megarlhf.config import load_config
from megarlhf.data.tokenizer import load_tokenizer
from megarlhf.engine.schedule import forward_only
from megarlhf.engine.steps import make_sequence_step
from megarlhf.ppo import learner
from megarlhf.ppo.session import PPOSession


def flat(role) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in role.parameters])


def score(role, batches: list[dict], kind: str, prompt_len: int, temperature: float
          ) -> list[dict]:
    """The role's outputs on ``batches`` at its current weights (forward-only)."""
    step = make_sequence_step(kind, prompt_len=prompt_len, tp_group=role.layout.tp_group,
                              true_vocab=role.spec.model.vocab_size, temperature=temperature)
    outs = forward_only(role.chunks, step, batches, layout=role.layout,
                        seq_length=batches[0]["tokens"].shape[1],
                        micro_batch_size=batches[0]["tokens"].shape[0])
    return [{k: v.detach().clone() for k, v in out.items()} for out in outs]


class Tracer:
    """Wraps the PPO stage's ``forward_backward`` and ``step_together`` for one session."""

    def __init__(self, session: PPOSession):
        self.session = session
        self.calls: list[dict] = []
        self.pending: list[dict] = []  # this mini-batch's calls, waiting for the step
        self.params = {"actor": [flat(session.actor)]}
        if session.critic is not None:
            self.params["critic"] = [flat(session.critic)]
        self.real_fb, self.real_step = learner.forward_backward, learner.step_together

    def role_of(self, trained):
        s = self.session
        if trained is s.actor.trained:
            return "actor", s.actor
        assert s.critic is not None and trained is s.critic.trained
        return "critic", s.critic

    def outputs(self, role, name, batches):
        ppo_rows = [b for b in batches if "ptx_loss_mask" not in b]
        P = int(ppo_rows[0]["tokens"].shape[1] - ppo_rows[0]["response_mask"].shape[1])
        kind = "lm" if name == "actor" else "value"
        return score(role, ppo_rows, kind, P, self.session.cfg.rollout.temperature)

    def ptx_outputs(self, role, batches):
        """PPO-ptx's pretraining micro-batches: every next-token log-prob (a "prompt" of
        one token), at temperature 1 as the ptx loss takes them."""
        ptx_rows = [b for b in batches if "ptx_loss_mask" in b]
        return score(role, ptx_rows, "lm", 1, 1.0) if ptx_rows else []

    def forward_backward(self, trained, forward_step, batches, **kw):
        name, role = self.role_of(trained)
        before = self.outputs(role, name, batches)
        ptx_before = self.ptx_outputs(role, batches)
        logs = self.real_fb(trained, forward_step, batches, **kw)
        call = {"role": name, "batches": [dict(b) for b in batches],
                "logs": [{k: float(v) for k, v in entry.items()} for entry in logs],
                "before": before, "ptx_before": ptx_before}
        self.calls.append(call)
        self.pending.append(call)
        return logs

    def step_together(self, trained_roles):
        result = self.real_step(trained_roles)
        for call in self.pending:
            role = self.role_of(self.session.actor.trained if call["role"] == "actor"
                                else self.session.critic.trained)[1]
            call["after"] = self.outputs(role, call["role"], call["batches"])
            call["ptx_after"] = self.ptx_outputs(role, call["batches"])
            call["applied"] = bool(result[0])
        self.pending = []
        for name in self.params:
            self.params[name].append(flat(getattr(self.session, name)))
        return result

    def __enter__(self):
        learner.forward_backward, learner.step_together = self.forward_backward, \
            self.step_together
        return self

    def __exit__(self, *exc):
        learner.forward_backward, learner.step_together = self.real_fb, self.real_step


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    only = [c for c in os.environ.get("MEGARLHF_TRACE_CASES", "").split(",") if c]
    for name, case in cases.items():
        if only and name not in only:
            continue
        # padded micro-batches unless the case packs: the references read padded rows
        # (tests/test_packing.py holds the packed passes to the padded ones)
        padded = [] if any("max_tokens_per_micro_batch" in o for o in case["overrides"]) \
            else ["ppo.max_tokens_per_micro_batch=null"]
        cfg = load_config(case.get("config", "configs/demo/ppo.yaml"),
                          padded + case["overrides"])
        tokenizer = load_tokenizer(cfg.tokenizer)
        session = PPOSession(cfg, tokenizer)
        sampler, scorer = session.sampler, session.scorer
        raw: dict = {}  # batch -> the sampler's generation (the rollout seed is seed + batch)
        order: list = []  # the batches in the order they were sampled, each then scored
        raw_scores: list = []
        every: list = []  # every rollout's generation in order (dynamic sampling's rounds)
        real_rollout, real_scores = sampler.rollout, scorer.reward_scores

        def rollout(prompts, seed):
            gen, metrics = real_rollout(prompts, seed)
            raw[seed - cfg.run.seed] = gen
            order.append(seed - cfg.run.seed)
            every.append(dataclasses.asdict(gen))
            return gen, metrics

        def scores(gen):
            out = real_scores(gen)
            raw_scores.append(out.clone())
            return out

        # observe the sampler's output before truncation, and the reward model's scores
        # before the missing-stop rule and the overlong ramp
        sampler.rollout, scorer.reward_scores = rollout, scores
        iterations = []
        for it in range(case.get("iterations", 1)):
            kl_coef = session.kl_ctl.value
            first = len(every)
            with Tracer(session) as tracer:
                metrics, exp, gen = session.iteration(it)
            assert len(order) == len(set(order)), "a batch sampled twice: trace it apart"
            batch_raw = raw[it]
            iterations.append({
                "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id, "kl_coef": kl_coef,
                "raw": dataclasses.asdict(batch_raw),
                "raw_scores": raw_scores[order.index(it)],
                "gen": dataclasses.asdict(gen), "metrics": metrics,
                "experience": {f.name: getattr(exp, f.name) for f in dataclasses.fields(exp)},
                "calls": tracer.calls, "params": tracer.params,
                "kl_coef_after": session.kl_ctl.value,
                "samplings": [{"raw": g, "raw_scores": sc} for g, sc in
                              zip(every[first:], raw_scores[first:], strict=True)],
            })
            if session.ptx is not None:
                iterations[-1]["ptx_examples"] = session.ptx.examples
            if session.ema is not None:
                iterations[-1]["ema"] = torch.cat([a.reshape(-1) for a in session.ema.shadow])
        session.close()
        torch.save({"iterations": iterations, "prompts": session.prompts.prompts,
                    "seed": cfg.run.seed},
                   os.path.join(out_dir, f"{name}.pt"))


if __name__ == "__main__":
    main()
