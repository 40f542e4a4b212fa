"""Forward steps in megatron's contract, ``forward_step(data_iterator, model) ->
(output, loss_func)``, shared by every role.

A micro-batch is a dict of tensors: ``tokens`` (B, T), ``position_ids`` (B, T) and an
optional megatron-style ``attention_mask`` (B, 1, T, T), True where attention is blocked.
"""

from __future__ import annotations

import torch

from megarlhf.config import PPOConfig
from megarlhf.data.packing import unpack
from megarlhf.engine.schedule import lengthen
from megarlhf.models import moe
from megarlhf.models.gpt import unwrap
from megarlhf.models.logprobs import head_logprobs
from megarlhf.models.spec import packed_attention_refusal
from megarlhf.parallel import context, cpu_backend
from megarlhf.parallel.gather import gather_objects


def model_forward(model, batch: dict, positions: slice | torch.Tensor | None = None, *,
                  hidden: bool = False):
    """``model`` on one micro-batch, its outputs (logits or values) at sequence
    ``positions`` only (all when None; see ``models.gpt.RoleModel``). A packed micro-batch
    (``cu_seqlens``, ``data.packing``) runs in megatron-core's THD format. A
    mixture of experts routes as the batch says: ``routing`` is replayed; otherwise the
    experts this pass chooses are compared with ``rollout_routing`` and, with
    ``routing_rows`` (the batch's row indices), kept (``models.moe``). Under sequence
    parallelism the model runs the micro-batch lengthened to a multiple of TP and the last
    stage returns the outputs of its own positions. ``hidden``: an LM's last stage returns
    the head's input instead of the logits, for :func:`token_logprobs` (the head applied a
    chunk of positions at a time)."""
    core = unwrap(model)
    if hidden:
        with core.hidden_out():
            return model_forward(model, batch, positions)
    length = batch["tokens"].shape[1]
    split = core.config.tensor_model_parallel_size if core.config.sequence_parallel else 1
    if core.config.context_parallel_size > 1:
        return _context_parallel_forward(model, batch, positions, 2 * split)
    if length % split:
        batch = lengthen(batch, length + split - length % split)
        if isinstance(positions, slice):  # in the micro-batch's own length
            positions = slice(*positions.indices(length))
        out = _model_forward(model, batch, positions, length)
        return out[:, :length] if positions is None and core.post_process else out
    return _model_forward(model, batch, positions, length)


def _context_parallel_forward(model, batch: dict, positions, unit: int):
    """:func:`model_forward` under context parallelism (``parallel.context``): this CP
    rank runs its part of each sequence - the micro-batch lengthened to a multiple of
    ``unit`` x CP (a packed one sample by sample, each sample's padding after it), then
    chunks ``cp_rank`` and ``2 CP - 1 - cp_rank`` - and the last stage puts the outputs
    back together on every CP rank, in the micro-batch's own positions, before taking
    ``positions``. A mixture of experts replays the routing of this rank's positions, and
    the experts its pass chooses are gathered back into the whole micro-batch's."""
    core = unwrap(model)
    group = core.pg_collection.cp
    cp, rank = group.size(), group.rank()
    step = unit * cp
    length = batch["tokens"].shape[1]
    if "cu_seqlens" in batch:  # one row of samples back to back
        place, parts, bounds = context.packed_split(batch["cu_seqlens"].tolist(), cp, step)
        whole = {key: batch[key].new_zeros(1, bounds[-1]).index_copy_(1, place, batch[key])
                 for key in ("tokens", "position_ids")}
        mine = {key: value.index_select(1, parts[rank]) for key, value in whole.items()}
        mine["cu_seqlens"] = torch.tensor(bounds, dtype=batch["cu_seqlens"].dtype)
        if "routing" in batch:
            mine["routing"] = moe.spread(batch["routing"], place, bounds[-1]) \
                .index_select(2, parts[rank])
        stacked = torch.cat(parts)

        def whole_routing(idx):  # (n, k): this rank's positions -> the row's own
            return context.gather_sequence(idx, 0, group, stacked).index_select(0, place)

        out = _model_forward(model, {**_routing_keys(batch), **mine}, None, length,
                             whole_routing)
        if not core.post_process:
            return out
        out = context.gather_sequence(out, 1, group, stacked).index_select(1, place)
    else:
        from megatron.core.utils import get_batch_on_this_cp_rank
        padded = lengthen(batch, -(-length // step) * step)
        # megatron's split (the mask: this rank's query rows over every key)
        mine = get_batch_on_this_cp_rank({key: padded.get(key) for key in
                                          ("tokens", "position_ids", "attention_mask")},
                                         cp_group=group)
        if "routing" in batch:
            mine["routing"] = padded["routing"].index_select(
                2, context.chunk_positions(padded["tokens"].shape[1], cp, rank))
        rows = batch["tokens"].shape[0]

        def whole_routing(idx):  # (s x rows, k) in (sequence, row) order -> the whole's
            local = idx.view(-1, rows, idx.shape[-1])
            return context.gather_sequence(local, 0, group).reshape(-1, idx.shape[-1])

        out = _model_forward(model, {**_routing_keys(batch), **mine}, None, length,
                             whole_routing)
        if not core.post_process:
            return out
        out = context.gather_sequence(out, 1, group)[:, :length]
    return out if positions is None else out[:, positions]


def _routing_keys(batch: dict) -> dict:
    """What a pass that records its experts reads besides the model's inputs."""
    return {key: batch[key] for key in ("rollout_routing", "rollout_routing_mask",
                                        "routing_rows", "source") if key in batch}


def _model_forward(model, batch: dict, positions, length: int, whole_routing=None):
    """The model on ``batch`` (``length``: the micro-batch's own length). ``whole_routing``
    (context parallelism): this rank's recorded experts of one layer -> the whole
    micro-batch's, in (sequence, row) order."""
    with cpu_backend.suspended():
        mask, extra = attention_inputs(model, batch)
        if "rollout_routing" in batch or "routing_rows" in batch:
            with moe.recording(model) as got:
                out = model(batch["tokens"], batch["position_ids"], mask, positions=positions,
                            **extra)
                recorded = got()
                if whole_routing is not None:
                    recorded = {layer: whole_routing(idx) for layer, idx in recorded.items()}
                if "source" not in batch:  # padded: the micro-batch's own positions
                    rows = batch["tokens"].shape[0]
                    recorded = {layer: idx[:length * rows] for layer, idx in recorded.items()}
                else:  # packed: into the padded layout of its rows
                    B, _, S, k = batch["rollout_routing"].shape
                    recorded = moe.from_packed(recorded, batch["source"], B, S, k)
                if "rollout_routing" in batch:
                    moe.count_mismatch(recorded, batch["rollout_routing"],
                                       batch["rollout_routing_mask"])
                if "routing_rows" in batch:
                    moe.keep_routing(batch["routing_rows"], recorded)
            return out
        with moe.replaying(model, batch.get("routing")):
            return model(batch["tokens"], batch["position_ids"], mask, positions=positions,
                         **extra)


def attention_inputs(model, batch: dict) -> tuple[torch.Tensor | None, dict]:
    """(attention mask, extra forward arguments) of a micro-batch: its own mask, or for a
    packed one (``cu_seqlens``, ``data.packing``) megatron-core's ``PackedSeqParams`` in
    the THD format: rotary positions restart at each sample and attention stays within it
    (TransformerEngine's attention, or ``models.spec.SDPACoreAttention``)."""
    if "cu_seqlens" not in batch:
        return batch.get("attention_mask"), {}
    config = unwrap(model).config
    refusal = packed_attention_refusal(config.transformer_impl, config.params_dtype)
    if refusal:
        raise ValueError(refusal)
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = batch["cu_seqlens"].to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return None, {"packed_seq_params": PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
        max_seqlen_kv=longest)}


def token_logprobs(model, out: torch.Tensor, target: torch.Tensor, *, tp_group,
                   true_vocab: int | None, temperature: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of ``target`` from an LM's last-stage output, the head's input
    (``model_forward(..., hidden=True)``): the head's logits made a chunk of positions at a
    time (``models.logprobs.head_logprobs``)."""
    return head_logprobs(out, unwrap(model).head_weight(), target, tp_group=tp_group,
                         temperature=temperature, true_vocab=true_vocab)


def make_score_step(role: str, *, tp_group, true_vocab: int, temperature: float = 1.0):
    """Forward-only step returning per-token log-probs and entropy of ``tokens[:, 1:]``
    (role ``lm``) or per-token values (role ``value``) from the last stage."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model_forward(model, batch, hidden=True)

        def loss_func(output_tensor, non_loss_data=True):
            if role == "value":
                return {"values": output_tensor.squeeze(-1).float()}  # (B, T)
            logprobs_BT, entropy_BT = token_logprobs(
                model, output_tensor[:, :-1], batch["tokens"][:, 1:], tp_group=tp_group,
                temperature=temperature, true_vocab=true_vocab)
            return {"logprobs": logprobs_BT, "entropy": entropy_BT}

        return output, loss_func

    return forward_step


def weighted_logprobs(model, out, batch: dict, *, tp_group, true_vocab: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, weights) of the next tokens a supervised loss reads, (B, S - 1) each of
    a padded micro-batch (``loss_mask`` weighs each position), or of a packed one
    (``data.packing.pack_weighted``) the kept outputs in its (B, width) ``grid``: a row's
    weighted sum is the same either way. ``out`` as :func:`token_logprobs` takes it."""
    if "keep" in batch:
        logprobs, _ = token_logprobs(model, out, batch["targets"], tp_group=tp_group,
                                     true_vocab=true_vocab)
        return unpack(logprobs, batch), batch["loss_mask"]
    logprobs, _ = token_logprobs(model, out[:, :-1], batch["tokens"][:, 1:], tp_group=tp_group,
                                 true_vocab=true_vocab)
    return logprobs, batch["loss_mask"][:, :-1]


def make_lm_loss_step(*, tp_group, true_vocab: int):
    """Next-token loss weighted by ``loss_mask`` (SFT: response tokens only), padded or
    packed. The loss function returns (sum, number of tokens, logs) so megatron divides by
    the token count over every micro-batch and data-parallel rank."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model_forward(model, batch, batch.get("keep"), hidden=True)

        def loss_func(hidden, non_loss_data=False):
            logprobs_BS, weights = weighted_logprobs(model, hidden, batch, tp_group=tp_group,
                                                     true_vocab=true_vocab)
            loss_sum = -(logprobs_BS * weights).sum()
            num_tokens = weights.sum()
            logs = {"loss_sum": loss_sum.detach(), "tokens": num_tokens}
            return loss_sum, num_tokens.to(torch.int), logs

        return output, loss_func

    return forward_step


def make_pairwise_rm_step():
    """Bradley-Terry loss -log sigmoid(r_chosen - r_rejected); rows alternate chosen,
    rejected; the reward is the value head's output at each row's last real token
    (``last_index``, or packed, ``data.packing.pack_rows`` keeping only it)."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        packed = "keep" in batch
        output = model_forward(model, batch, batch["keep"] if packed else None)

        def loss_func(values_BS1, non_loss_data=False):
            if packed:  # (1, K, 1): each row's one kept output in column 0 of its grid
                rewards_B = unpack(values_BS1[..., 0].float(), batch)[:, 0]
            else:
                rows = torch.arange(values_BS1.shape[0], device=values_BS1.device)
                rewards_B = values_BS1[rows, batch["last_index"], 0].float()
            chosen, rejected = rewards_B[0::2], rewards_B[1::2]
            real = batch["pair_mask"].float()  # 0 for padding pairs in a short micro-batch
            loss_sum = -(torch.nn.functional.logsigmoid(chosen - rejected) * real).sum()
            num_pairs = real.sum()
            correct = ((chosen > rejected).float() * real).sum()
            logs = {"loss_sum": loss_sum.detach(), "pairs": num_pairs,
                    "correct": correct.detach(),
                    "margin_sum": ((chosen - rejected).detach() * real).sum()}
            return loss_sum, num_pairs.to(torch.int), logs

        return output, loss_func

    return forward_step


def reduce_logs(logs: list[dict], layout) -> dict[str, float]:
    """Sum named per-micro-batch numbers over micro-batches and data-parallel replicas;
    every rank gets the totals. Only the last pipeline stage's TP rank 0 of each replica
    contributes (the other ranks hold no logs, or copies)."""
    local: dict[str, float] = {}
    if layout.writes_results:
        for entry in logs:
            for key, value in entry.items():
                local[key] = local.get(key, 0.0) + float(value)
    total: dict[str, float] = {}
    for part in gather_objects(local):
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def ratio(totals: dict[str, float], num: str, den: str) -> float:
    """``totals[num] / totals[den]`` (0 when nothing was counted)."""
    den_value = totals.get(den, 0.0)
    return totals.get(num, 0.0) / den_value if den_value else 0.0


def make_sequence_step(kind: str, *, prompt_len: int, tp_group=None, true_vocab: int = 0,
                       temperature: float = 1.0):
    """Forward-only step over prompt+response batches (prompts left-padded to
    ``prompt_len``, or packed, ``data.packing``): per response token, log-probs and entropy
    (``lm``) or the values of the states before each token and the value at
    ``last_index`` (``value``), as (B, T) tensors either way."""
    P = prompt_len
    # outputs at the positions that predict the response (and for a value model, the
    # last one, which sees the whole response), nowhere else
    response_positions = slice(P - 1, -1) if kind == "lm" else slice(P - 1, None)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        packed = "keep" in batch
        output = model_forward(model, batch, batch["keep"] if packed else response_positions,
                               hidden=True)

        def loss_func(out, non_loss_data=True):
            if kind == "value" and packed:  # out: (1, K, 1)
                return {"values": unpack(out[..., 0].float(), batch),
                        "last": out[0, batch["last_keep"], 0].float()}
            if kind == "value":  # out: (B, T + 1, 1), positions P - 1 .. S - 1
                rows = torch.arange(out.shape[0], device=out.device)
                return {"values": out[:, :-1, 0].float(),
                        "last": out[rows, batch["last_index"] - (P - 1), 0].float()}
            logprobs, entropy = token_logprobs(
                model, out, batch["targets"] if packed else batch["tokens"][:, P:],
                tp_group=tp_group, temperature=temperature, true_vocab=true_vocab)
            if packed:
                logprobs, entropy = unpack(logprobs, batch), unpack(entropy, batch)
            return {"logprobs": logprobs, "entropy": entropy}

        return output, loss_func

    return forward_step


def make_policy_step(*, prompt_len: int, tp_group, true_vocab: int, temperature: float,
                     ppo: PPOConfig):
    """The actor's loss on experience micro-batches, as ``ppo`` (the PPOConfig) selects:

    - the clipped surrogate (``policy_loss=ppo``; truncated importance weights of the
      rollout/training correction in ``is_weights``), or AReaL's decoupled loss
      (``decoupled``: clip around the recomputed log-probs, importance weight to the
      sampler's ``rollout_logprobs``, capped by ``correction.behavior_weight_cap``);
    - minus ``entropy_coef`` x entropy;
    - plus ``kl.loss_coef`` x the KL estimate to the reference (GRPO's KL term);
    - plus ``teacher.coef`` x the KL estimate to the teacher (``teacher.kl_in=loss``:
      on-policy distillation's reverse KL, ``teacher.loss_estimator``);
    all over ``policy_mask`` (the response mask without the samples the mismatch correction
    rejected). A micro-batch with ``ptx_loss_mask`` is pretraining data instead
    (PPO-ptx): its next-token NLL, already scaled by ``ptx_scale`` so that the step's loss is
    PPO loss + ptx_coef x the ptx NLL averaged over its own tokens."""
    from megarlhf.algos import decoupled_policy_loss, entropy_bonus, kl_per_token, policy_loss
    from megarlhf.algos.losses import aggregate_parts

    P = prompt_len

    def ptx_loss(model, hidden, batch):
        if "keep" in batch:  # packed rows (data.packing.pack_weighted)
            logprobs_BS, _ = token_logprobs(model, hidden, batch["targets"], tp_group=tp_group,
                                            true_vocab=true_vocab)
            logprobs_BS, weights = unpack(logprobs_BS, batch), batch["ptx_loss_mask"]
        else:
            logprobs_BS, _ = token_logprobs(model, hidden[:, :-1], batch["tokens"][:, 1:],
                                            tp_group=tp_group, true_vocab=true_vocab)
            weights = batch["ptx_loss_mask"][:, :-1]
        nll_sum = -(logprobs_BS * weights).sum()
        logs = {"ptx_nll_sum": nll_sum.detach(), "ptx_tokens": weights.sum()}
        return nll_sum * batch["ptx_scale"], torch.zeros((), dtype=torch.int), logs

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        ptx = "ptx_loss_mask" in batch  # pretraining rows: logits everywhere (padded)
        packed = "keep" in batch
        output = model_forward(model, batch, batch["keep"] if packed else
                               None if ptx else slice(P - 1, -1), hidden=True)

        def loss_func(hidden, non_loss_data=False):
            if ptx:
                return ptx_loss(model, hidden, batch)
            logprobs_BT, entropy_BT = token_logprobs(
                model, hidden, batch["targets"] if packed else batch["tokens"][:, P:],
                tp_group=tp_group, temperature=temperature, true_vocab=true_vocab)
            if packed:  # (1, K) -> the padded (B, T) grid every loss reads
                logprobs_BT, entropy_BT = unpack(logprobs_BT, batch), unpack(entropy_BT, batch)
            mask = batch["policy_mask"]
            if ppo.decoupled_loss:
                total, count, stats = decoupled_policy_loss(
                    logprobs_BT, batch["old_logprobs"], batch["rollout_logprobs"],
                    batch["advantages"], mask, ppo.clip_eps, ppo.correction.behavior_weight_cap,
                    ppo.loss_agg)
            else:
                total, count, stats = policy_loss(
                    logprobs_BT, batch["old_logprobs"], batch["advantages"], mask,
                    ppo.clip_eps, ppo.dual_clip, ppo.loss_agg,
                    token_weights_BT=batch.get("is_weights"))
            n = mask.sum()
            logs = {"pg_loss_sum": total.detach(), "loss_count": count,
                    "clipfrac_sum": stats["clipfrac"] * n,
                    "approxkl_sum": stats["approxkl"] * n,
                    "entropy_sum": (entropy_BT.detach() * mask).sum(), "tokens": n}
            if "behavior_weight_mean" in stats:
                kept = n * (1 - stats["behavior_capped_frac"])
                logs["behavior_weight_sum"] = stats["behavior_weight_mean"] * kept
                logs["behavior_capped_sum"] = stats["behavior_capped_frac"] * n
            if ppo.entropy_coef:
                ent_total, _ = entropy_bonus(entropy_BT, mask, ppo.entropy_coef, ppo.loss_agg)
                total = total + ent_total
            if ppo.kl.loss_coef:
                kl_BT = kl_per_token(logprobs_BT, batch["ref_logprobs"], mask,
                                     ppo.kl.loss_estimator)
                kl_total, _ = aggregate_parts(kl_BT, mask, ppo.loss_agg)
                total = total + ppo.kl.loss_coef * kl_total
                logs["kl_loss_sum"] = (kl_BT.detach() * mask).sum()
            if ppo.teacher.enabled and ppo.teacher.kl_in == "loss":
                kl_BT = kl_per_token(logprobs_BT, batch["teacher_logprobs"], mask,
                                     ppo.teacher.loss_estimator)
                kl_total, _ = aggregate_parts(kl_BT, mask, ppo.loss_agg)
                total = total + ppo.teacher.coef * kl_total
                logs["teacher_loss_sum"] = (kl_BT.detach() * mask).sum()
            logs["loss_sum"] = total.detach()
            return total, count.to(torch.int), logs

        return output, loss_func

    return forward_step


def make_value_step(*, prompt_len: int, cliprange_value: float | None, agg: str,
                    coef: float = 0.5):
    """Clipped value loss on experience micro-batches."""
    from megarlhf.algos import value_loss

    P = prompt_len

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        packed = "keep" in batch
        output = model_forward(model, batch, batch["keep"] if packed else slice(P - 1, -1))

        def loss_func(values_BT1, non_loss_data=False):
            values_BT = values_BT1[..., 0].float()
            if packed:  # (1, K) -> (B, T)
                values_BT = unpack(values_BT, batch)
            mask = batch["response_mask"]
            total, count, stats = value_loss(values_BT, batch["old_values"], batch["returns"],
                                             mask, cliprange_value, agg, coef)
            n = mask.sum()
            logs = {"loss_sum": total.detach(), "loss_count": count,
                    "clipfrac_sum": stats["clipfrac"] * n, "tokens": n}
            return total, count.to(torch.int), logs

        return output, loss_func

    return forward_step


def make_dpo_step(*, tp_group, true_vocab: int, beta: float, loss: str,
                  label_smoothing: float):
    """DPO on micro-batches whose rows alternate chosen, rejected of one pair: the policy's
    log-probs summed over each row's response tokens (``loss_mask``; averaged for IPO)
    against the reference's (``ref``, (2B,), from the cache). Returns (loss sum, pairs,
    logs); megatron divides by the pairs of every micro-batch and replica. Padded or packed
    (``data.packing.pack_weighted``)."""
    from megarlhf.algos.preference import dpo_loss

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model_forward(model, batch, batch.get("keep"), hidden=True)

        def loss_func(hidden, non_loss_data=False):
            logprobs_BS, weights = weighted_logprobs(model, hidden, batch, tp_group=tp_group,
                                                     true_vocab=true_vocab)
            seq = (logprobs_BS * weights).sum(-1)
            if loss == "ipo":
                seq = seq / weights.sum(-1).clamp(min=1.0)
            ref = batch["ref"].to(seq.dtype)
            losses, chosen, rejected = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2],
                                                beta=beta, loss=loss,
                                                label_smoothing=label_smoothing)
            real = batch["pair_mask"].to(losses.dtype)
            loss_sum = (losses * real).sum()
            num_pairs = real.sum()
            logs = {"loss_sum": loss_sum.detach(), "pairs": num_pairs,
                    "chosen_sum": (chosen * real).sum(), "rejected_sum": (rejected * real).sum(),
                    "correct": ((chosen > rejected).to(real.dtype) * real).sum()}
            return loss_sum, num_pairs.to(torch.int), logs

        return output, loss_func

    return forward_step


def make_distill_step(*, tp_group, true_vocab: int, divergence: str, temperature: float,
                      nll_coef: float):
    """Distillation on SFT-format rows: per response position (``loss_mask``), the KL
    between the teacher's cached top-k log-probs (``teacher_logprobs``/``teacher_ids``,
    (B, S, k)) and the student's log-probs of the same ids, plus ``nll_coef`` x the
    next-token NLL. Returns (sum, tokens, logs). Padded, or packed
    (``data.packing.pack_weighted``; the teacher's (1, K, k) at the kept outputs)."""
    from megarlhf.algos.preference import topk_kl
    from megarlhf.models.logprobs import head_gather_logprobs

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        packed = "keep" in batch
        output = model_forward(model, batch, batch.get("keep"), hidden=True)

        def loss_func(hidden, non_loss_data=False):
            own = slice(None) if packed else slice(None, -1)  # positions the loss reads
            # the student's log-probs of the teacher's ids, the head's logits a chunk of
            # positions at a time
            student = head_gather_logprobs(
                hidden[:, own], unwrap(model).head_weight(), batch["teacher_ids"][:, own],
                tp_group=tp_group, temperature=temperature, true_vocab=true_vocab)
            kl = topk_kl(student, batch["teacher_logprobs"][:, own], divergence)
            weights = batch["loss_mask"] if packed else batch["loss_mask"][:, :-1]
            if packed:
                kl = unpack(kl, batch)
            kl_sum = (kl * weights).sum()
            total = kl_sum
            logs = {"kl_sum": kl_sum.detach(), "tokens": weights.sum()}
            if nll_coef:
                logprobs_BS, _ = weighted_logprobs(model, hidden, batch, tp_group=tp_group,
                                                   true_vocab=true_vocab)
                nll_sum = -(logprobs_BS * weights).sum()
                total = total + nll_coef * nll_sum
                logs["nll_sum"] = nll_sum.detach()
            logs["loss_sum"] = total.detach()
            return total, weights.sum().to(torch.int), logs

        return output, loss_func

    return forward_step
