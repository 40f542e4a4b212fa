"""Plain loops written from the formulas, for checking what a real PPO run logged.

Nothing here imports megarlhf: every number is recomputed with Python floats, row by row
and token by token, from the published definitions (Schulman's KL estimators, Ziegler et
al.'s shaped reward, GAE, DeepSeekMath's GRPO, AReaL's token-level GRPO, Dr. GRPO, RLOO,
REINFORCE++, the clipped surrogate, the dual clip, AReaL's decoupled loss, OpenAI
baselines' clipped value loss). Tensors come in, lists of floats go out.

Conventions (those of the PPO notes): responses are left-aligned, a row's valid tokens
are its first ``n`` columns, the score goes on the last valid token, values after the
end are 0 (terminal).
"""

from __future__ import annotations

import math


def rows(t) -> list[list[float]]:
    return [[float(x) for x in row] for row in t.tolist()]


def lengths(mask) -> list[int]:
    """Valid tokens per row of a left-aligned 0/1 mask (checked to be left-aligned)."""
    out = []
    for row in rows(mask):
        n = int(sum(row))
        assert row == [1.0] * n + [0.0] * (len(row) - n), f"mask not left-aligned: {row}"
        out.append(n)
    return out


# ------------------------------------------------------------------ KL

def kl_token(logp: float, ref: float, estimator: str) -> float:
    """KL(policy || ref) from one sample of the policy; log r = ref - logp."""
    log_r = ref - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        return math.exp(log_r) - 1.0 - log_r
    if estimator == "abs":
        return abs(log_r)
    raise ValueError(estimator)


# ------------------------------------------------------------------ statistics

def whiten(values: list[list[float]], n: list[int], unbiased: bool, shift_mean: bool = True,
           eps: float = 1e-8) -> list[list[float]]:
    """(x - mean) / sqrt(var + eps) over every row's first n[b] entries (the mean added
    back when not ``shift_mean``); 0 after each row's end."""
    flat = [x for row, k in zip(values, n, strict=True) for x in row[:k]]
    count = len(flat)
    mean = sum(flat) / count if count else 0.0
    sq = sum((x - mean) ** 2 for x in flat)
    var = 0.0 if count < 2 else sq / (count - 1 if unbiased else count)
    scale = 1.0 / math.sqrt(var + eps)
    out = []
    for row, k in zip(values, n, strict=True):
        out.append([((x - mean) * scale + (0.0 if shift_mean else mean)) if t < k else 0.0
                    for t, x in enumerate(row)])
    return out


# ------------------------------------------------------------------ the experience

def experience(*, old, ref, values, scores, mask, estimator: str, kl_estimator: str,
               beta: float, clip_reward: float | None, whiten_rewards: bool,
               whiten_advantages: bool, unbiased: bool, gamma: float, lam: float,
               group_size: int, group_norm: str = "sequence", turn_rewards=None) -> dict:
    """Per-token KL, shaped rewards, advantages and returns of one batch, from the logged
    log-probs, values and scores. Returns lists of rows. ``turn_rewards`` (multi-turn):
    the earlier turns' rewards where they fell, added to the per-token rewards and, summed,
    to the sequence reward."""
    n = lengths(mask)
    old, ref, values, scores = rows(old), rows(ref), rows(values), [float(s) for s in scores]
    B, T = len(old), len(old[0])
    turns = rows(turn_rewards) if turn_rewards is not None else [[0.0] * T for _ in range(B)]
    kl = [[kl_token(old[b][t], ref[b][t], kl_estimator) if t < n[b] else 0.0
           for t in range(T)] for b in range(B)]
    # Ziegler et al.: r_t = -beta KL_t, plus the (clipped) score at the last token
    rewards = [[-beta * kl[b][t] if t < n[b] else 0.0 for t in range(T)] for b in range(B)]
    for b in range(B):
        if n[b]:
            s = scores[b]
            if clip_reward is not None:
                s = max(-clip_reward, min(clip_reward, s))
            rewards[b][n[b] - 1] += s
        for t in range(n[b]):
            rewards[b][t] += turns[b][t]
    if whiten_rewards:
        rewards = whiten(rewards, n, unbiased, shift_mean=False)
    sequence = [scores[b] - beta * sum(kl[b]) + sum(turns[b][:n[b]]) for b in range(B)]
    if estimator == "gae":
        advantages, returns = [], []
        for b in range(B):
            adv = [0.0] * T
            running = 0.0
            for t in reversed(range(n[b])):
                next_value = values[b][t + 1] if t + 1 < n[b] else 0.0
                delta = rewards[b][t] + gamma * next_value - values[b][t]
                running = delta + gamma * lam * running
                adv[t] = running
            advantages.append(adv)
            returns.append([adv[t] + values[b][t] if t < n[b] else 0.0 for t in range(T)])
    elif estimator == "reinforce_pp":
        discounted = []
        for b in range(B):
            g, row = 0.0, [0.0] * T
            for t in reversed(range(n[b])):
                g = rewards[b][t] + gamma * g
                row[t] = g
            discounted.append(row)
        advantages = whiten(discounted, n, unbiased)
        returns = advantages
    elif estimator in ("grpo", "rloo"):
        k = group_size
        per_sample = [0.0] * B
        for g0 in range(0, B, k):
            group = sequence[g0:g0 + k]
            for j, s in enumerate(group):
                if estimator == "rloo":
                    per_sample[g0 + j] = s - (sum(group) - s) / (k - 1)
                elif group_norm == "token":  # AReaL: statistics over the group's tokens
                    toks = [n[g0 + i] for i in range(k)]
                    total = max(sum(toks), 1)
                    mean = sum(x * m for x, m in zip(group, toks, strict=True)) / total
                    std = math.sqrt(sum(m * (x - mean) ** 2 for x, m in zip(group, toks, strict=True))
                                    / total)
                    per_sample[g0 + j] = (s - mean) / (std + 1e-5)
                else:
                    mean = sum(group) / k
                    if group_norm == "center":  # Dr. GRPO
                        per_sample[g0 + j] = s - mean
                    else:  # DeepSeekMath: sample std
                        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (k - 1))
                        per_sample[g0 + j] = (s - mean) / (std + 1e-6)
        advantages = [[per_sample[b] if t < n[b] else 0.0 for t in range(T)]
                      for b in range(B)]
        returns = advantages
    else:
        raise ValueError(estimator)
    if whiten_advantages and estimator in ("gae", "rloo"):
        advantages = whiten(advantages, n, unbiased)
    return {"kl": kl, "rewards": rewards, "advantages": advantages, "returns": returns,
            "sequence_rewards": sequence}


def mismatch(old, rollout, mask, *, is_cap: float | None, low: float | None,
             high: float | None) -> tuple[list[list[float]], list[list[float]]]:
    """The rollout/training mismatch correction: each token's weight min(r, is_cap) with
    r = p_train / p_rollout (1 without a cap, and off the mask), and the policy mask
    without the samples whose geometric-mean ratio exp(mean log r) leaves [low, high]."""
    old, rollout, m = rows(old), rows(rollout), rows(mask)
    weights, policy = [], []
    for o, r, mr in zip(old, rollout, m, strict=True):
        logs = [(a - b) for a, b, k in zip(o, r, mr, strict=True) if k]
        weights.append([min(math.exp(a - b), is_cap) if (k and is_cap is not None) else 1.0
                        for a, b, k in zip(o, r, mr, strict=True)])
        ratio = math.exp(sum(logs) / max(len(logs), 1))
        keep = (low is None or ratio >= low) and (high is None or ratio <= high)
        policy.append([k if keep else 0.0 for k in mr])
    return policy, weights


def compress(t, mask) -> list[list[float]]:
    """Each row's entries where ``mask`` is 1 (a multi-turn episode's model tokens: the
    environment's observations between them removed), left-aligned, zeros after."""
    out = []
    for row, m in zip(rows(t), rows(mask), strict=True):
        kept = [x for x, k in zip(row, m, strict=True) if k]
        out.append(kept + [0.0] * (len(row) - len(kept)))
    return out


def expand(values: list[list[float]], mask) -> list[list[float]]:
    """The inverse of :func:`compress`: each row's values back at the mask's 1s, 0
    elsewhere."""
    out = []
    for row, m in zip(values, rows(mask), strict=True):
        it = iter(row)
        out.append([next(it) if k else 0.0 for k in m])
    return out


# ------------------------------------------------------------------ the losses

def _aggregate(per_token: list[list[float]], mask: list[list[float]], agg: str
               ) -> tuple[float, float]:
    """(total, count): the loss is total / count."""
    if agg == "token_mean":
        return (sum(x * m for row, mrow in zip(per_token, mask, strict=True) for x, m in zip(row, mrow, strict=True)),
                sum(m for mrow in mask for m in mrow))
    total, count = 0.0, 0.0
    for row, mrow in zip(per_token, mask, strict=True):
        k = sum(mrow)
        if k == 0:
            continue
        s = sum(x * m for x, m in zip(row, mrow, strict=True))
        total += s / k if agg == "seq_mean_token_mean" else s
        count += 1
    return total, count


def policy_loss(*, new, old, advantages, mask, weights, clip_eps: float,
                dual_clip: float | None = None, agg: str = "token_mean",
                behaviour=None, behaviour_cap: float | None = None) -> dict:
    """The clipped surrogate summed over a micro-batch, with its diagnostics as sums over
    the mask's tokens. ``behaviour`` given: AReaL's decoupled loss (the clip around
    ``old``, the proximal policy; each token weighted by exp(old - behaviour), 0 above the
    cap)."""
    per_token, mask_rows = [], []
    clipped = approxkl = tokens = 0.0
    for b in range(len(new)):
        row = []
        for t in range(len(new[b])):
            m = mask[b][t]
            r = math.exp(new[b][t] - old[b][t])
            a = advantages[b][t]
            s1, s2 = -a * r, -a * max(1.0 - clip_eps, min(1.0 + clip_eps, r))
            loss = max(s1, s2)
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            if behaviour is not None:
                w = math.exp(old[b][t] - behaviour[b][t])
                loss *= 0.0 if (behaviour_cap is not None and w > behaviour_cap) else w
            else:
                loss *= weights[b][t]
            row.append(loss)
            clipped += m * (s2 > s1)
            approxkl += m * (old[b][t] - new[b][t])
            tokens += m
        per_token.append(row)
        mask_rows.append(list(mask[b]))
    total, count = _aggregate(per_token, mask_rows, agg)
    return {"pg_loss_sum": total, "loss_count": count, "clipfrac_sum": clipped,
            "approxkl_sum": approxkl, "tokens": tokens}


def value_loss(*, new, old, returns, mask, clip: float | None, coef: float = 0.5,
               agg: str = "token_mean") -> dict:
    per_token = []
    clipped = 0.0
    for b in range(len(new)):
        row = []
        for t in range(len(new[b])):
            v, v_old, ret = new[b][t], old[b][t], returns[b][t]
            unclipped = (v - ret) ** 2
            if clip is None:
                row.append(coef * unclipped)
                continue
            v_clip = v_old + max(-clip, min(clip, v - v_old))
            row.append(coef * max(unclipped, (v_clip - ret) ** 2))
            clipped += mask[b][t] * ((v_clip - ret) ** 2 > unclipped)
        per_token.append(row)
    total, count = _aggregate(per_token, [list(m) for m in mask], agg)
    return {"loss_sum": total, "loss_count": count, "clipfrac_sum": clipped,
            "tokens": sum(m for row in mask for m in row)}


def kl_loss_sum(*, new, ref, mask, estimator: str) -> float:
    return sum(mask[b][t] * kl_token(new[b][t], ref[b][t], estimator)
               for b in range(len(new)) for t in range(len(new[b])))


def ema(snapshots: list, decay: float):
    """ema <- decay ema + (1 - decay) param after every step, starting at the parameters."""
    avg = snapshots[0].double().clone()
    for p in snapshots[1:]:
        avg = decay * avg + (1.0 - decay) * p.double()
    return avg


# ------------------------------------------------------------------ what is trained

def truncated_lengths(raw_tokens, raw_mask, stop_ids) -> tuple[list[int], list[bool]]:
    """From the sampler's output: each response cut after its first stop token (kept).
    Returns (tokens per row, whether a stop token occurred)."""
    out, stopped = [], []
    for toks, n in zip(raw_tokens.tolist(), lengths(raw_mask), strict=True):
        cut = next((t + 1 for t in range(n) if toks[t] in stop_ids), None)
        stopped.append(cut is not None)
        out.append(n if cut is None else cut)
    return out, stopped


def shaped_score(raw: float, stopped: bool, length: int, *, penalty: float | None,
                 mode: str, max_len: int, buffer: int, overlong: float) -> float:
    """The score a sample trains on: the missing-stop rule (lm-human-preferences' fixed
    score, or TRL's subtraction), then DAPO's overlong ramp."""
    s = raw
    if penalty is not None and not stopped:
        s = penalty if mode == "replace" else raw - penalty
    if buffer > 0:
        s -= overlong * min(max(length - (max_len - buffer), 0) / buffer, 1.0)
    return s
