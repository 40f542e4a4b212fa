"""A judge model as the reward (``rollout.judge``, the frozen role ``roles.judge``).

Each sample's decoded prompt and response fill ``rollout.judge.template``; the text is the
user's message of the chat template (``rollout.judge.chat``) or the prompt as it is. The
judge - any size, the run's tokenizer - answers every sample of the batch greedily, at its
own layout: TP ``roles.judge.parallel.tensor_model_parallel_size``, the rest of the world
data-parallel replicas, each answering its share in one batch; every rank then has every
verdict. The first group of ``rollout.judge.pattern`` at its last match in the verdict is
the score (a number, or a key of ``rollout.judge.labels``).

A verdict that does not parse, or a judge prompt with no room for a verdict in the judge's
positions, is a **failed reward call** under ``rollout.rewards.on_error``, as a reward
function's: ``stop`` ends the run naming the sample and the verdict, ``penalty`` scores it
``rollout.rewards.error_score`` and counts it in ``reward/failed``. Every rank reads the
same verdicts, so every rank decides alike.

The first ``rollout.judge.log_verdicts`` samples of every batch go to the run's
``judge_verdicts.jsonl`` (rank 0), so the judge can be read at work.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch

from megarlhf.config import JudgeConfig, RewardsConfig
from megarlhf.inference.generate import SamplingParams, generate
from megarlhf.rewards.verifiers import Failure, Pair, Verifier
from megarlhf.roles.build import Role
from megarlhf.roles.offload import Offloader
from megarlhf.rollout.sampling import decode_sample, gather_generations

VERDICTS_FILE = "judge_verdicts.jsonl"


class JudgeSource:
    """The judge as a reward source: ``map(pairs)`` -> a score or a failure per pair. A
    collective: every rank of the world calls it with the same pairs."""

    def __init__(self, cfg: JudgeConfig, role: Role, tokenizer, *, eos_id: int, pad_id: int,
                 end_ids: tuple[int, ...] = (), log_dir: str | None = None,
                 add_bos: bool = False):
        self.role, self.tokenizer = role, tokenizer
        self.text, self.chat, self.labels = cfg.template, cfg.chat, cfg.labels
        self.max_new_tokens, self.log_verdicts = cfg.max_new_tokens, cfg.log_verdicts
        self.pattern_text = cfg.pattern
        self.add_bos = add_bos  # a text prompt's BOS (tokenizer.add_bos); a chat template
        # writes its own
        self.eos_id, self.pad_id = eos_id, pad_id
        self.template = getattr(tokenizer, "chat_template", None)
        if cfg.chat and self.template is None:
            raise ValueError("rollout.judge.chat renders the judge's prompt with the chat "
                             "template, but the tokenizer has none (set "
                             "tokenizer.chat_template, or rollout.judge.chat=false)")
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, greedy=True,
                                     stop_token_ids=tuple(end_ids), stop_at_eos=True)
        self.pattern = re.compile(cfg.pattern)
        self.room = role.spec.model.max_position_embeddings - cfg.max_new_tokens
        self.offloader = Offloader(role.chunks, role.spec.offload == "all")
        self.offloader.offload()
        self.log_path = os.path.join(log_dir, VERDICTS_FILE) if log_dir else None
        self.calls = 0

    def prompt(self, prompt: str, response: str) -> list[int]:
        """The judge's prompt for one sample, as tokens."""
        text = self.text.replace("{prompt}", prompt).replace("{response}", response)
        if self.chat:
            return self.tokenizer.encode(self.template.render(
                [{"role": "user", "content": text}], add_generation_prompt=True))
        return self.tokenizer.encode(text, add_bos=self.add_bos)

    def read(self, verdict: str) -> float | Failure:
        """The score in a verdict, or why there is none."""
        matches = list(self.pattern.finditer(verdict))
        if not matches:
            return Failure("error", f"the judge's verdict {verdict[:120]!r} does not match "
                                    f"rollout.judge.pattern={self.pattern_text!r}")
        word = matches[-1].group(1)
        if self.labels is not None:
            if word not in self.labels:
                return Failure("error", f"the judge's verdict {verdict[:120]!r} gives "
                                        f"{word!r}, which is not one of rollout.judge.labels "
                                        f"({', '.join(self.labels)})")
            return float(self.labels[word])
        try:
            value = float(word)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            return Failure("error", f"the judge's verdict {verdict[:120]!r} gives {word!r}, "
                                    "which is not a finite number")
        return value

    @torch.no_grad()
    def map(self, pairs: list[Pair]) -> list[float | Failure]:
        prompts = [self.prompt(p, r) for p, r in pairs]
        fits = [len(t) <= self.room for t in prompts]
        # a judge prompt with no room for its verdict is answered with nothing (one token
        # fed) and fails below
        feed = [t if ok else t[:1] for t, ok in zip(prompts, fits)]
        layout = self.role.layout
        mine = list(layout.run_share(len(feed)))
        model = self.role.chunks[0]
        self.offloader.reload()
        gen = generate(model, [feed[i] for i in mine], self.params, eos_id=self.eos_id,
                       pad_id=self.pad_id, true_vocab=self.role.spec.model.vocab_size,
                       row_seeds=[0] * len(mine), stats={})
        self.offloader.offload()
        gen = gather_generations(gen, feed, layout, self.pad_id)
        verdicts = [decode_sample(gen, i, self.tokenizer.decode)[1] for i in range(len(feed))]
        out = []
        for tokens, ok, verdict in zip(prompts, fits, verdicts):
            out.append(self.read(verdict) if ok else Failure(
                "error", f"the judge's prompt is {len(tokens)} tokens: with "
                         f"rollout.judge.max_new_tokens={self.max_new_tokens} it passes "
                         f"the judge's max_position_embeddings="
                         f"{self.role.spec.model.max_position_embeddings}"))
        self._log(pairs, verdicts, out)
        self.calls += 1
        return out

    def _log(self, pairs: list[Pair], verdicts: list[str], values: list) -> None:
        """The first rollout.judge.log_verdicts verdicts, appended on rank 0."""
        import torch.distributed as dist

        if self.log_path is None or not self.log_verdicts or dist.get_rank() != 0:
            return
        with open(self.log_path, "a") as f:
            for i, ((prompt, response), verdict, value) in enumerate(
                    zip(pairs[:self.log_verdicts], verdicts, values)):
                failed = isinstance(value, Failure)
                f.write(json.dumps({"call": self.calls, "sample": i, "prompt": prompt,
                                    "response": response, "verdict": verdict,
                                    "score": None if failed else value,
                                    "error": value.message if failed else None}) + "\n")

    def close(self) -> None:
        pass


def make_judge(cfg: JudgeConfig, rewards: RewardsConfig, role: Role, tokenizer, *,
               log_dir: str | None, add_bos: bool) -> Verifier:
    """The judge under the run's failure rules (``rollout.rewards.on_error``)."""
    source = JudgeSource(cfg, role, tokenizer, eos_id=tokenizer.eos_id,
                         pad_id=tokenizer.pad_id, end_ids=tokenizer.end_ids, log_dir=log_dir,
                         add_bos=add_bos)
    return Verifier(f"the judge (roles.judge.checkpoint={role.spec.checkpoint})", source,
                    rewards.on_error, rewards.error_score)
