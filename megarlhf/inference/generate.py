"""Batched, KV-cached sampling on a megatron ``GPTModel`` (inference layout, no PP).

Our own loop (megatron's engines need CUDA events); it runs on CPU and GPU alike. The keys
and values are cached by megatron's ``StaticInferenceContext`` (or, where it applies, the
fixed-shape decoder of :mod:`megarlhf.inference.static_kv`). Prompts are left-padded so
every response starts at the same column; pad positions are masked out of attention and
position ids count real tokens only. The returned log-probs are those of the sampled tokens under
softmax(logits / temperature) - before top-k/top-p filtering - which is what the training
side recomputes, so the two can be compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megarlhf.inference import static_kv
from megarlhf.inference.kv_cache import kv_cache_bytes
from megarlhf.models import moe
from megarlhf.models.gpt import unwrap
from megarlhf import speedups
from megarlhf.speedups import compiled_decode, decode_graphs
from megarlhf.speedups.shared_prefill import groups as prefill_groups
from megarlhf.speedups.shared_prefill import spread as spread_prefill

_NEG = -1e30


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()  # ends a response (EOS is added when stop_at_eos)
    stop_at_eos: bool = True  # EOS ends a response (false: sample to max_new_tokens)


@dataclass
class Generation:
    """(B, P) left-padded prompts and (B, T) right-padded responses.

    The masks mean one thing each, here and in :class:`megarlhf.algos.Experience`:
    ``fed_mask_BT`` is every response token the model was fed or sampled (a multi-turn
    episode's environment tokens too), ``model_mask_BT()`` the ones it sampled - what an
    experience batch trains on, its ``response_mask_BT``."""

    prompt_tokens_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    response_tokens_BT: torch.Tensor
    fed_mask_BT: torch.Tensor  # 1 on the response's tokens (stop token included)
    logprobs_BT: torch.Tensor  # of the sampled tokens under softmax(logits / temperature)
    finished_B: torch.Tensor  # ended with a stop token
    # a mixture of experts' choices (rows, layers, the P + T columns, top_k), when recorded
    routing_BLSK: torch.Tensor | None = None
    # the policy version that sampled each response token (0 on padding), when recorded:
    # see rollout.schedule
    versions_BT: torch.Tensor | None = None
    # multi-turn rollouts (rollout.environment.name, ``rollout.episodes``): 1 on the response
    # tokens the environment wrote (observations, as the chat template renders them; fed,
    # never trained), and each turn's reward at that turn's last model token
    observation_BT: torch.Tensor | None = None
    env_rewards_BT: torch.Tensor | None = None

    def model_mask_BT(self) -> torch.Tensor:
        """1 on the tokens the model sampled (the response but an environment's tokens)."""
        if self.observation_BT is None:
            return self.fed_mask_BT
        return self.fed_mask_BT * (1 - self.observation_BT.to(self.fed_mask_BT.dtype))

    def episode_rewards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-turn: (B,) the last turn's reward (the score, at the last model token) and
        (B, T) the earlier turns' rewards where they fell."""
        model = self.model_mask_BT()
        T = model.shape[1]
        last = T - 1 - model.flip(-1).to(torch.int8).argmax(dim=-1)
        last = torch.where(model.any(dim=-1), last, torch.zeros_like(last))
        rows = torch.arange(model.shape[0])
        scores = self.env_rewards_BT[rows, last].clone()
        turns = self.env_rewards_BT.clone()
        turns[rows, last] = 0.0
        return scores, turns

    def state_dict(self) -> dict:
        """The fields as plain tensors (or None): what a checkpoint or the split job's
        bridge carries, loaded with ``weights_only``; :meth:`from_state` rebuilds it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> "Generation":
        """:meth:`state_dict`'s output back (a checkpoint's waiting batches written before
        ``fed_mask_BT`` was named so carry it as ``response_mask_BT``)."""
        state = dict(state)
        if "response_mask_BT" in state:
            state["fed_mask_BT"] = state.pop("response_mask_BT")
        return cls(**state)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        tokens[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return tokens, mask


def filter_logits(logits_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability reaches
    ``top_p`` (the most likely token always survives); the rest get a large negative."""
    out = logits_BV
    if top_k and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, _NEG)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, _NEG)
    return out


def _attention_blocked(key_mask_BK: torch.Tensor, num_queries: int) -> torch.Tensor:
    """(B, 1, Q, K) bool, True where a query may not look: padding keys, and (for several
    queries) keys in the future."""
    B, K = key_mask_BK.shape
    blocked = (key_mask_BK == 0).view(B, 1, 1, K).expand(B, 1, num_queries, K)
    if num_queries > 1:
        causal = torch.ones(num_queries, K, dtype=torch.bool,
                            device=key_mask_BK.device).tril(K - num_queries)
        blocked = blocked | ~causal.view(1, 1, num_queries, K)
    return blocked


class SeededDraws:
    """Uniform draws for the Gumbel-max sampler, one generator per sequence seeded with its
    seed, one (V,) draw per token the sequence samples - whichever step or slot it samples
    in. Each generator draws ``chunk`` tokens' worth at once: on the CPU ``rand(chunk, V)``
    is the same stream as ``chunk`` calls of ``rand(V)``, so the samples are those of
    per-token draws, with one call every ``chunk`` tokens instead of every token."""

    def __init__(self, seeds: list[int], vocab: int, device, chunk: int = 8):
        self.gens = [torch.Generator(device).manual_seed(int(s)) for s in seeds]
        self.vocab, self.device, self.chunk = vocab, device, chunk
        self.blocks: dict[int, torch.Tensor] = {}
        self.used = [chunk] * len(seeds)

    def next(self, rows: list[int]) -> torch.Tensor:
        """(len(rows), V): the next draw of each of the sequences ``rows``."""
        out = []
        for i in rows:
            if self.used[i] == self.chunk:
                self.blocks[i] = torch.rand(self.chunk, self.vocab, generator=self.gens[i],
                                            device=self.device)
                self.used[i] = 0
            out.append(self.blocks[i][self.used[i]])
            self.used[i] += 1
        return torch.stack(out)


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, *,
                draw: Callable[[], torch.Tensor] | None = None,
                generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step of both decode loops: the next token of each row from its logits
    at ``params.temperature`` - the argmax (greedy), else from the top-k / top-p tokens by
    the Gumbel-max trick on ``draw()``'s uniforms (per-sequence seeds, :class:`SeededDraws`)
    or by ``torch.multinomial`` with ``generator`` - and its log-prob at the temperature
    over the whole vocabulary. Returns ((B,) tokens, (B,) log-probs)."""
    scaled = logits_BV / params.temperature if params.temperature != 1.0 else logits_BV
    if params.greedy:
        token = scaled.argmax(dim=-1)
    else:
        filtered = filter_logits(scaled, params.top_k, params.top_p)
        if draw is not None:
            gumbel = -torch.log(-torch.log(draw().clamp(1e-20, 1.0 - 1e-7)))
            token = (filtered + gumbel).argmax(dim=-1)
        else:
            probs = torch.softmax(filtered, dim=-1)
            if generator is not None and generator.device != logits_BV.device:
                probs = probs.to(generator.device)  # a host generator draws on the host
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            token = token.to(logits_BV.device)
    logprob = torch.log_softmax(scaled, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return token, logprob


def stop_tensor(params: SamplingParams, eos_id: int, device
                ) -> torch.Tensor:
    """The tokens that end a response: ``params.stop_token_ids``, and EOS with
    ``params.stop_at_eos``."""
    stops = set(params.stop_token_ids) | ({eos_id} if params.stop_at_eos else set())
    return torch.tensor(sorted(stops), dtype=torch.long, device=device)


@torch.no_grad()
def generate(model, prompts: list[list[int]], params: SamplingParams, *, eos_id: int,
             pad_id: int, true_vocab: int, generator: torch.Generator | None = None,
             row_seeds: list[int] | None = None, use_cache: bool = True, stats: dict | None = None,
             record_routing: bool = False, interrupt: Callable[[], bool] | None = None,
             recompute_kv: bool = True, static_cache: bool | None = None,
             shared_prefill: bool | None = None) -> Generation:
    """Sample up to ``max_new_tokens`` per prompt. Every TP rank of one replica must pass
    the same prompts and an identically seeded ``generator``.

    With ``row_seeds`` each row samples by the Gumbel-max trick from its own generator, so
    a prompt's response depends on its seed only - not on which replica, batch or layout
    generated it (PPO runs at different layouts then see the same samples). The row
    generators live on the model's device: the CPU and CUDA draw different streams, so
    samples are reproducible per device type. Everything runs on the model's device;
    the returned tensors are on the host. ``stats`` receives ``kv_cache_bytes`` and
    ``decode_slots`` / ``idle_decode_slots``: the rows fed at each decode step, and how many
    of them had already stopped (a long tail's cost in a static batch), and
    ``shared_prefills``: the rows whose prompt's prefill was another row's, copied.
    ``use_cache=False`` recomputes the whole sequence every step (a reference for tests).
    ``record_routing``: a mixture of experts' choice of experts for every token fed, in
    ``routing_BLSK`` (the column layout of prompt and response).

    ``interrupt`` (partial rollouts, ``rollout.placement.partial``) is called between decode steps;
    True means it has written new weights into ``model``, which then sample the tokens
    that follow. The keys and values of the columns already fed are recomputed by the new
    weights (``recompute_kv``: one prefill of the whole batch) or kept. ``versions_BT``
    then counts the swaps before each token (0: the weights the generation started with);
    without ``interrupt`` it is None.

    ``static_cache``: decode on :class:`~megarlhf.inference.static_kv.StaticDecoder` (a
    KV cache of fixed shape; on CUDA its step replays a CUDA graph) instead of megatron's
    ``StaticInferenceContext``. None: where ``speedups.decode_graphs`` applies (CUDA) and
    the model and options allow it (no routing record, no ``interrupt``).

    ``shared_prefill``: rows with the same prompt prefill it once and copy its keys and
    values (:mod:`megarlhf.speedups.shared_prefill`; on either KV cache). None: where
    that speed-up is on."""
    device = next(model.parameters()).device
    prompt_tokens, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    B, P = prompt_tokens.shape
    T = params.max_new_tokens
    stops = stop_tensor(params, eos_id, device)
    feed = _Feed(model, prompt_tokens, prompt_mask, T, pad_id=pad_id, true_vocab=true_vocab,
                 use_cache=use_cache, static_cache=static_cache,
                 record_routing=record_routing, interrupt=interrupt,
                 shared_prefill=speedups.enabled("shared_prefill")
                 if shared_prefill is None else shared_prefill)
    response = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    response_mask = torch.zeros(B, T, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, T, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    row_draws = SeededDraws(row_seeds, true_vocab, device) if row_seeds else None
    every_row = list(range(B))
    draw = (lambda: row_draws.next(every_row)) if row_draws is not None else None
    try:
        logits = feed.logits(P, P)
        # decode steps, and the stopped rows fed in them
        steps, idle = 0, torch.zeros((), dtype=torch.long, device=device)
        swaps = 0
        versions = torch.zeros(B, T, dtype=torch.long) if interrupt is not None else None
        for t in range(T):
            next_token, token_logprob = sample_next(logits, params, draw=draw,
                                                    generator=generator)
            active = ~finished
            next_token = next_token.masked_fill(finished, pad_id)
            response[:, t] = next_token
            response_mask[:, t] = active  # (the bool is copied into the long tensors as 0/1)
            logprobs[:, t] = token_logprob.masked_fill(finished, 0.0)
            if versions is not None:
                versions[:, t] = swaps
            finished = finished | (active & torch.isin(next_token, stops))
            if finished.all() or t == T - 1:
                break
            idle += finished.sum()  # rows fed this step that have stopped (no host sync)
            steps += 1
            col = P + t
            feed.tokens[:, col] = next_token
            feed.key_mask[:, col] = active
            if interrupt is not None and interrupt():
                swaps += 1
                if feed.ctx is not None and recompute_kv:  # the new weights' keys and values
                    feed.ctx = StaticInferenceContext(B, P + T)
                    logits = feed.logits(col + 1, col + 1)
                    continue
            logits = feed.logits(col + 1, 1 if feed.cached else col + 1)
        if stats is not None:
            stats["kv_cache_bytes"] = feed.cache_bytes()
            stats["decode_slots"], stats["idle_decode_slots"] = B * steps, int(idle)
            stats["shared_prefills"] = feed.shared_prefills
        # responses as wide as the longest one: when every row stopped early, the passes and
        # the training that follow pay nothing for the columns no row reached
        width = t + 1
        routing = feed.routing
        return Generation(*(x.cpu() for x in (prompt_tokens, prompt_mask, response[:, :width],
                                              response_mask[:, :width], logprobs[:, :width],
                                              finished)),
                          routing_BLSK=routing[:, :, :P + width]
                          if routing is not None else None,
                          versions_BT=versions[:, :width] * response_mask[:, :width].cpu()
                          if versions is not None else None)
    finally:
        feed.close()


class _Feed:
    """What :func:`generate` feeds the model: the batch's columns (left-padded prompts,
    then the response's), their key mask and position ids, and the state that caches the
    columns fed - megatron's ``StaticInferenceContext``, the static decoder, or nothing
    (``use_cache=False``: every step feeds the whole sequence) - with the experts each
    token chose, when recorded."""

    def __init__(self, model, prompt_tokens: torch.Tensor, prompt_mask: torch.Tensor, T: int,
                 *, pad_id: int, true_vocab: int, use_cache: bool, static_cache: bool | None,
                 record_routing: bool, interrupt, shared_prefill: bool):
        device = prompt_tokens.device
        B, P = prompt_tokens.shape
        self.model, self.pad_id, self.true_vocab, self.B = model, pad_id, true_vocab, B
        step = _static_step(model, device, static_cache, use_cache=use_cache,
                            record_routing=record_routing, interrupt=interrupt)
        self.tokens = torch.cat([prompt_tokens, torch.full((B, T), pad_id, dtype=torch.long,
                                                           device=device)], dim=1)
        self.key_mask = torch.cat([prompt_mask, torch.zeros(B, T, dtype=torch.long,
                                                            device=device)], dim=1)
        # Position ids count real tokens only: prompt tokens 0..n-1, then n, n+1, ...
        self.positions = torch.cat([(prompt_mask.cumsum(dim=1) - 1).clamp(min=0),
                                    prompt_mask.sum(dim=1, keepdim=True)
                                    + torch.arange(T, device=device)], dim=1)
        self.static = None if step is None else \
            _static_decoder(model, self.key_mask, true_vocab, step)
        self.ctx = StaticInferenceContext(B, P + T) if use_cache and self.static is None \
            else None
        # rows with the same prompt share its prefill (their first pass)
        self.shared = prefill_groups(prompt_tokens, prompt_mask) \
            if (self.ctx is not None or self.static is not None) and shared_prefill else None
        self.shared_prefills = 0 if self.shared is None else B - len(self.shared.rows)
        self.config = unwrap(model).config
        # a token never fed (the last sampled one) keeps experts 0..k-1: distinct, never read
        self.routing = moe.unrouted(B, self.config.num_layers, P + T,
                                    self.config.moe_router_topk or 1) \
            if record_routing else None

    @property
    def cached(self) -> bool:
        """Whether a step feeds only its new column (the rest is cached)."""
        return self.ctx is not None or self.static is not None

    def logits(self, length: int, new: int) -> torch.Tensor:
        """Logits at column ``length - 1`` after feeding the last ``new`` columns."""
        start = length - new
        inp = self.tokens[:, start:length].masked_fill(self.key_mask[:, start:length] == 0,
                                                       self.pad_id)
        pos = self.positions[:, start:length]
        blocked = _attention_blocked(self.key_mask[:, :length], new)
        shared, self.shared = self.shared, None  # the first prefill only
        if shared is not None:  # one row per distinct prompt; the others copy its cache
            inp, pos, blocked = inp[shared.rows], pos[shared.rows], blocked[shared.rows]
        # logits at the last column only (the prefill's other P - 1 are never read)
        if self.static is not None:
            if new == 1:
                return self.static.step(inp[:, 0], pos[:, 0], start)
            logits = self.static.prefill(inp, pos, blocked)
            if shared is None:
                return logits
            self.static.spread(shared.owner, length)
            return logits[shared.owner]
        routing, model, ctx = self.routing, self.model, self.ctx
        with moe.recording(model) if routing is not None else contextlib.nullcontext() as got:
            if ctx is None:
                out = model(inp, pos, blocked, runtime_gather_output=True,
                            positions=slice(-1, None))
            else:
                out = model(inp, pos, blocked, inference_context=ctx,
                            runtime_gather_output=True, positions=slice(-1, None))
                ctx.sequence_len_offset += new
                ctx.enable_decode_mode()
            if routing is not None:
                chosen = moe.routing_of(got(), inp.shape[0], new, self.config.num_layers,
                                        routing.shape[-1])
                routing[:, :, start:length] = chosen if shared is None \
                    else chosen[shared.owner.cpu()]
        logits = out[:, -1, :self.true_vocab].float()
        if shared is None:
            return logits
        spread_prefill(ctx, shared.owner, length)
        return logits[shared.owner]

    def cache_bytes(self) -> int:
        return kv_cache_bytes(self.ctx) if self.ctx is not None else \
            self.static.cache_bytes() if self.static is not None else 0

    def close(self) -> None:
        if self.static is not None:  # the layers decode without it again
            self.static.close()


def _static_step(model, device: torch.device, wanted: bool | None, *, use_cache: bool,
                 record_routing: bool, interrupt) -> str | None:
    """How ``generate`` decodes on the fixed-shape cache: ``"graphs"`` (a CUDA graph,
    ``speedups.decode_graphs``), ``"compiled"`` (``speedups.compiled_decode``, the CPU),
    ``"eager"``, or None for megatron's context. ``wanted`` None: where one of the two
    speed-ups applies, for a plain cached generation of a model the static cache
    supports."""
    step = "graphs" if decode_graphs.applies(device) else \
        "compiled" if compiled_decode.applies(device) else "eager"
    plain = use_cache and not record_routing and interrupt is None
    if wanted is None:
        wanted = step != "eager" and plain and static_kv.unsupported(model) is None
    if not wanted:
        return None
    if not plain:
        raise ValueError("static_cache=True decodes on a KV cache, without a routing record "
                         "or an interrupt")
    return step


def _static_decoder(model, key_mask: torch.Tensor, true_vocab: int,
                    step: str) -> static_kv.StaticDecoder:
    """The fixed-shape decoder of :func:`_static_step`'s choice ``step``."""
    decoder = static_kv.StaticDecoder(model, key_mask, true_vocab)
    if step == "graphs":
        decode_graphs.capture(decoder)
    elif step == "compiled":
        compiled_decode.attach(decoder)
    return decoder
