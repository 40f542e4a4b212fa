"""Episodes played by agent programs through an OpenAI-compatible endpoint
(``rollout.agent``).

Each data row's episode is an agent process (:mod:`megarlhf.rewards.agents`) given a URL of
its own on the replica's endpoint (:mod:`megarlhf.rollout.agent_server`). Every request it
makes is a turn of the episode, sampled on the rollout's model with the other agents'
waiting requests in one batch, and **recorded as tokens**, as an environment's episode is
(:mod:`megarlhf.rollout.episodes`):

- the first request's prompt is the episode's prompt: a chat request's messages (and
  ``tools``) rendered by the chat template with the generation prompt, or a completion
  request's text encoded (or its token ids, taken as they are);
- every later request must **extend** the episode: a chat request repeats the messages so
  far and the reply it got, then adds the observation - ``tool``, ``user`` or ``system``
  messages - which is appended as the template renders it after the model's stop token; a
  completion request's prompt starts with the last prompt and the completion it got, and
  the rest is encoded and appended. The model's turns are never decoded and encoded again.
- a request equal to the last one is a **retry** (a client that timed out and asked
  again): the last turn is dropped and sampled again - with the same seed, so it gets the
  same answer - and the episode records it once;
- anything else (a rewritten history, a second request while one is waiting) is answered
  with an error; a rewritten history also fails the episode.

The loss mask covers the sampled tokens only. The reply carries the text (a chat reply's
tool calls parsed in ``rollout.agent.tool_format``, as an environment's are), and, beyond
the API, the sampled ``token_ids`` and ``prompt_token_ids``. Sampling settings in a request
are not used: the rollout's apply (``rollout.temperature``, ``top_p``, ``top_k``), so the
log-probs trained are those sampled; ``max_tokens`` only shortens a turn.

**An episode ends** when its agent exits. Its reward is the number the agent returns at the
last model token; an agent that returns null is scored by ``rollout.rewards.fn`` or
``url`` on the episode's prompt and its last model turn. After a turn cut by its token
budget, after ``rollout.agent.max_requests`` turns, or when an observation leaves no room
in ``data.max_seq_len``, requests are answered with an error and the episode keeps what it
has. **A failed episode** - the agent exits non-zero, prints something that is not a
reward, stays silent (no request, no result) past ``rollout.rewards.timeout_s``, returns
null with no verifier, rewrites its history, or its first prompt passes
``data.max_prompt_len`` - goes under ``rollout.rewards.on_error``, as an environment's.
"""

from __future__ import annotations

import json
import queue
import secrets
import time
from dataclasses import dataclass

import torch

from megarlhf.algos.seeds import derive_seed
from megarlhf.config import DataConfig, RolloutConfig
from megarlhf.data.chat import check_messages
from megarlhf.data.tools import ToolCallError, check_tools, parse_tool_calls
from megarlhf.inference.generate import Generation, SamplingParams
from megarlhf.rewards.agents import AgentProcess, agent_argv
from megarlhf.rewards.environments import OBSERVATION_ROLES
from megarlhf.rewards.verifiers import Failure, make_verifier
from megarlhf.rollout.agent_server import AgentServer, Request, error_body
from megarlhf.rollout.episodes import (Episode, _append_turn, _as_generation, _fail,
                                       _from_leader, count_episodes, observation_tokens,
                                       sample_turns)


class Refused(Exception):
    """A request answered with an error: (HTTP status, message, code, param); ``ends``
    says why the episode takes no more turns, ``fails`` fails it."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, *, ends: str | None = None,
                 fails: bool = False):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.ends, self.fails = ends, fails


# ------------------------------------------------------------------ reading requests

def chat_messages(raw) -> list[dict]:
    """A chat request's ``messages`` in the form the template renders and the episode
    compares: text content (a list of text parts joined; null with tool calls is ""),
    ``developer`` as ``system``, tool calls as message entries, other keys dropped."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object")
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content
                              if isinstance(part, dict) and part.get("type") == "text")
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        out.append({"role": role, "content": "" if content is None else content,
                    **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})})
    return check_messages(out, "messages", needs_assistant=False, empty_assistant=True)


def same_reply(theirs: dict, ours: dict) -> bool:
    """An assistant message the agent sent back is the reply it got."""
    return theirs["role"] == "assistant" and \
        theirs["content"].strip() == ours["content"].strip() and \
        theirs.get("tool_calls", []) == ours.get("tool_calls", [])


def completion_prompt(raw, vocab: int) -> str | list[int]:
    """A completion request's ``prompt``: text, or token ids (a list of one taken as its
    element)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str) and raw:
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in raw):
        bad = [t for t in raw if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]} is not in the vocabulary (0..{vocab - 1})")
        return list(raw)
    raise ValueError("prompt must be a non-empty string or a list of token ids (one prompt "
                     "per request)")


def max_tokens(body: dict) -> int | None:
    """The request's own cap on the turn, if any."""
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_tokens={value!r} must be a positive integer")
    return value


# ------------------------------------------------------------------ one episode's state

@dataclass
class AgentState:
    """The leader's view of one episode's agent beyond its tokens (:class:`Episode`)."""

    key: str
    proc: AgentProcess
    last_active: float
    kind: str | None = None  # chat or completion: the first request's
    request: object = None  # the last request, as compared with the next
    reply: dict | None = None  # the last chat reply (its assistant message)
    said: str | list[int] | None = None  # completions: the last prompt and its completion
    turn: tuple[str, int] | None = None  # the last turn's text and its stop token
    ends: str | None = None  # why the episode takes no more turns
    snapshot: tuple | None = None  # the episode before its last turn (a retry's)


def snapshot(ep: Episode, st: AgentState) -> tuple:
    return (len(ep.tokens), list(ep.messages), ep.turns, ep.tool_errors, ep.stopped,
            ep.done, st.request, st.reply, st.said, st.turn, st.ends)


def restore(ep: Episode, st: AgentState, snap: tuple) -> None:
    n = snap[0]
    for name in ("tokens", "observation", "logprobs", "rewards"):
        del getattr(ep, name)[n:]
    (ep.messages, ep.turns, ep.tool_errors, ep.stopped, ep.done, st.request, st.reply,
     st.said, st.turn, st.ends) = snap[1:]


# ------------------------------------------------------------------ the sampler

class AgentEpisodes:
    """The multi-turn sampler of one inference replica whose episodes an agent plays (see
    the module docstring); :class:`~megarlhf.rollout.episodes.Episodes`' interface."""

    def __init__(self, r: RolloutConfig, data: DataConfig, tokenizer):
        self.agent, self.rewards, self.data, self.tokenizer = r.agent, r.rewards, data, tokenizer
        self.template = getattr(tokenizer, "chat_template", None)
        self.pieces = tokenizer.pieces()
        self.argv = agent_argv(r.agent)
        self.score_with = (dict(fn_path=r.rewards.fn) if r.rewards.fn else
                           dict(url=r.rewards.url) if r.rewards.url else None)
        self.server: AgentServer | None = None  # the leaders', made on first use
        self.verifier = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.verifier is not None:
            self.verifier.close()

    @torch.no_grad()
    def sample(self, model, rows: list[dict], indices: list[int], seed: int, *,
               params: SamplingParams, eos_id: int, pad_id: int, true_vocab: int,
               stats: dict) -> Generation:
        """This replica's share ``rows`` (the batch's rows ``indices``) played by their
        agents; every TP rank of the replica calls it and returns the same generation."""
        group = model.pg_collection.tp
        for key in ("decode_slots", "idle_decode_slots"):
            stats.setdefault(key, 0)
        kv_bytes = 0
        sample = dict(params=params, eos_id=eos_id, pad_id=pad_id, true_vocab=true_vocab,
                      stats=stats)
        if group.rank() == 0:
            if self.server is None:
                self.server = AgentServer(self.agent.model_name)
            play = _Play(self, rows, indices, seed, params, eos_id, true_vocab)
            try:
                while (batch := play.next_batch()) is not None:
                    wants = _from_leader(group, {j: want for j, (_, want) in batch.items()})
                    turns, turn_kv = _sample(model, wants, **sample)
                    kv_bytes = max(kv_bytes, turn_kv)
                    play.answer(batch, turns)
            finally:
                play.stop()
            _from_leader(group, None)
            episodes = play.finish(pad_id)
            count_episodes(episodes, indices, stats, self.agent.name)
        else:
            while (wants := _from_leader(group, None)) is not None:
                kv_bytes = max(kv_bytes, _sample(model, wants, **sample)[1])
            episodes = None
        episodes = _from_leader(group, episodes)
        stats["kv_cache_bytes"] = kv_bytes
        return _as_generation(episodes, pad_id, self.rewards.error_score)

    def score(self, pairs: list[tuple[str, str]]) -> list:
        """The verifier's scores of (prompt, last turn) pairs: numbers or failures."""
        if self.verifier is None:
            self.verifier = make_verifier(self.rewards, **self.score_with)
        return self.verifier.source.map(pairs)


def _sample(model, wants: dict, **kw) -> tuple[dict, int]:
    """The turns of ``wants`` ({episode: (tokens, cap, seed)})."""
    return sample_turns(model, {j: w[0] for j, w in wants.items()},
                        {j: w[1] for j, w in wants.items()},
                        {j: w[2] for j, w in wants.items()}, **kw)


class _Play:
    """The leader's side of one rollout's episodes: their agents, their requests, their
    answers."""

    def __init__(self, owner: AgentEpisodes, rows: list[dict], indices: list[int], seed: int,
                 params: SamplingParams, eos_id: int, vocab: int):
        self.owner, self.indices, self.seed, self.params = owner, indices, seed, params
        self.agent, self.data = owner.agent, owner.data
        self.stops = set(params.stop_token_ids) | {eos_id}
        self.vocab = vocab
        self.timeout_s = owner.rewards.timeout_s
        self.server = owner.server
        self.episodes = [Episode(row=row) for row in rows]
        keys = [secrets.token_hex(12) for _ in rows]
        self.server.open({key: j for j, key in enumerate(keys)})
        now = time.monotonic()
        self.states = [AgentState(key, AgentProcess(owner.argv, {
            "OPENAI_BASE_URL": self.server.url(key), "OPENAI_API_KEY": key,
            "MEGARLHF_AGENT_MODEL": self.agent.model_name,
            "MEGARLHF_AGENT_ROW": json.dumps(row)}, row), now)
            for key, row in zip(keys, rows)]
        self.ready: dict[int, tuple[Request, tuple]] = {}

    # -------------------------------------------------------------- the loop

    def next_batch(self) -> dict | None:
        """The next requests to sample ({episode: (request, (tokens, cap, seed))}): as soon
        as every running agent waits on the model, or ``rollout.agent.batch_wait_s`` after
        the first one asked; None when every agent has ended."""
        first = None
        while True:
            self._take()
            self._poll()
            running = [j for j, st in enumerate(self.states) if st.proc.running]
            if self.ready:
                first = first or time.monotonic()
                if all(j in self.ready for j in running) or \
                        time.monotonic() - first >= self.agent.batch_wait_s:
                    batch, self.ready = self.ready, {}
                    return batch
            elif not running:
                return None

    def _take(self) -> None:
        """The requests that came in (waiting a moment for one), each answered with an
        error or made ready to sample."""
        try:
            request = self.server.requests.get(timeout=0.005)
        except queue.Empty:
            return
        while True:
            self._admit(request)
            try:
                request = self.server.requests.get_nowait()
            except queue.Empty:
                return

    def _poll(self) -> None:
        """Agents that ended; agents silent past rollout.rewards.timeout_s killed."""
        now = time.monotonic()
        for j, st in enumerate(self.states):
            if st.proc.poll():
                self.server.end(st.key)
                if j in self.ready:  # it did not wait for its answer
                    self._answer(self.ready.pop(j)[0], 404, error_body(
                        "the episode's agent has ended", code="episode_not_found"))
            elif st.proc.running and j not in self.ready \
                    and now - st.last_active > self.timeout_s:
                self.server.end(st.key)
                st.proc.kill(Failure("timeout", f"the agent made no request and gave no "
                                                f"result for rollout.rewards.timeout_s="
                                                f"{self.timeout_s:g} s: killed"))

    def _answer(self, request: Request, status: int, body: dict) -> None:
        j = request.episode
        if j < len(self.states) and self.states[j].key == request.key:  # (not a stale one's)
            self.states[j].last_active = time.monotonic()
        if not request.answer.done():
            request.answer.set_result((status, body))

    def _admit(self, request: Request) -> None:
        j = request.episode
        if j >= len(self.states) or self.states[j].key != request.key \
                or not self.states[j].proc.running:
            self._answer(request, 404, error_body("the episode's agent has ended",
                                                  code="episode_not_found"))
            return
        st, ep = self.states[j], self.episodes[j]
        st.last_active = time.monotonic()
        if j in self.ready:
            self._answer(request, 409, error_body(
                "another request of this episode is waiting for the model: an episode is "
                "one conversation, one request at a time", code="concurrent_request"))
            return
        try:
            want = self._prepare(request, ep, st)
        except Refused as no:
            if no.ends is not None and st.ends is None:
                st.ends = no.ends
            if no.fails and ep.failure is None:
                _fail(ep, Failure("error", no.message))
                st.ends = st.ends or "it failed"
            self._answer(request, no.status, error_body(no.message, code=no.code,
                                                        param=no.param))
            return
        self.ready[j] = (request, want)

    # -------------------------------------------------------------- one request

    def _prepare(self, request: Request, ep: Episode, st: AgentState) -> tuple:
        """The request checked and its observation appended: (the episode's tokens, the
        turn's cap, its seed); or :class:`Refused`."""
        body = request.body
        try:
            cap = max_tokens(body)
            if body.get("stop"):
                raise ValueError("stop sequences are not supported: a turn ends at the "
                                 "model's stop token")
            if request.kind == "chat":
                if self.owner.template is None:
                    raise ValueError("the tokenizer has no chat template (set "
                                     "tokenizer.chat_template), so chat requests cannot be "
                                     "rendered: use /v1/completions")
                said = (chat_messages(body.get("messages")),
                        check_tools(body.get("tools"), "tools"))
            else:
                said = completion_prompt(body.get("prompt"), self.vocab)
        except ValueError as err:
            raise Refused(400, str(err)) from None
        if ep.failure is None and ep.turns and said == st.request:
            restore(ep, st, st.snapshot)  # a retry: the last turn sampled again
        elif st.ends is not None and (ep.failure is not None or not ep.turns):
            raise Refused(400, f"the episode takes no more turns: {st.ends}",
                          "episode_ended")
        elif not ep.turns:
            self._start(ep, st, request.kind, said)
        else:
            if request.kind != st.kind:
                raise Refused(400, f"a {request.kind} request in an episode of {st.kind} "
                                   "requests: an episode is one conversation", fails=True)
            added = self._added(ep, st, said)  # (a rewritten history fails, ended or not)
            if st.ends is not None:
                raise Refused(400, f"the episode takes no more turns: {st.ends}",
                              "episode_ended")
            if ep.turns >= self.agent.max_requests:
                raise Refused(400, f"the episode has had its rollout.agent.max_requests="
                                   f"{self.agent.max_requests} turns", "episode_ended",
                              ends="rollout.agent.max_requests")
            obs = self._observation(ep, st, added)
            if len(ep) + len(obs) >= self.data.max_seq_len:
                raise Refused(400, f"the conversation would pass data.max_seq_len="
                                   f"{self.data.max_seq_len} tokens with room for a turn",
                              "context_length_exceeded", ends="data.max_seq_len")
            ep.tokens += obs
            ep.observation += [1] * len(obs)
            ep.logprobs += [0.0] * len(obs)
            ep.rewards += [0.0] * len(obs)
            ep.obs_tokens += len(obs)
        st.request = said
        st.snapshot = snapshot(ep, st)
        room = self.data.max_seq_len - len(ep)
        turn_cap = min(self.params.max_new_tokens, room, cap or self.params.max_new_tokens)
        return (ep.prompt + ep.tokens, turn_cap,
                derive_seed("turn", self.seed, self.indices[request.episode], ep.turns))

    def _start(self, ep: Episode, st: AgentState, kind: str, said) -> None:
        """The first request: the episode's prompt."""
        tok = self.owner.tokenizer
        if kind == "chat":
            messages, tools = said
            ep.messages, ep.tools = messages, tools
            ep.prompt = tok.encode(self.owner.template.render(
                messages, add_generation_prompt=True, tools=tools))
        else:
            ep.prompt = tok.encode(said) if isinstance(said, str) else list(said)
        st.kind = kind
        if len(ep.prompt) > self.data.max_prompt_len:
            n = len(ep.prompt)
            ep.prompt = []
            raise Refused(400, f"the first prompt is {n} tokens, over data.max_prompt_len="
                               f"{self.data.max_prompt_len}", "context_length_exceeded",
                          fails=True)

    def _added(self, ep: Episode, st: AgentState, said):
        """What a later request adds to the episode - the observation's messages (chat),
        text, or token ids - or :class:`Refused` (failing the episode) when it does not
        extend the episode."""
        if st.kind == "chat":
            messages, tools = said
            last, _ = st.request
            n = len(last)
            if tools == ep.tools and messages[:n] == last and len(messages) > n + 1 \
                    and same_reply(messages[n], st.reply) \
                    and all(m["role"] in OBSERVATION_ROLES for m in messages[n + 1:]):
                return messages[n + 1:]
            raise Refused(400, "the messages do not extend the episode's conversation (the "
                               "messages of the last request, the reply it got, then tool, "
                               "user or system messages, with the same tools), nor repeat "
                               "the last request: an episode is trained as one token "
                               "sequence", "not_an_extension", fails=True)
        if isinstance(said, str) and isinstance(st.said, str) and said.startswith(st.said):
            return said[len(st.said):]
        seq = ep.prompt + ep.tokens
        if isinstance(said, list) and said[:len(seq)] == seq:
            return said[len(seq):]
        raise Refused(400, "the prompt does not extend the episode (the last prompt and the "
                           "completion it got, then more), nor repeat the last request: an "
                           "episode is trained as one token sequence", "not_an_extension",
                      fails=True)

    def _observation(self, ep: Episode, st: AgentState, added) -> list[int]:
        """The tokens of what a request added, after the last turn's stop token: chat
        messages as the template renders them, text encoded, token ids as they are."""
        if st.kind == "chat":
            text, stop_id = st.turn
            try:
                return observation_tokens(self.owner.template, self.owner.tokenizer,
                                          self.owner.pieces, ep, text, stop_id, added)
            except ValueError as err:
                raise Refused(400, str(err), fails=True) from None
        if isinstance(added, str):
            return self.owner.tokenizer.encode(added) if added else []
        return added

    # -------------------------------------------------------------- the answers

    def answer(self, batch: dict, turns: dict) -> None:
        """Each sampled turn appended to its episode and sent to its agent."""
        for j, (request, (seq, _, _)) in batch.items():
            ep, st = self.episodes[j], self.states[j]
            sampled, logprobs = turns[j]
            stopped = _append_turn(ep, sampled, logprobs, self.stops)
            text = self.owner.tokenizer.decode(sampled[:-1] if stopped else sampled)
            st.turn = (text, sampled[-1] if sampled else None)
            if not stopped:
                st.ends = "its last turn ended without a stop token (max_tokens, " \
                          "rollout.max_new_tokens or data.max_seq_len)"
            finish = "stop" if stopped else "length"
            if request.kind == "chat":
                message = {"role": "assistant", "content": text}
                st.reply = {"role": "assistant", "content": text}
                fmt = self.agent.tool_format
                if fmt is not None and stopped and request.body.get("tools"):
                    try:
                        content, calls = parse_tool_calls(text, fmt)
                    except ToolCallError:
                        ep.tool_errors += 1
                        calls = []
                    if calls:
                        entries = [c.message_entry() for c in calls]
                        st.reply = {"role": "assistant", "content": content,
                                    "tool_calls": entries}
                        message = {"role": "assistant", "content": content or None,
                                   "tool_calls": [
                                       {"id": f"call_{ep.turns}_{i}", "type": "function",
                                        "function": {"name": c.name,
                                                     "arguments": json.dumps(c.arguments)}}
                                       for i, c in enumerate(calls)]}
                        finish = "tool_calls"
                choice = {"index": 0, "message": message, "finish_reason": finish,
                          "logprobs": {"content": self._logprobs(sampled, logprobs)}
                          if request.body.get("logprobs") else None}
                body = {"id": f"chatcmpl-{st.key[:8]}-{ep.turns}",
                        "object": "chat.completion"}
            else:
                st.said = (st.request + text) if isinstance(st.request, str) else None
                wanted = request.body.get("logprobs") not in (None, False)
                choice = {"index": 0, "text": text, "finish_reason": finish,
                          "logprobs": self._completion_logprobs(sampled, logprobs)
                          if wanted else None}
                body = {"id": f"cmpl-{st.key[:8]}-{ep.turns}", "object": "text_completion"}
            choice["token_ids"] = sampled
            body.update(created=int(time.time()), model=self.agent.model_name,
                        choices=[choice], prompt_token_ids=seq,
                        usage={"prompt_tokens": len(seq), "completion_tokens": len(sampled),
                               "total_tokens": len(seq) + len(sampled)})
            self._answer(request, 200, body)

    def _piece(self, token: int) -> str:
        return self.owner.tokenizer.decode([token]) or self.owner.pieces[token]

    def _logprobs(self, sampled: list[int], logprobs: list[float]) -> list[dict]:
        out = []
        for token, lp in zip(sampled, logprobs):
            piece = self._piece(token)
            out.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                        "top_logprobs": []})
        return out

    def _completion_logprobs(self, sampled: list[int], logprobs: list[float]) -> dict:
        pieces = [self._piece(t) for t in sampled]
        offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None,
                "text_offset": offsets}

    # -------------------------------------------------------------- the end

    def stop(self) -> None:
        """Every agent ended (killed if still running) and every request answered."""
        for st in self.states:
            st.proc.kill(Failure("error", "the rollout ended before the agent did"))
        self.server.open({})
        for request, _ in self.ready.values():
            self._answer(request, 404, error_body("the rollout has ended",
                                                  code="episode_not_found"))
        self.ready = {}
        while True:
            try:
                request = self.server.requests.get_nowait()
            except queue.Empty:
                break
            if not request.answer.done():
                request.answer.set_result((404, error_body("the rollout has ended",
                                                           code="episode_not_found")))

    def finish(self, pad_id: int) -> list[Episode]:
        """The episodes with their rewards: the agents', else the verifier's."""
        unscored = []
        for ep, st in zip(self.episodes, self.states):
            result = st.proc.result
            if ep.failure is None and isinstance(result, Failure):
                _fail(ep, result)
            elif ep.failure is None and not ep.turns:
                _fail(ep, Failure("error", "the agent ended without a request to the model"))
            elif ep.failure is None and result is None:
                if self.owner.score_with is None:
                    _fail(ep, Failure("error", "the agent returned no reward (null) and "
                                               "neither rollout.rewards.fn nor "
                                               "rollout.rewards.url is set to score it"))
                else:
                    unscored.append(ep)
            elif ep.failure is None:
                ep.rewards[_last_model_token(ep)] += result
            if ep.failure is None:
                ep.env_done = True
            ep.done = True
            if not ep.prompt:
                ep.prompt = [pad_id]
        if unscored:
            decode = self.owner.tokenizer.decode
            pairs = []
            for ep in unscored:
                last = _last_turn(ep)
                if ep.stopped:
                    last = last[:-1]
                pairs.append((decode(ep.prompt), decode(last)))
            for ep, value in zip(unscored, self.owner.score(pairs)):
                if isinstance(value, Failure):
                    _fail(ep, value)
                    ep.env_done = False
                else:
                    ep.rewards[_last_model_token(ep)] += value
        return self.episodes


def _last_model_token(ep: Episode) -> int:
    return max(t for t in range(len(ep.tokens)) if ep.observation[t] == 0)


def _last_turn(ep: Episode) -> list[int]:
    """The model's tokens of the episode's last turn."""
    end = _last_model_token(ep) + 1
    start = end
    while start > 0 and ep.observation[start - 1] == 0:
        start -= 1
    return ep.tokens[start:end]


def episode_sampler(r: RolloutConfig, data: DataConfig, tokenizer):
    """The rollout's multi-turn sampler: an environment's, an agent's, or None (prompts)."""
    from megarlhf.rollout.episodes import Episodes

    if r.environment.name:
        return Episodes(r.environment, r.rewards, data, tokenizer)
    if r.agent.enabled:
        return AgentEpisodes(r, data, tokenizer)
    return None
