"""The rollout batch and the batch arithmetic of a PPO iteration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def exact_div(numerator: int, denominator: int, what_num: str, what_den: str) -> int:
    """``numerator // denominator``, raising when it does not divide exactly."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{what_num} ({numerator}) is not divisible by {what_den} "
                         f"({denominator})")
    return numerator // denominator


@dataclass(frozen=True)
class BatchSizes:
    """rollout batch -> mini-batch -> micro-batch, for one trained role's data-parallel
    size (actor and critic each have their own).

    ``rollout_batch_size`` counts prompts; each prompt gets ``group_size`` responses, so a
    rollout holds ``rollout_batch_size * group_size`` samples, all of them on every rank.
    ``mini_batch_size`` (samples per optimizer step) is global and split over the role's
    data-parallel ranks; ``micro_batch_size`` is per data-parallel rank. Packed
    (``max_tokens`` per micro-batch), the ranks' shares and micro-batches follow the
    samples' lengths: a mini-batch needs only a sample for every rank.
    """

    rollout_batch_size: int
    mini_batch_size: int
    micro_batch_size: int
    dp_size: int
    group_size: int = 1
    max_tokens: int | None = None

    @property
    def samples(self) -> int:
        return self.rollout_batch_size * self.group_size

    @property
    def num_mini_batches(self) -> int:
        return exact_div(self.samples, self.mini_batch_size,
                         "rollout samples (ppo.rollout_batch_size x ppo.group_size)",
                         "ppo.mini_batch_size")

    @property
    def mini_batch_per_rank(self) -> int:
        return exact_div(self.mini_batch_size, self.dp_size, "ppo.mini_batch_size",
                         "the data-parallel size")

    @property
    def micro_batches_per_mini_batch(self) -> int:
        return exact_div(self.mini_batch_per_rank, self.micro_batch_size,
                         "ppo.mini_batch_size per data-parallel rank",
                         "ppo.micro_batch_size")

    def validate(self) -> "BatchSizes":
        """Touch every derived size so a bad combination raises now."""
        _ = self.num_mini_batches
        if self.max_tokens is None:
            _ = self.micro_batches_per_mini_batch
        elif self.mini_batch_size < self.dp_size:
            raise ValueError(f"ppo.mini_batch_size ({self.mini_batch_size}) is below the "
                             f"data-parallel size ({self.dp_size}): a rank would get no "
                             "samples")
        return self

    def most_packed_micro_batches(self, longest: int) -> int:
        """Packed: the micro-batches of a mini-batch on the rank with the most tokens, every
        sample ``longest`` tokens long (its share of the mini-batch rounded up)."""
        per_rank = -(-self.mini_batch_size // self.dp_size)
        return -(-per_rank * longest // self.max_tokens)

    def describe(self) -> str:
        if self.max_tokens is not None:
            return (f"rollout {self.rollout_batch_size} prompts x {self.group_size} = "
                    f"{self.samples} samples; {self.num_mini_batches} mini-batches of "
                    f"{self.mini_batch_size} shared by {self.dp_size} rank(s) by token count, "
                    f"packed micro-batches of at most {self.max_tokens} tokens")
        return (f"rollout {self.rollout_batch_size} prompts x {self.group_size} = "
                f"{self.samples} samples; {self.num_mini_batches} mini-batches of "
                f"{self.mini_batch_size} ({self.mini_batch_per_rank} per rank = "
                f"{self.micro_batches_per_mini_batch} micro-batches of "
                f"{self.micro_batch_size})")


@dataclass
class Experience:
    """One rollout batch on one data-parallel rank, computed once per iteration.

    B samples; prompts are left-padded to P columns, responses right-padded to T columns,
    so response token t of every sample sits at column P + t of the full sequence and its
    log-prob is read from the logits at column P + t - 1.
    """

    # tokens and masks
    prompt_tokens_BP: torch.Tensor  # left-padded prompt ids
    prompt_mask_BP: torch.Tensor  # 1 on real prompt tokens
    response_tokens_BT: torch.Tensor  # right-padded response ids
    response_mask_BT: torch.Tensor  # 1 on real response tokens (stop token included)
    # log-probs of the response tokens
    rollout_logprobs_BT: torch.Tensor  # from the sampler (inference layout)
    old_logprobs_BT: torch.Tensor  # behaviour policy used in the PPO ratio
    ref_logprobs_BT: torch.Tensor  # reference (SFT) model
    # critic
    values_BT: torch.Tensor
    # rewards
    scores_B: torch.Tensor  # reward-model (or programmatic) score per sample
    kl_BT: torch.Tensor  # per-token KL estimate to the reference
    rewards_BT: torch.Tensor  # KL-shaped per-token rewards
    # learning targets
    advantages_BT: torch.Tensor
    returns_BT: torch.Tensor
    # the policy loss's view (rollout/training mismatch correction); default: every
    # response token, weight 1
    policy_mask_BT: torch.Tensor | None = None  # response mask minus rejected samples
    is_weights_BT: torch.Tensor | None = None  # truncated importance weights
    # a mixture of experts' routing replayed in the updates (rollout.routing_replay: r3 the
    # rollout's, r2 the old-log-prob pass's): rows, layers, the P + T columns, top_k
    routing_BLSK: torch.Tensor | None = None
    # the policy version that sampled each response token (ppo.max_staleness), 0 on padding
    versions_BT: torch.Tensor | None = None
    # multi-turn rollouts: 1 on every response token the passes feed - the model's and the
    # environment's (response_mask_BT, the trained tokens, has gaps there); None: the
    # response mask is both
    fed_mask_BT: torch.Tensor | None = None
    # on-policy distillation (ppo.teacher): the teacher's log-probs of the sampled tokens
    # and the per-token reverse KL to it, k1 (log p_old - log p_teacher); None without one
    teacher_logprobs_BT: torch.Tensor | None = None
    teacher_kl_BT: torch.Tensor | None = None

    @property
    def fed_BT(self) -> torch.Tensor:
        """1 on the response tokens a pass over these samples feeds."""
        return self.response_mask_BT if self.fed_mask_BT is None else self.fed_mask_BT

    def __post_init__(self):
        if self.policy_mask_BT is None:
            self.policy_mask_BT = self.response_mask_BT.float().clone()
        if self.is_weights_BT is None:
            self.is_weights_BT = torch.ones(self.response_mask_BT.shape)
        B, T = self.response_tokens_BT.shape
        P = self.prompt_tokens_BP.shape[1]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:  # routing_BLSK of a dense actor, or without replay
                continue
            suffix = f.name.rsplit("_", 1)[-1]
            expect = (B, *value.shape[1:2], P + T, *value.shape[-1:]) if suffix == "BLSK" \
                else {"BT": (B, T), "B": (B,), "BP": (B, P)}[suffix]
            if tuple(value.shape) != expect:
                raise ValueError(f"Experience.{f.name} has shape {tuple(value.shape)}, "
                                 f"expected {expect}")

    def __len__(self) -> int:
        return self.response_tokens_BT.shape[0]

    def rows(self, start: int, stop: int) -> "Experience":
        """Samples ``start .. stop - 1``; all of them is the batch itself (nothing writes
        to an experience batch)."""
        if start == 0 and stop == len(self):
            return self
        return self.select(list(range(start, stop)))

    def select(self, index: torch.Tensor | list[int]) -> "Experience":
        index = torch.as_tensor(index, dtype=torch.long)
        return Experience(**{f.name: None if getattr(self, f.name) is None
                             else getattr(self, f.name)[index] for f in dataclasses.fields(self)})

    def mini_batches(self, size: int, generator: torch.Generator | None = None):
        """Shuffled mini-batches of ``size`` samples (the last full one included)."""
        exact_div(len(self), size, "samples on this rank", "the mini-batch size per rank")
        order = torch.randperm(len(self), generator=generator)
        for start in range(0, len(self), size):
            yield self.select(order[start:start + size])

    def micro_batches(self, size: int):
        exact_div(len(self), size, "samples in the mini-batch", "ppo.micro_batch_size")
        for start in range(0, len(self), size):
            yield self.rows(start, start + size)
