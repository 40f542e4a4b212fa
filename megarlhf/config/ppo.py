"""PPO and its relatives: ``ppo`` (the algorithm) and ``rollout`` (generation, the
inference layout and the experience passes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarlhf.config.fields import require


@dataclass(kw_only=True, frozen=True)
class KLConfig:
    """``ppo.kl``: the KL to the reference model (these were ``ppo.kl_estimator``,
    ``ppo.kl_in_reward``, ``ppo.kl_loss_coef``, ``ppo.kl_loss_estimator``,
    ``ppo.kl_controller``, ``ppo.init_kl_coef``, ``ppo.kl_target`` and ``ppo.kl_horizon``;
    those names still load)."""

    estimator: Literal["k1", "k2", "k3", "abs"] = "k1"
    """Per-token KL estimator in the shaped reward (and the reported objective/kl)."""
    in_reward: bool | None = None
    """Subtract beta x KL to the reference from the reward (beta: init_coef, then the
    controller): per token for gae and reinforce_pp; summed over the response and taken off
    the score before the group baseline for rloo and grpo (TRL's RLOO). None: on for gae,
    reinforce_pp and rloo, off for grpo (which regularises with loss_coef instead)."""
    loss_coef: float = 0.0
    """Weight of a KL-to-reference term in the actor's loss (DeepSeekMath's GRPO: 0.04;
    0.001 is common); 0 disables. Works with every estimator."""
    loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of the loss term (k3: DeepSeekMath; k2's gradient is the true KL's)."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """KL coefficient controller of the reward's KL (Ziegler et al. 2019)."""
    init_coef: float = 0.05
    """Initial beta."""
    target: float = 6.0
    """Adaptive controller target KL (per sequence)."""
    horizon: int = 10000
    """Adaptive controller horizon."""

    def __post_init__(self):
        require(self.horizon >= 1, "ppo.kl.horizon", self.horizon, "must be >= 1")
        require(self.init_coef >= 0, "ppo.kl.init_coef", self.init_coef, "must be >= 0")
        require(self.target > 0, "ppo.kl.target", self.target, "must be > 0")
        require(self.loss_coef >= 0, "ppo.kl.loss_coef", self.loss_coef, "must be >= 0")


@dataclass(kw_only=True, frozen=True)
class TeacherConfig:
    """``ppo.teacher``: on-policy distillation. A frozen teacher (``roles.teacher``: its own
    checkpoint - any size, the actor's tokenizer -, model, layout and offload) scores every
    token the student (the actor) sampled, and the student is pulled towards it by the
    per-token reverse KL, KL(student || teacher), estimated at the sampled token: k1 =
    log p_student - log p_teacher (the student's old log-probs)."""

    coef: float = 0.0
    """Weight of the reverse KL to the teacher; 0: no teacher."""
    kl_in: Literal["reward", "loss"] = "reward"
    """reward: -coef x k1 joins the rewards, per token for gae and reinforce_pp and summed
    over the response off the score for rloo and grpo (as the reference's KL does). With
    reinforce_pp and ppo.gamma=0 each token's return is its own KL to the teacher; with
    gamma 1 it is the KL still to come, which also favours shorter responses. loss: coef x
    the loss_estimator's KL of the current student to the teacher joins the actor's loss
    (on the sampled tokens)."""
    loss_estimator: Literal["k1", "k2", "k3"] = "k2"
    """kl_in=loss: the estimator (k2's gradient is the true reverse KL's)."""
    task_reward: bool = True
    """Keep the task's reward (the reward model or function) with the teacher's KL; false:
    the teacher alone teaches (pure distillation: every score 0, no reward source)."""

    def __post_init__(self):
        require(self.coef >= 0, "ppo.teacher.coef", self.coef, "must be >= 0 (0: no teacher)")

    @property
    def enabled(self) -> bool:
        return self.coef > 0


@dataclass(kw_only=True, frozen=True)
class CorrectionConfig:
    """``ppo.correction``: weights and masks for tokens sampled by another policy than the
    one trained (these were ``ppo.behavior_weight_cap``, ``ppo.rollout_is_cap``,
    ``ppo.rollout_mask_low`` and ``ppo.rollout_mask_high``; those names still load)."""

    behavior_weight_cap: float | None = None
    """Decoupled loss: drop tokens whose behaviour importance weight exceeds this (AReaL
    uses 5); None keeps every token."""
    is_cap: float | None = None
    """Rollout/training mismatch correction: weight each token's policy loss by the
    truncated importance ratio min(p_train / p_rollout, cap) (truncated IS; ~2 is usual);
    None disables. Needs rollout.recompute_logprobs=true."""
    mask_low: float | None = None
    """Mismatch correction: drop from the policy loss every sample whose per-token
    geometric-mean ratio p_train / p_rollout is below this (e.g. 0.5); None: no lower bound."""
    mask_high: float | None = None
    """Mismatch correction: drop every sample whose geometric-mean ratio is above this
    (e.g. 2); None: no upper bound."""

    def __post_init__(self):
        if self.behavior_weight_cap is not None:
            require(self.behavior_weight_cap > 1, "ppo.correction.behavior_weight_cap",
                    self.behavior_weight_cap, "must be > 1 or null")
        if self.is_cap is not None:
            require(self.is_cap >= 1, "ppo.correction.is_cap", self.is_cap,
                    "must be >= 1 or null")
        if self.mask_low is not None:
            require(0 < self.mask_low < 1, "ppo.correction.mask_low", self.mask_low,
                    "must be in (0, 1) or null")
        if self.mask_high is not None:
            require(self.mask_high > 1, "ppo.correction.mask_high", self.mask_high,
                    "must be > 1 or null")


@dataclass(kw_only=True, frozen=True)
class PlacementConfig:
    """``rollout.placement``: where sampling runs (these were ``rollout.placement``,
    ``rollout.ranks``, ``rollout.weight_checksum``, ``rollout.partial`` and
    ``rollout.partial_kv``; those names still load, and ``rollout.placement: split`` is
    short for ``rollout.placement.mode: split``)."""

    mode: Literal["colocated", "split"] = "colocated"
    """colocated: every process samples, then scores, then trains. split: the last
    ranks processes of the job only sample (the actor at the rollout layout, its weights
    sent by the training processes after each update, versioned); the others hold the
    actor, critic, reference and reward model and do the rest. With ppo.max_staleness
    k >= 1 the rollout ranks sample batch i + k while the training ranks train batch i;
    the schedule is the same as colocated, so are the results. One torchrun or Slurm job."""
    ranks: int | None = None
    """mode=split: the processes that sample (the job's last ones); a multiple of
    rollout.tensor_parallel_size. Unset otherwise."""
    weight_checksum: bool = False
    """mode=split: after every weight sync each rollout rank compares a SHA-256 of the
    weights it now holds with the sender's, and stops the run on a mismatch (a pass over
    the weights on both sides)."""
    partial: bool = False
    """Partial rollouts (mode=split, ppo.max_staleness >= 1): the weights of each update
    are sent to the rollout ranks as soon as it ends, also while they are sampling a batch;
    they take them between two decode steps and sample the rest of the batch with them.
    Each token keeps the version that sampled it and its behaviour log-prob (the decoupled
    loss weighs each by its own). Fresher tokens, but which token a version samples then
    depends on timing: a run is not a fixed function of its seed, and a resume does not
    repeat the uninterrupted run. rollout/partial_tokens: the share of a batch's tokens
    sampled after such an update."""
    sync_timeout_minutes: float = 10.0
    """mode=split: a weight sync - the training side resharding and sending the actor, a
    rollout rank receiving it - that lasts longer than this ends the job on the side that
    waits, with the watchdog's message naming the phase and the other side's ranks (exit
    75, ``STALLED`` left: under slurm/launch.sh the job requeues and resumes from the last
    checkpoint). Size it above the weights' bytes over the bridge's bandwidth; a peer
    that stops altogether is the watchdog's (parallel.timeout_minutes) in any case."""
    request_timeout_minutes: float | None = None
    """mode=split: the training side's wait for a request's samples (their generation
    included) that lasts longer than this ends the job the same way. None: only
    parallel.timeout_minutes, the bridge's collective timeout, bounds it."""
    partial_kv: Literal["recompute", "keep"] = "recompute"
    """partial: the keys and values of the columns already fed when new weights arrive.
    recompute: the new weights compute them again (one prefill of the batch, so a token
    after the update has the new policy's probability given its prefix); keep: the old
    weights' stay (no extra pass; the tokens that follow come from neither policy)."""

    def __post_init__(self):
        require(self.sync_timeout_minutes > 0, "rollout.placement.sync_timeout_minutes",
                self.sync_timeout_minutes, "must be > 0")
        require(self.request_timeout_minutes is None or self.request_timeout_minutes > 0,
                "rollout.placement.request_timeout_minutes", self.request_timeout_minutes,
                "must be > 0, or null")
        if self.mode == "split":
            require(self.ranks is not None and self.ranks >= 1, "rollout.placement.ranks",
                    self.ranks, "must be >= 1 with rollout.placement.mode=split (the "
                    "processes that sample)")
        else:
            require(self.ranks is None and not self.weight_checksum and not self.partial,
                    "rollout.placement.mode", self.mode,
                    "has no rollout ranks: rollout.placement.ranks, "
                    "rollout.placement.weight_checksum and rollout.placement.partial apply "
                    "to rollout.placement.mode=split only")


@dataclass(kw_only=True, frozen=True)
class RewardsConfig:
    """``rollout.rewards``: user code and servers that score samples (these were
    ``rollout.reward_fn``, ``rollout.reward_url``, ``rollout.reward_workers``,
    ``rollout.reward_timeout_s``, ``rollout.reward_batch``, ``rollout.reward_retries``,
    ``rollout.reward_on_error`` and ``rollout.reward_error_score``; those names still
    load)."""

    fn: str | None = None
    """Programmatic reward 'package.module:function(prompt_text, response_text) -> float'
    (decoded text, the response without its stop token) used instead of a reward model;
    None uses the reward model."""
    url: str | None = None
    """A reward server instead of a reward model: batches of samples are POSTed as JSON
    {"prompts": [...], "responses": [...]} (decoded text, as fn gets them) and answered
    with {"rewards": [a number per sample]} (docs/ppo.md)."""
    workers: int = 2
    """Processes that run fn, an environment and the gold functions of evaluation, so a
    call that hangs or crashes cannot take the trainer down; 0 calls them in the trainer's
    process (no timeout)."""
    timeout_s: float = 60.0
    """Seconds one fn call (in a worker process) or one url request may take before it
    counts as failed (a worker is then killed and replaced)."""
    batch: int = 16
    """Samples per message to a worker process or per url request."""
    retries: int = 3
    """url: tries after the first failed request of a batch (refused, HTTP error,
    timeout, malformed answer), waiting 0.5 s, 1 s, 2 s... in between."""
    on_error: Literal["stop", "penalty"] = "stop"
    """A reward call that failed (timed out, raised, its process died, the server stayed
    down, or it gave something other than a finite number): stop the run, naming the
    function or URL and the sample (the last checkpoint is intact; the same command
    resumes), or score the sample error_score and count it (reward/failed,
    reward/timeouts). A url that fails every request of a batch stops the run either way
    (the server is down)."""
    error_score: float = -1.0
    """on_error=penalty: the score of a sample whose reward call failed."""

    def __post_init__(self):
        require(self.workers >= 0, "rollout.rewards.workers", self.workers,
                "must be >= 0 (0: in the trainer's process)")
        require(self.timeout_s > 0, "rollout.rewards.timeout_s", self.timeout_s, "must be > 0")
        require(self.batch >= 1, "rollout.rewards.batch", self.batch, "must be >= 1")
        require(self.retries >= 0, "rollout.rewards.retries", self.retries, "must be >= 0")
        if self.url is not None:
            require(self.url.startswith(("http://", "https://")), "rollout.rewards.url",
                    self.url, "must be an http:// or https:// URL")
            require(self.fn is None, "rollout.rewards.url", self.url,
                    "and rollout.rewards.fn are two reward sources: choose one")


@dataclass(kw_only=True, frozen=True)
class EnvironmentConfig:
    """``rollout.environment``: multi-turn episodes (these were ``rollout.environment``,
    ``rollout.max_turns``, ``rollout.max_observation_tokens`` and ``rollout.tool_format``;
    those names still load, and ``rollout.environment: pkg.mod:Name`` is short for
    ``rollout.environment.name: pkg.mod:Name``)."""

    name: str | None = None
    """Multi-turn rollouts: an environment 'package.module:Name' (one made per episode) with
    reset(row) -> first messages and step(turn) -> (observation messages, reward, done).
    Episodes are kept as tokens (the model's as sampled, observations as the chat template
    renders them), trained on the model's tokens only; the environment's rewards are the
    reward (no reward model or rollout.rewards.fn). It runs in rollout.rewards.workers
    processes with rollout.rewards.timeout_s per call and rollout.rewards.on_error for a
    failed call (docs/multi-turn.md). None: single-turn sampling."""
    max_turns: int = 4
    """Model turns per episode at most (each up to rollout.max_new_tokens)."""
    max_observation_tokens: int | None = None
    """The tokens an episode's observations may add in all (the template's text around
    them included); an observation past it ends the episode. None: only data.max_seq_len
    bounds an episode."""
    tool_format: Literal["hermes", "llama3_json"] | None = None
    """How the model writes tool calls (hermes: Qwen / Hermes <tool_call> JSON blocks;
    llama3_json: Llama 3.1+ JSON calls); the environment gets them parsed in
    turn["tool_calls"], and a call that does not parse is answered with an error
    observation. None: turns are text only."""

    def __post_init__(self):
        require(self.max_turns >= 1, "rollout.environment.max_turns", self.max_turns,
                "must be >= 1")
        require(self.max_observation_tokens is None or self.max_observation_tokens >= 1,
                "rollout.environment.max_observation_tokens", self.max_observation_tokens,
                "must be >= 1, or null")
        if self.name is not None:
            require(":" in self.name, "rollout.environment.name", self.name,
                    "must look like 'package.module:Name'")


@dataclass(kw_only=True, frozen=True)
class AgentConfig:
    """``rollout.agent``: episodes played by an agent program through an OpenAI-compatible
    endpoint the rollout serves on loopback (docs/agents.md)."""

    entry: str | None = None
    """An agent as a Python function 'package.module:function(row, *, base_url, api_key,
    model) -> reward or None', run in a process of its own per episode: it plays the data
    row's episode by calling the OpenAI API at base_url (the official client, or any HTTP
    client) and returns the episode's reward (None: rollout.rewards.fn or url scores it)."""
    command: str | None = None
    """An agent as a program, run per episode (split as a shell would split it, not run by
    a shell) with OPENAI_BASE_URL, OPENAI_API_KEY, MEGARLHF_AGENT_MODEL and
    MEGARLHF_AGENT_ROW (the row as JSON; also on its stdin) in its environment; the last
    line it prints is the reward (a JSON number, or null for rollout.rewards.fn / url)."""
    model_name: str = "policy"
    """The model name the endpoint serves (a request for another gets 404,
    model_not_found)."""
    max_requests: int = 4
    """Model requests per episode at most (as rollout.environment.max_turns counts turns);
    the next one is answered with an error and the episode keeps what it has."""
    tool_format: Literal["hermes", "llama3_json"] | None = None
    """How the model writes tool calls: a chat reply's calls are parsed from its text and
    returned as the API's tool_calls (a call that does not parse comes back as text and
    counts in rollout/tool_call_errors). None: replies are text only."""
    batch_wait_s: float = 0.05
    """How long a request waits for the other agents' requests to batch with when some
    agents are still busy elsewhere (their tools, their own code); a batch is sampled at
    once when every running agent is waiting on the model."""

    @property
    def enabled(self) -> bool:
        return self.entry is not None or self.command is not None

    @property
    def name(self) -> str:
        """The agent as the config names it, for messages."""
        return f"rollout.agent.entry={self.entry}" if self.entry is not None else \
            f"rollout.agent.command={self.command}"

    def __post_init__(self):
        require(self.max_requests >= 1, "rollout.agent.max_requests", self.max_requests,
                "must be >= 1")
        require(self.batch_wait_s >= 0, "rollout.agent.batch_wait_s", self.batch_wait_s,
                "must be >= 0")
        require(bool(self.model_name), "rollout.agent.model_name", self.model_name,
                "must not be empty")
        require(self.entry is None or self.command is None, "rollout.agent.entry",
                self.entry, "and rollout.agent.command are two agents: choose one")
        if self.entry is not None:
            require(":" in self.entry, "rollout.agent.entry", self.entry,
                    "must look like 'package.module:function'")
        if self.command is not None:
            require(bool(self.command.strip()), "rollout.agent.command", self.command,
                    "must not be empty")


@dataclass(kw_only=True, frozen=True)
class JudgeConfig:
    """``rollout.judge``: a model that reads each sample and writes a verdict, parsed into
    its score (a generative reward model; docs/ppo.md, "A judge model as the reward")."""

    template: str | None = None
    """The judge's prompt, with {prompt} and {response} replaced by the sample's decoded
    prompt and response (without its stop token); the model of roles.judge.checkpoint
    answers it greedily. None: no judge."""
    chat: bool = True
    """Render the template's text as the user's message of the tokenizer's chat template,
    with its generation prompt; false: the text is the judge's prompt as it is."""
    pattern: str = r"(-?\d+(?:\.\d+)?)"
    """A regular expression whose first group, at its last match in the verdict, is the
    score: a number, or with labels a key of labels. A verdict it does not match is a
    failed reward call (rollout.rewards.on_error)."""
    labels: dict[str, float] | None = None
    """Scores of the words the pattern captures (e.g. {yes: 1, no: 0}); a word not here
    is a failed call. None: the captured text is read as a number."""
    max_new_tokens: int = 64
    """The longest verdict."""
    log_verdicts: int = 8
    """The first this many samples' verdicts of every batch are appended to the run's
    judge_verdicts.jsonl (prompt, response, verdict, score or error); 0: none."""

    @property
    def enabled(self) -> bool:
        return self.template is not None

    def __post_init__(self):
        import re

        require(self.max_new_tokens >= 1, "rollout.judge.max_new_tokens",
                self.max_new_tokens, "must be >= 1")
        require(self.log_verdicts >= 0, "rollout.judge.log_verdicts", self.log_verdicts,
                "must be >= 0 (0: none)")
        try:
            groups = re.compile(self.pattern).groups
        except re.error as err:
            groups = None
            require(False, "rollout.judge.pattern", self.pattern,
                    f"is not a regular expression ({err})")
        require(groups >= 1, "rollout.judge.pattern", self.pattern,
                "needs a group, (...), around the score")
        if self.template is not None:
            require("{response}" in self.template, "rollout.judge.template", self.template,
                    "must contain {response} (the sample the judge reads)")


@dataclass(kw_only=True, frozen=True)
class PPOConfig:
    rollout_batch_size: int = 64
    """Prompts per PPO iteration (global, all data-parallel ranks)."""
    mini_batch_size: int = 16
    """Samples per optimizer step (global)."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass on one data-parallel rank when padded; packed (the
    default), with the longest sample it sizes the token budget
    (max_tokens_per_micro_batch)."""
    max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    """Pack the updates' micro-batches: each forward/backward pass takes whole samples,
    their real prompt and response tokens concatenated into one row (each attends to itself
    only), at most this many tokens (a row under 65 tokens is topped up to 65, see
    data.packing); every data-parallel rank gets a share of each
    mini-batch with balanced token counts. Losses equal the padded computation's. Must
    hold the longest sample (data.max_prompt_len + rollout.max_new_tokens; with an
    environment, data.max_seq_len); verl's ppo_max_token_len_per_gpu, slime's
    --max-tokens-per-gpu. auto: micro_batch_size x that longest sample, so a pass holds no
    more tokens than a padded micro-batch of the longest samples would. null: padded
    micro-batches of micro_batch_size rows. PPO-ptx's pretraining rows are packed the same
    way."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    num_iterations: int = 100
    """PPO iterations to run."""
    clip_eps: float = 0.2
    """Policy ratio clip (1 +- clip_eps)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None disables."""
    cliprange_value: float | None = 0.2
    """Value clip around the old values; None disables value clipping."""
    value_loss_coef: float = 0.5
    """Weight of the critic's loss: value_loss_coef * max((V - R)^2, (V_clip - R)^2). The
    critic has its own optimizer, so with Adam this mostly matters through gradient
    clipping and epsilon; 0.5 is the usual 0.5 * squared error."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    gamma: float = 1.0
    """Discount (InstructGPT: 1)."""
    lam: float = 0.95
    """GAE lambda."""
    kl: KLConfig = field(default_factory=KLConfig)
    """The KL to the reference: in the reward, in the loss, and its coefficient's
    controller."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation: the reverse KL to a teacher (roles.teacher) in the reward
    or the loss."""
    clip_reward_value: float = 5.0
    """Reward-model score clip (DeepSpeed-Chat: 5)."""
    missing_stop_penalty: float | None = -1.0
    """Score for responses without a stop token (lm-human-preferences: -1); None disables."""
    missing_stop_mode: Literal["replace", "subtract"] = "replace"
    """Replace the score by missing_stop_penalty, or subtract it (TRL's missing_eos_penalty)."""
    whiten_advantages: bool = True
    """Whiten advantages (global across data-parallel ranks)."""
    whiten_rewards: bool = False
    """Scale rewards by their std (no mean shift)."""
    whiten_unbiased: bool = True
    """Variance in whitening: unbiased n/(n-1) (torch, TRL) or biased (TF, lm-human-prefs)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses are reduced."""
    ptx_coef: float = 0.0
    """PPO-ptx weight of next-token loss on pretraining data; 0 disables."""
    critic_warmup_iterations: int = 0
    """Iterations at the start that train the critic only (Qwen)."""
    ema_decay: float | None = None
    """Decay of an EMA copy of the actor for evaluation (0.992 in InstructGPT); None off."""
    group_size: int = 1
    """Responses per prompt (GRPO/RLOO)."""
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = "gae"
    """GAE with a critic, or a critic-free group/global baseline."""
    grpo_normalization: Literal["sequence", "token", "center"] = "sequence"
    """GRPO advantages: sequence = (score - group mean) / unbiased group std per sample
    (DeepSeekMath, TRL: the default, so runs compare with the paper and TRL); token = mean
    and population std over all valid tokens of the group (AReaL: long responses weigh
    more); center = score - group mean, no std (Dr. GRPO: no difficulty re-weighting)."""
    policy_loss: Literal["ppo", "decoupled"] | None = None
    """ppo: clipped surrogate around the old log-probs. decoupled (AReaL): clip around the
    proximal policy (the log-probs recomputed before the update) and weight each token by
    exp(proximal - behaviour), the behaviour policy being the sampler's log-probs; needs
    rollout.recompute_logprobs=true. None: decoupled when max_staleness > 0 (the batches
    are sampled by an older policy), ppo otherwise."""
    max_staleness: int = 0
    """Bounded staleness k (asynchronous RL, AReaL's max_head_offpolicyness, NeMo-RL's
    max_trajectory_age_steps): batch i is sampled by the policy of version max(0, i - k),
    version v being the actor after v iterations, so up to k batches are sampled ahead of
    the update that trains them. A fixed schedule, not a race: the run is a function of
    its seed and config, and a resume continues it exactly (the batches sampled ahead are
    saved with the checkpoint). 0: on-policy, every batch sampled by the current actor.
    rollout/staleness_mean and _max report each batch's versions."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Off-policy corrections: the decoupled loss's weight cap and the rollout/training
    mismatch's truncated importance sampling and masks."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no learning signal for group
    baselines) and sample more prompts until rollout_batch_size groups are kept."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: rollouts per iteration at most; a batch still short after them is
    topped up with dropped groups (counted in rollout/dynamic_sampling_shortfall)."""
    overlong_buffer: int = 0
    """DAPO's overlong shaping: responses longer than max_new_tokens - overlong_buffer lose
    up to overlong_penalty linearly, the full amount at max_new_tokens; 0 disables."""
    overlong_penalty: float = 1.0
    """The largest overlong penalty (DAPO: 1.0)."""
    ptx_batch_size: int | None = None
    """PPO-ptx: pretraining samples mixed into each actor mini-batch (global); None: as
    many as mini_batch_size."""
    critic_init: Literal["reward", "sft", "random"] = "reward"
    """Critic trunk from the reward model (InstructGPT), the SFT model, or random."""
    gold_reward_fn: str | None = None
    """Evaluation-only reward 'module:function(prompt, response) -> float' on held-out
    prompts (known gold reward of synthetic tasks)."""
    eval_interval: int = 5
    """Evaluate on held-out prompts every N iterations (and before the first and at the end)."""
    num_eval_prompts: int = 64
    """Held-out prompts per evaluation."""

    def __post_init__(self):
        for name in ("rollout_batch_size", "mini_batch_size", "micro_batch_size",
                     "ppo_epochs", "num_iterations", "group_size"):
            require(getattr(self, name) >= 1, f"ppo.{name}", getattr(self, name), "must be >= 1")
        require(self.max_tokens_per_micro_batch in (None, "auto")
                or self.max_tokens_per_micro_batch >= 1,
                "ppo.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch,
                "must be >= 1, auto, or null for padded micro-batches")
        # Batch divisibility counts samples (prompts x group_size) per trained role's
        # data-parallel size: checked by algos.BatchSizes once the layouts are known.
        require(0 < self.clip_eps < 1, "ppo.clip_eps", self.clip_eps, "must be in (0, 1)")
        if self.dual_clip is not None:
            require(self.dual_clip > 1, "ppo.dual_clip", self.dual_clip, "must be > 1 or null")
        require(0 <= self.gamma <= 1, "ppo.gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.lam <= 1, "ppo.lam", self.lam, "must be in [0, 1]")
        require(self.value_loss_coef > 0, "ppo.value_loss_coef", self.value_loss_coef,
                "must be > 0")
        if self.ema_decay is not None:
            require(0 < self.ema_decay < 1, "ppo.ema_decay", self.ema_decay,
                    "must be in (0, 1) or null")
        if self.cliprange_value is not None:
            require(self.cliprange_value > 0, "ppo.cliprange_value", self.cliprange_value,
                    "must be > 0 or null (no value clipping)")
        require(self.entropy_coef >= 0, "ppo.entropy_coef", self.entropy_coef, "must be >= 0")
        require(self.clip_reward_value > 0, "ppo.clip_reward_value", self.clip_reward_value,
                "must be > 0 (scores are clipped to +-clip_reward_value)")
        for name in ("critic_warmup_iterations",):
            require(getattr(self, name) >= 0, f"ppo.{name}", getattr(self, name), "must be >= 0")
        for name in ("eval_interval", "num_eval_prompts"):
            require(getattr(self, name) >= 1, f"ppo.{name}", getattr(self, name), "must be >= 1")
        require(self.ptx_coef >= 0, "ppo.ptx_coef", self.ptx_coef, "must be >= 0")
        if self.ptx_batch_size is not None:
            require(self.ptx_batch_size >= 1, "ppo.ptx_batch_size", self.ptx_batch_size,
                    "must be >= 1 or null")
        require(self.max_staleness >= 0, "ppo.max_staleness", self.max_staleness,
                "must be >= 0 (0: on-policy)")
        require(self.max_sampling_rounds >= 1, "ppo.max_sampling_rounds",
                self.max_sampling_rounds, "must be >= 1")
        require(self.overlong_buffer >= 0, "ppo.overlong_buffer", self.overlong_buffer,
                "must be >= 0")
        require(self.overlong_penalty > 0, "ppo.overlong_penalty", self.overlong_penalty,
                "must be > 0")

    @property
    def decoupled_loss(self) -> bool:
        """Whether the policy loss is the decoupled one (``policy_loss`` resolved)."""
        if self.policy_loss is not None:
            return self.policy_loss == "decoupled"
        return self.max_staleness > 0

    @property
    def kl_reward_on(self) -> bool:
        """Whether beta x KL is taken off the reward (``kl.in_reward`` resolved)."""
        if self.kl.in_reward is not None:
            return self.kl.in_reward
        return self.advantage_estimator != "grpo"


@dataclass(kw_only=True, frozen=True)
class RolloutConfig:
    tensor_parallel_size: int = 1
    """TP of the inference layout; data-parallel replicas follow from the world size (of
    the rollout ranks, under placement=split)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where sampling runs: on every process, or on rollout ranks of its own."""
    decode_slots: int | None = None
    """Continuous batching: the rows each inference replica decodes at once; a row that
    stops hands its slot to the replica's next prompt at the next step (the prompts of a
    GRPO group are adjacent, so they start together). The samples are those of one static
    batch (per-prompt seeds); rollout.kv_cache says where the keys and values live. None:
    all of the replica's prompts in one static batch, whose rows stay in it until the
    longest stops (rollout/idle_decode_slots shows how many of them the decode steps feed
    after they stopped)."""
    kv_cache: str = "paged"
    """The KV cache of decode slots. ``paged``: one pool of blocks every slot takes from as
    it grows and gives back when its prompt stops (rollout.kv_cache_tokens), attention over
    the live tokens only - where the model allows it; multi-latent attention,
    TransformerEngine's attention and pipeline-parallel rollout layouts use ``columns``.
    ``columns``: megatron's static inference context, a row per slot as long as the whole
    schedule (the longest prompt + max_new_tokens x (prompts / slots + 1))."""
    kv_block_tokens: int = 16
    """Positions per block of the paged KV cache."""
    kv_cache_tokens: int | None = None
    """Positions the paged KV cache holds per inference replica (rounded up to whole
    blocks). None: every decode slot at the longest prompt + max_new_tokens, so no prompt
    ever waits for blocks. Smaller: memory follows the live tokens - a prompt waits for
    the blocks its sequence needs, and when the pool runs out the slot admitted last gives
    its blocks back and starts again later (rollout/kv_preemptions_per_prompt; its keys
    and values are computed again, its samples unchanged). Must hold one sequence."""
    max_new_tokens: int = 32
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed from logits / temperature."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables."""
    greedy: bool = False
    """Argmax decoding (evaluation)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (EOS always does)."""
    stop_at_eos: bool = True
    """Stop a sequence at EOS; false keeps sampling to max_new_tokens (OpenAI's first code)."""
    min_response_tokens: int = 0
    """Responses shorter than this get no trainable tokens (DeepSpeed-Chat drops <= 1)."""
    recompute_logprobs: bool = True
    """Recompute old log-probs with the training-layout actor instead of using the
    sampler's."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Reward functions and servers: user code, run in worker processes."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes with an environment."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Episodes played by an agent program through an OpenAI-compatible endpoint."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A judge model (roles.judge) whose verdicts are the reward."""
    offload_frozen_models: bool = True
    """Offload reference and reward models between their scoring passes (the default of
    roles.reference.offload / roles.reward.offload)."""
    forward_micro_batch_size: int | None = None
    """Rows per forward pass of the experience passes (reference and old log-probs,
    reward, critic values); None: ppo.micro_batch_size. These passes keep nothing for a
    backward pass, so larger micro-batches than training's usually fit (verl's
    log_prob_micro_batch_size, TRL's local_rollout_forward_batch_size)."""
    forward_max_tokens_per_micro_batch: int | None = None
    """Pack the experience passes' micro-batches into rows of at most this many tokens
    (as ppo.max_tokens_per_micro_batch packs the updates'); None: that setting's value -
    when it is auto, forward_micro_batch_size x the longest sample, and when it is null,
    padded micro-batches of forward_micro_batch_size rows."""
    routing_replay: Literal["none", "r2", "r3"] = "none"
    """A mixture-of-experts actor's expert choices. ``r3`` records each token's experts in
    the rollout and replays them in every pass of the actor over that batch (its old
    log-probs and its updates), so tiny numeric differences between the inference and
    training layouts cannot send a token to other experts (Megatron-LM#4168). ``r2``
    records the experts of the actor's first training-side pass (the old log-probs) and
    replays them in the updates: the ratio compares the same experts in every epoch, but
    the rollout's choices may still differ. ``none`` lets each pass choose.
    moe/routing_mismatch_frac reports, under none and r2, how often the old-log-prob pass
    chose other experts than the rollout. Both replays need rollout.recompute_logprobs."""
    release_inference_weights: bool = True
    """Free the inference model's weights (the actor at the rollout layout) after each
    generation: the next reshard rewrites all of them, so nothing is copied; the actor's
    size at rollout TP less per GPU in the experience, train and save phases."""
    ref_cache_size: int = 4096
    """Sequences whose reference log-probs are kept (the least recently used dropped first)
    and saved with each checkpoint, so a sequence sampled again - twice in one batch, as in
    GRPO groups with short answers, or in a later iteration - is not scored again. Memory
    and checkpoint space: about 4 bytes per response token per sequence (16 MB at 4096
    sequences of 1024 tokens). 0 turns the cache off."""

    def __post_init__(self):
        require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size",
                self.tensor_parallel_size, "must be >= 1")
        if self.decode_slots is not None:
            require(self.decode_slots >= 1, "rollout.decode_slots", self.decode_slots,
                    "must be >= 1, or null for one static batch")
        require(self.kv_cache in ("paged", "columns"), "rollout.kv_cache", self.kv_cache,
                "must be 'paged' or 'columns'")
        require(self.kv_block_tokens >= 1, "rollout.kv_block_tokens", self.kv_block_tokens,
                "must be >= 1")
        if self.kv_cache_tokens is not None:
            require(self.decode_slots is not None and self.kv_cache == "paged",
                    "rollout.kv_cache_tokens", self.kv_cache_tokens,
                    "sizes the paged cache of decode slots: set rollout.decode_slots (and "
                    "rollout.kv_cache=paged), or unset it")
        place = self.placement
        if place.mode == "split":
            require(place.ranks % self.tensor_parallel_size == 0, "rollout.placement.ranks",
                    place.ranks, f"must be a multiple of rollout.tensor_parallel_size="
                    f"{self.tensor_parallel_size}")
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", self.max_new_tokens,
                "must be >= 1")
        env = self.environment
        if env.name is not None:
            require(self.rewards.fn is None and self.rewards.url is None,
                    "rollout.environment.name", env.name, "gives the rewards: unset "
                    "rollout.rewards.fn and rollout.rewards.url")
            require(not self.agent.enabled, "rollout.environment.name", env.name,
                    f"and {self.agent.name} are two sources of episodes: choose one")
        if self.episodic:
            source = "rollout.environment" if env.name is not None else "rollout.agent"
            require(self.stop_at_eos, "rollout.stop_at_eos", self.stop_at_eos,
                    f"must be true with {source} (a turn ends at its stop token)")
            field_name, value = ("rollout.environment.name", env.name) if env.name else \
                self.agent.name.split("=", 1)
            require(self.decode_slots is None and not place.partial, field_name, value,
                    "samples each turn as one static batch: unset "
                    "rollout.decode_slots and rollout.placement.partial")
        require(self.temperature > 0, "rollout.temperature", self.temperature,
                "must be > 0 (use rollout.greedy=true for argmax)")
        require(self.top_k >= 0, "rollout.top_k", self.top_k, "must be >= 0")
        require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        require(self.min_response_tokens >= 0, "rollout.min_response_tokens",
                self.min_response_tokens, "must be >= 0")
        require(self.forward_micro_batch_size is None or self.forward_micro_batch_size >= 1,
                "rollout.forward_micro_batch_size", self.forward_micro_batch_size,
                "must be >= 1, or null for ppo.micro_batch_size")
        require(self.forward_max_tokens_per_micro_batch is None
                or self.forward_max_tokens_per_micro_batch >= 1,
                "rollout.forward_max_tokens_per_micro_batch",
                self.forward_max_tokens_per_micro_batch, "must be >= 1, or null")
        require(self.ref_cache_size >= 0, "rollout.ref_cache_size", self.ref_cache_size,
                "must be >= 0 (0 turns the reference log-prob cache off)")

    @property
    def episodic(self) -> bool:
        """Multi-turn episodes (an environment's or an agent's) rather than prompts."""
        return self.environment.name is not None or self.agent.enabled
