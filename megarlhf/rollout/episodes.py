"""Multi-turn rollouts with an environment (``rollout.environment.name``).

**An episode is kept as tokens.** Its first messages are rendered with the generation
prompt (and the tools: the row's ``data.tools_key`` column, else the environment's
``tools``). Each model turn is sampled until its stop token; the sampled tokens are kept
as they are - never decoded and encoded again - and so are their log-probs. The
observation that follows is appended as the chat template renders it: the text the
template writes after the assistant's turn (what follows its end-of-turn token), the
observation's messages and the next generation prompt. The loss mask covers the model's
tokens only (``Generation.observation_BT`` marks the environment's). Each step's reward
sits at its turn's last token (``Generation.env_rewards_BT``): the last one is the sample's
score, the earlier ones reach GAE and REINFORCE++ where they fell and GRPO / RLOO as part of
the sequence reward (``algos.learning_targets``).

**An episode ends** when the environment says done, after ``rollout.environment.max_turns`` model
turns, when a turn stops without its stop token (``rollout.max_new_tokens``, or the room
left in ``data.max_seq_len``), or when an observation would pass
``rollout.environment.max_observation_tokens`` in all or ``data.max_seq_len``; it always ends with a
model turn. A tool call that does not parse is answered by an error observation (the
environment is not stepped): the model sees what was wrong, the run never crashes on it.

The environment's protocol, and where its code runs: :mod:`megarlhf.rewards.environments`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarlhf.config import DataConfig, EnvironmentConfig, RewardsConfig
from megarlhf.data.tools import ToolCallError, error_observation, parse_tool_calls
from megarlhf import speedups
from megarlhf.inference.generate import Generation, SamplingParams, generate, stop_tensor
from megarlhf.rewards.environments import InProcessEnvs, WorkerEnvs, check_reset, check_step
from megarlhf.rewards.verifiers import Failure, RewardError
from megarlhf.algos.seeds import derive_seed
from megarlhf.inference.turns import TurnCache
from megarlhf.speedups.turn_kv import applies as turn_cache_applies
from megarlhf.speedups.turn_kv import columns as turn_cache_columns


# ------------------------------------------------------------------ one episode

@dataclass
class Episode:
    """One episode on its replica's TP rank 0 (the leader): its tokens so far, and the
    messages the chat template renders its observations from."""

    row: dict
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # after the prompt
    observation: list[int] = field(default_factory=list)  # 1: the environment's token
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    tools: list | None = None
    turns: int = 0
    obs_tokens: int = 0
    tool_errors: int = 0  # calls that did not parse, answered with an error observation
    stopped: bool = False  # the last model turn ended with its stop token
    done: bool = False  # no more turns
    env_done: bool = False  # the environment said done
    failure: Failure | None = None

    def __len__(self) -> int:
        return len(self.prompt) + len(self.tokens)


class StepEnd(enum.Enum):
    """What a turn's step leaves of its episode."""

    GOES_ON = "goes on"  # the observation is appended, another turn follows
    ENV_DONE = "env done"  # the environment said done
    ENDED = "ended"  # a failure, or no room for the observation and a turn after it


@dataclass
class Step:
    """The leader's answer to one episode's turn, the same on its TP peers: the step's
    reward, the observation's tokens (when the episode goes on), how it ends, and the
    failure that ended it."""

    reward: float
    observation: list[int]
    end: StepEnd
    failure: Failure | None = None


class Episodes:
    """The multi-turn sampler of one inference replica (see the module docstring)."""

    def __init__(self, env: EnvironmentConfig, rewards: RewardsConfig, data: DataConfig,
                 tokenizer):
        self.environment, self.rewards, self.data = env, rewards, data
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None)
        if self.template is None:
            raise ValueError("rollout.environment.name renders conversations, but the tokenizer "
                             "has no chat template (set tokenizer.chat_template)")
        self.path = env.name
        self.host = None  # made on first use, on the leaders only
        self.pieces = tokenizer.pieces()

    def _host(self):
        if self.host is None:
            workers = self.rewards.workers
            self.host = InProcessEnvs(self.path) if workers == 0 else \
                WorkerEnvs(self.path, workers, self.rewards.timeout_s)
        return self.host

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    # -------------------------------------------------------------- the rendering

    def observation_tokens(self, ep: Episode, turn_text: str, stop_id: int,
                           obs: list[dict]) -> list[int]:
        """:func:`observation_tokens` of this sampler's template."""
        return observation_tokens(self.template, self.tokenizer, self.pieces, ep, turn_text,
                                  stop_id, obs)

    # -------------------------------------------------------------- the loop

    @torch.no_grad()
    def sample(self, model, rows: list[dict], indices: list[int], seed: int, *,
               params: SamplingParams, eos_id: int, pad_id: int, true_vocab: int,
               stats: dict) -> Generation:
        """This replica's share ``rows`` (the batch's rows ``indices``) played to the end;
        every TP rank of the replica calls it and returns the same generation. ``stats``
        gets the counts :func:`episode_metrics` reduces."""
        group = model.pg_collection.tp
        leader = group.rank() == 0
        episodes = [Episode(row=row) for row in rows]
        host = self._host() if leader else None
        for key in ("decode_slots", "idle_decode_slots"):  # also when no turn is sampled
            stats.setdefault(key, 0)
        stops = set(params.stop_token_ids) | {eos_id}
        if leader:
            self._reset(episodes, host, pad_id)
        firsts = _from_leader(group, [(ep.prompt, ep.done, ep.failure) for ep in episodes])
        for ep, (prompt, ended, failure) in zip(episodes, firsts):
            ep.prompt, ep.done, ep.failure = prompt, ended, failure
        kv_bytes = 0
        last = self.environment.max_turns - 1
        # the episodes' keys and values kept across their turns (speedups.turn_kv)
        cache = TurnCache(model, len(episodes), pad_id=pad_id, true_vocab=true_vocab,
                          columns=turn_cache_columns(self.data.max_seq_len)) \
            if speedups.enabled("turn_kv") and turn_cache_applies(model) else None
        for turn in range(last + 1):
            live = [j for j, ep in enumerate(episodes) if not ep.done]
            if not live:
                break
            if cache is None:
                turns, turn_kv = self._sample_turn(model, episodes, live, indices, seed, turn,
                                                   params, eos_id, pad_id, true_vocab, stats)
            else:
                turns, turn_kv = self._cached_turn(cache, episodes, live, indices, seed, turn,
                                                   params, eos_id, stats)
            kv_bytes = max(kv_bytes, turn_kv)
            stepped = []  # (episode, its turn's sampled tokens), for the environment
            for j in live:
                if _append_turn(episodes[j], *turns[j], stops):
                    stepped.append((j, turns[j][0]))
            # the environment's answers (the leader's), every TP rank appending the same
            answers = {}
            if leader and stepped:
                answers = self._step(episodes, stepped, turn, host, self.data.max_seq_len)
            answers = _from_leader(group, answers)
            for j, _ in stepped:
                _append_answer(episodes[j], answers[j], last_turn=turn == last)
        if leader:
            host.call([(j, "close", None) for j in range(len(episodes))])
            self._count(episodes, indices, stats)
        stats["kv_cache_bytes"] = kv_bytes
        score = self.rewards.error_score
        return _as_generation(episodes, pad_id, score)

    def _reset(self, episodes: list[Episode], host, pad_id: int) -> None:
        """The leader's first messages of every episode (its environment's reset), rendered
        as its prompt; an episode whose reset failed ends with its failure."""
        got = host.call([(j, "reset", ep.row) for j, ep in enumerate(episodes)])
        for ep, value in zip(episodes, got):
            if isinstance(value, Failure):
                _fail(ep, value)
                continue
            try:
                first = check_reset(value["messages"], None)
                ep.tools = ep.row.get(self.data.tools_key) or value["tools"]
                ep.messages = first["messages"]
                text = self.template.render(ep.messages, add_generation_prompt=True,
                                            tools=ep.tools)
                ep.prompt = self.tokenizer.encode(text)
                if len(ep.prompt) > self.data.max_prompt_len:
                    raise ValueError(f"its first messages are {len(ep.prompt)} tokens, "
                                     f"over data.max_prompt_len="
                                     f"{self.data.max_prompt_len}")
            except ValueError as err:
                _fail(ep, Failure("error", str(err)))
                ep.prompt = [pad_id]

    def _sample_turn(self, model, episodes: list[Episode], live: list[int],
                     indices: list[int], seed: int, turn: int, params: SamplingParams,
                     eos_id: int, pad_id: int, true_vocab: int, stats: dict
                     ) -> tuple[dict[int, tuple[list[int], list[float]]], int]:
        """The live episodes' next turns ({episode: (sampled tokens, their log-probs)}) and
        the largest KV cache it took. One pass per cap on the new tokens: a row near
        data.max_seq_len samples no further than its room, the others their
        rollout.max_new_tokens."""
        caps = {j: min(params.max_new_tokens, self.data.max_seq_len - len(episodes[j]))
                for j in live}
        return sample_turns(model, {j: episodes[j].prompt + episodes[j].tokens for j in live},
                            caps, {j: derive_seed("turn", seed, indices[j], turn) for j in live},
                            params, eos_id=eos_id, pad_id=pad_id, true_vocab=true_vocab,
                            stats=stats)

    def _cached_turn(self, cache: TurnCache, episodes: list[Episode], live: list[int],
                     indices: list[int], seed: int, turn: int, params: SamplingParams,
                     eos_id: int, stats: dict
                     ) -> tuple[dict[int, tuple[list[int], list[float]]], int]:
        """:meth:`_sample_turn` on the episodes' kept KV cache: the same caps and seeds."""
        caps = {j: min(params.max_new_tokens, self.data.max_seq_len - len(episodes[j]))
                for j in live}
        fed = range(len(episodes)) if turn == 0 else live
        turns = cache.turn({j: episodes[j].prompt + episodes[j].tokens for j in fed}, caps,
                           params, {j: derive_seed("turn", seed, indices[j], turn)
                                    for j in live},
                           stop_tensor(params, eos_id, cache.device), stats)
        return turns, cache.cache_bytes()

    def _count(self, episodes: list[Episode], indices: list[int], stats: dict) -> None:
        count_episodes(episodes, indices, stats, f"rollout.environment.name={self.path}")

    def _step(self, episodes: list[Episode], stepped: list, turn: int, host,
              max_len: int) -> dict:
        """The leader's half of a turn: each stopped episode's turn read (tool calls) and
        stepped, the observation rendered; {episode: its :class:`Step`}."""
        out, calls, texts = {}, [], {}
        for j, sampled in stepped:
            ep = episodes[j]
            text = self.tokenizer.decode(sampled[:-1])
            texts[j] = (text, sampled[-1])
            turn_in = {"text": text, "tool_calls": [], "index": turn}
            if self.environment.tool_format is not None:
                try:
                    _, parsed = parse_tool_calls(text, self.environment.tool_format)
                    turn_in["tool_calls"] = [{"name": c.name, "arguments": c.arguments}
                                             for c in parsed]
                except ToolCallError as err:  # answered here, the environment untouched
                    ep.tool_errors += 1
                    out[j] = self._observe(ep, text, sampled[-1], [error_observation(err)],
                                           0.0, False, max_len)
                    continue
            calls.append((j, "step", turn_in))
        for (j, _, _), value in zip(calls, host.call(calls) if calls else []):
            ep = episodes[j]
            if isinstance(value, Failure):
                out[j] = Step(0.0, [], StepEnd.ENDED, value)
                continue
            try:
                step = check_step(value)
            except ValueError as err:
                out[j] = Step(0.0, [], StepEnd.ENDED, Failure("error", str(err)))
                continue
            text, stop_id = texts[j]
            out[j] = self._observe(ep, text, stop_id, step["observation"], step["reward"],
                                   step["done"], max_len)
        return out

    def _observe(self, ep: Episode, text: str, stop_id: int, obs: list[dict], reward: float,
                 done: bool, max_len: int) -> "Step":
        """One step's :class:`Step`: the observation rendered, unless the episode ends
        here (done, or over a budget)."""
        if done:
            return Step(reward, [], StepEnd.ENV_DONE)
        try:
            tokens = self.observation_tokens(ep, text, stop_id, obs)
        except ValueError as err:
            return Step(reward, [], StepEnd.ENDED, Failure("error", str(err)))
        budget = self.environment.max_observation_tokens
        over_budget = budget is not None and ep.obs_tokens + len(tokens) > budget
        if over_budget or len(ep) + len(tokens) >= max_len:
            return Step(reward, [], StepEnd.ENDED)  # no room for it and a turn after it
        return Step(reward, tokens, StepEnd.GOES_ON)


def observation_tokens(template, tokenizer, pieces: list[str], ep: Episode, turn_text: str,
                       stop_id: int, obs: list[dict]) -> list[int]:
    """The tokens after the model's stop token up to the next generation prompt: what
    ``template`` writes after the assistant's turn, the observation's messages and the
    generation prompt (``ep.messages`` moves on past them)."""
    said = ep.messages + [{"role": "assistant", "content": turn_text}]
    before = template.render(said, add_generation_prompt=False, tools=ep.tools)
    after = template.render(said + obs, add_generation_prompt=True, tools=ep.tools)
    if not after.startswith(before):
        raise ValueError(f"the chat template {template.origin} does not render an "
                         "observation as an extension of the conversation")
    # the stop token as the template writes it: its decoded text, or its piece for a
    # control token a decoder leaves out (sentencepiece's </s>)
    stop_text = tokenizer.decode([stop_id]) or pieces[stop_id]
    end = before.rfind(stop_text)
    if end < 0:
        raise ValueError(f"the chat template {template.origin} does not end the "
                         f"assistant's turn with the token the model stopped with "
                         f"({stop_text!r})")
    ep.messages = said + obs
    return tokenizer.encode(before[end + len(stop_text):] + after[len(before):])


def count_episodes(episodes: list[Episode], indices: list[int], stats: dict,
                   source: str) -> None:
    """The leader's episode counts into ``stats`` (see :func:`episode_metrics`); the first
    failure named with ``source`` (the environment or agent setting)."""
    stats["episodes"] = stats.get("episodes", 0) + len(episodes)
    stats["turns"] = stats.get("turns", 0) + sum(ep.turns for ep in episodes)
    stats["started"] = stats.get("started", 0) + sum(ep.turns > 0 for ep in episodes)
    stats["env_done"] = stats.get("env_done", 0) + sum(ep.env_done for ep in episodes)
    stats["observation_tokens"] = stats.get("observation_tokens", 0) \
        + sum(ep.obs_tokens for ep in episodes)
    stats["tool_errors"] = stats.get("tool_errors", 0) + sum(
        ep.tool_errors for ep in episodes)
    for ep, index in zip(episodes, indices):
        if ep.failure is not None:
            key = "timeouts" if ep.failure.kind == "timeout" else "failed"
            stats[key] = stats.get(key, 0) + 1
            stats.setdefault("first_failure", f"{source}: sample {index}: "
                             f"{ep.failure.message}")


def _from_leader(group, obj):
    """The TP leader's ``obj`` on every TP rank of the replica (``group``)."""
    if group.size() == 1:
        return obj
    got = [obj]
    dist.broadcast_object_list(got, src=dist.get_global_rank(group, 0), group=group)
    return got[0]


def sample_turns(model, seqs: dict[int, list[int]], caps: dict[int, int],
                 seeds: dict[int, int], params: SamplingParams, *, eos_id: int, pad_id: int,
                 true_vocab: int, stats: dict
                 ) -> tuple[dict[int, tuple[list[int], list[float]]], int]:
    """The next turn of each conversation ``seqs`` ({episode: its tokens so far}), at most
    ``caps[episode]`` tokens drawn with ``seeds[episode]``: ({episode: (sampled tokens, their
    log-probs)}, the largest KV cache it took). One static batch per cap; ``stats`` adds
    the decode slots."""
    by_cap: dict[int, list[int]] = {}
    for j in seqs:
        by_cap.setdefault(caps[j], []).append(j)
    turns: dict[int, tuple[list[int], list[float]]] = {}
    kv_bytes = 0
    for cap, rows in sorted(by_cap.items()):
        turn_params = dataclasses.replace(params, max_new_tokens=cap)
        turn_stats: dict = {}
        gen = generate(model, [seqs[j] for j in rows], turn_params, eos_id=eos_id,
                       pad_id=pad_id, true_vocab=true_vocab, stats=turn_stats,
                       row_seeds=[seeds[j] for j in rows])
        kv_bytes = max(kv_bytes, turn_stats["kv_cache_bytes"])
        for key in ("decode_slots", "idle_decode_slots"):
            stats[key] = stats.get(key, 0) + turn_stats[key]
        for b, j in enumerate(rows):
            n = int(gen.fed_mask_BT[b].sum())
            turns[j] = (gen.response_tokens_BT[b, :n].tolist(),
                        gen.logprobs_BT[b, :n].tolist())
    return turns, kv_bytes


def _fail(ep: Episode, failure: Failure) -> None:
    ep.failure, ep.done = failure, True


def _append_turn(ep: Episode, sampled: list[int], logprobs: list[float], stops: set[int]
                 ) -> bool:
    """The model's turn appended to its episode; whether it stopped with a stop token (the
    environment then steps), else the episode ends (cut by max_new_tokens or by
    data.max_seq_len)."""
    ep.tokens += sampled
    ep.observation += [0] * len(sampled)
    ep.logprobs += logprobs
    ep.rewards += [0.0] * len(sampled)
    ep.turns += 1
    ep.stopped = bool(sampled) and sampled[-1] in stops
    if not ep.stopped:
        ep.done = True
    return ep.stopped


def _append_answer(ep: Episode, step: "Step", *, last_turn: bool) -> None:
    """The environment's answer to a turn: its reward on the turn's last token, then its
    observation's tokens, unless the episode ends here."""
    ep.rewards[-1] += step.reward
    if step.failure is not None:
        _fail(ep, step.failure)
        return
    if step.end is StepEnd.ENV_DONE:
        ep.env_done = True
    if step.end is not StepEnd.GOES_ON or last_turn:
        ep.done = True
        return
    obs = step.observation
    ep.tokens += obs
    ep.observation += [1] * len(obs)
    ep.logprobs += [0.0] * len(obs)
    ep.rewards += [0.0] * len(obs)
    ep.obs_tokens += len(obs)


def _as_generation(episodes: list[Episode], pad_id: int, error_score: float) -> Generation:
    """The episodes as one generation: prompts left-padded, the turns right-padded."""
    B = len(episodes)
    P = max(len(ep.prompt) for ep in episodes)
    T = max(1, max(len(ep.tokens) for ep in episodes))
    out = {"prompt_tokens_BP": torch.full((B, P), pad_id, dtype=torch.long),
           "prompt_mask_BP": torch.zeros(B, P, dtype=torch.long),
           "response_tokens_BT": torch.full((B, T), pad_id, dtype=torch.long),
           "fed_mask_BT": torch.zeros(B, T, dtype=torch.long),
           "logprobs_BT": torch.zeros(B, T),
           "observation_BT": torch.zeros(B, T, dtype=torch.long),
           "env_rewards_BT": torch.zeros(B, T)}
    finished = torch.zeros(B, dtype=torch.bool)
    for b, ep in enumerate(episodes):
        p, n = len(ep.prompt), len(ep.tokens)
        out["prompt_tokens_BP"][b, P - p:] = torch.tensor(ep.prompt)
        out["prompt_mask_BP"][b, P - p:] = 1
        if n:
            out["response_tokens_BT"][b, :n] = torch.tensor(ep.tokens)
            out["fed_mask_BT"][b, :n] = 1
            out["logprobs_BT"][b, :n] = torch.tensor(ep.logprobs)
            out["observation_BT"][b, :n] = torch.tensor(ep.observation)
            out["env_rewards_BT"][b, :n] = torch.tensor(ep.rewards)
        if ep.failure is not None:  # penalty mode's score, at the last model token (column
            # 0 of an episode that never started: where Generation.episode_rewards reads it)
            last = max((t for t in range(n) if ep.observation[t] == 0), default=0)
            out["env_rewards_BT"][b, last] = error_score
        finished[b] = ep.stopped
    return Generation(**out, finished_B=finished)


def episode_metrics(stats: dict, on_error: str) -> dict[str, float]:
    """The batch's episode counts over every replica (a collective of the sampling world),
    and the stop a failed call asks for (``rollout.rewards.on_error=stop``): raised on every
    rank, naming the first failure."""
    keys = ("episodes", "started", "turns", "env_done", "observation_tokens", "tool_errors",
            "failed", "timeouts")
    counts = torch.tensor([float(stats.get(k, 0)) for k in keys], dtype=torch.float64)
    dist.all_reduce(counts)
    got = dict(zip(keys, counts.tolist()))
    broken = got["episodes"] > 0 and got["started"] == 0  # nothing sampled: stop either way
    if (on_error == "stop" and got["failed"] + got["timeouts"]) or broken:
        from megarlhf.parallel.gather import gather_objects
        first = next(m for m in gather_objects(stats.get("first_failure")) if m)
        raise RewardError(first + (" - and no episode of the batch reached its first turn: "
                                   "the environment (or agent) is broken" if broken else
                                   " (rollout.rewards.on_error=stop; set it to penalty to "
                                   "score such episodes rollout.rewards.error_score)"))
    n = max(got["episodes"], 1.0)
    return {"rollout/turns_mean": got["turns"] / n,
            "rollout/env_done_fraction": got["env_done"] / n,
            "rollout/observation_tokens_mean": got["observation_tokens"] / n,
            "rollout/tool_call_errors": got["tool_errors"],
            "reward/failed": got["failed"], "reward/timeouts": got["timeouts"]}
