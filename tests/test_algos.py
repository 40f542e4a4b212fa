"""Every algorithm against a naive Python-loop reference, with edge cases: length-1
responses, fully masked rows, responses without a stop token. float64 throughout."""

import math

import pytest
import torch

from megarlhf import algos
from megarlhf.algos.experience import BatchSizes, Experience



@pytest.fixture(autouse=True)
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


B, T = 5, 7
LENGTHS = [7, 1, 0, 4, 3]  # full, length-1, fully masked, ...


def make_mask(lengths=LENGTHS, t=T):
    return torch.tensor([[1.0 if j < n else 0.0 for j in range(t)] for n in lengths])


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def valid(mask):
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


# ---------------------------------------------------------------- masked statistics

def test_masked_mean_var_whiten_against_loops():
    x, mask = rand(B, T), make_mask()
    vals = [x[b, t].item() for b, t in valid(mask)]
    n = len(vals)
    mean = sum(vals) / n
    var_b = sum((v - mean) ** 2 for v in vals) / n
    var_u = var_b * n / (n - 1)
    assert math.isclose(algos.masked_mean(x, mask).item(), mean, rel_tol=1e-12)
    assert math.isclose(algos.masked_var(x, mask).item(), var_u, rel_tol=1e-12)
    assert math.isclose(algos.masked_var(x, mask, unbiased=False).item(), var_b, rel_tol=1e-12)
    w = algos.masked_whiten(x, mask, shift_mean=True, unbiased=False, eps=0.0)
    for b, t in valid(mask):
        assert math.isclose(w[b, t].item(), (x[b, t].item() - mean) / math.sqrt(var_b),
                            rel_tol=1e-10)
    w2 = algos.masked_whiten(x, mask, shift_mean=False, eps=0.0)
    for b, t in valid(mask):
        assert math.isclose(w2[b, t].item(), (x[b, t].item() - mean) / math.sqrt(var_u) + mean,
                            rel_tol=1e-10)


def test_masked_stats_edge_cases():
    x = rand(2, 3)
    empty = torch.zeros(2, 3)
    assert algos.masked_mean(x, empty).item() == 0.0
    assert algos.masked_var(x, empty).item() == 0.0
    one = torch.zeros(2, 3)
    one[1, 2] = 1
    assert algos.masked_var(x, one).item() == 0.0
    assert torch.isfinite(algos.masked_whiten(x, one)).all()
    per_row = algos.masked_mean(x, make_mask([3, 0], 3), dim=1)
    assert math.isclose(per_row[0].item(), x[0].mean().item()) and per_row[1].item() == 0.0


def test_last_valid_index():
    mask = make_mask()
    assert algos.last_valid_index(mask).tolist() == [6, 0, -1, 3, 2]


# ---------------------------------------------------------------- KL and rewards

@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_kl_estimators_against_loops(estimator):
    lp, ref, mask = rand(B, T, seed=1) - 2, rand(B, T, seed=2) - 2, make_mask()
    kl = algos.kl_per_token(lp, ref, mask, estimator)
    for b in range(B):
        for t in range(T):
            log_r = ref[b, t].item() - lp[b, t].item()
            expect = {"k1": -log_r, "k2": 0.5 * log_r ** 2,
                      "k3": math.exp(log_r) - 1 - log_r, "abs": abs(log_r)}[estimator]
            assert math.isclose(kl[b, t].item(), expect * mask[b, t].item(), abs_tol=1e-12)
    if estimator in ("k2", "k3", "abs"):
        assert (kl >= 0).all()
    with pytest.raises(ValueError, match="KL estimator must be one of"):
        algos.kl_per_token(lp, ref, mask, "k4")


def test_shape_rewards_against_loop():
    kl, mask = rand(B, T, seed=3).abs(), make_mask()
    scores = torch.tensor([7.0, -0.5, 3.0, -9.0, 1.0])
    rewards, non_score = algos.shape_rewards(scores, kl, mask, kl_coef=0.1, clip_reward_value=5.0)
    for b in range(B):
        n = LENGTHS[b]
        for t in range(T):
            expect = -0.1 * kl[b, t].item() if t < n else 0.0
            if t == n - 1:
                expect += max(-5.0, min(5.0, scores[b].item()))
            assert math.isclose(rewards[b, t].item(), expect, abs_tol=1e-12)
            assert math.isclose(non_score[b, t].item(), -0.1 * kl[b, t].item() * (t < n),
                                abs_tol=1e-12)
    assert rewards[2].abs().sum() == 0  # fully masked row gets nothing
    unclipped, _ = algos.shape_rewards(scores, kl, mask, 0.1, None)
    assert math.isclose(unclipped[0, 6].item() + 0.1 * kl[0, 6].item(), 7.0)


def test_truncate_after_stop_and_missing_stop_rule():
    responses = torch.tensor([[5, 6, 2, 7, 8],   # stop (2) in the middle
                              [5, 6, 7, 8, 9],   # no stop token
                              [2, 4, 4, 0, 0],   # stop first, real length 3
                              [4, 3, 2, 0, 0],   # stop 3 first
                              [5, 0, 0, 0, 0]])  # stop only in padding: not a stop
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0],
                         [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    responses[4, 2] = 2
    out, new_mask, has_stop = algos.truncate_after_stop(responses, mask, [2, 3], pad_token_id=0)
    assert has_stop.tolist() == [True, False, True, True, False]
    assert new_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0],
                                 [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert out[0].tolist() == [5, 6, 2, 0, 0] and out[3].tolist() == [4, 3, 0, 0, 0]
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert algos.apply_missing_stop_rule(scores, has_stop, -1.0).tolist() == [1, -1, 3, 4, -1]
    assert algos.apply_missing_stop_rule(scores, has_stop, 1.5, "subtract").tolist() == [
        1, 0.5, 3, 4, 3.5]
    assert algos.apply_missing_stop_rule(scores, has_stop, None).tolist() == scores.tolist()
    same, same_mask, none = algos.truncate_after_stop(responses, mask, [], 0)
    assert same is responses and not none.any()


def test_score_normalization():
    raw = rand(1000, seed=4) * 3 + 2
    gain, bias = algos.fit_score_normalization(raw)
    norm = algos.normalize_scores(raw, gain, bias)
    assert abs(norm.mean().item()) < 1e-10 and abs(norm.std(unbiased=False).item() - 1) < 1e-10
    with pytest.raises(ValueError, match="zero spread"):
        algos.fit_score_normalization(torch.ones(10))


# ---------------------------------------------------------------- advantages

def naive_gae(rewards, values, lengths, gamma, lam):
    adv = [[0.0] * T for _ in lengths]
    for b, n in enumerate(lengths):
        for t in range(n):
            total = 0.0
            for k in range(t, n):
                next_v = values[b][k + 1] if k + 1 < n else 0.0
                delta = rewards[b][k] + gamma * next_v - values[b][k]
                total += (gamma * lam) ** (k - t) * delta
            adv[b][t] = total
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_gae_against_loop(gamma, lam):
    rewards, values, mask = rand(B, T, seed=5), rand(B, T, seed=6), make_mask()
    adv, ret = algos.gae(rewards, values, mask, gamma, lam)
    ref = naive_gae(rewards.tolist(), values.tolist(), LENGTHS, gamma, lam)
    for b in range(B):
        for t in range(T):
            assert math.isclose(adv[b, t].item(), ref[b][t], abs_tol=1e-10)
            expect_ret = ref[b][t] + values[b, t].item() if t < LENGTHS[b] else 0.0
            assert math.isclose(ret[b, t].item(), expect_ret, abs_tol=1e-10)
    # length-1 response: A = r0 - V0
    assert math.isclose(adv[1, 0].item(), rewards[1, 0].item() - values[1, 0].item())


def test_gae_ignores_garbage_after_end():
    rewards, values, mask = rand(B, T, seed=5), rand(B, T, seed=6), make_mask()
    adv, ret = algos.gae(rewards, values, mask, 1.0, 0.95)
    noisy_r = rewards + (1 - mask) * 100
    noisy_v = values + (1 - mask) * 100
    adv2, ret2 = algos.gae(noisy_r, noisy_v, mask, 1.0, 0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_group_advantages_against_loops():
    scores = rand(12, seed=7)
    k = 4
    grpo = algos.grpo_advantages(scores, k)
    rloo = algos.rloo_advantages(scores, k)
    for g in range(3):
        group = scores[g * k:(g + 1) * k].tolist()
        mean = sum(group) / k
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (k - 1))
        for i, s in enumerate(group):
            assert math.isclose(grpo[g * k + i].item(), (s - mean) / (std + 1e-6), rel_tol=1e-10)
            baseline = (sum(group) - s) / (k - 1)
            assert math.isclose(rloo[g * k + i].item(), s - baseline, rel_tol=1e-10)
    assert torch.allclose(algos.grpo_advantages(scores, k, scale_by_std=False),
                          scores - scores.view(3, 4).mean(1).repeat_interleave(4))
    with pytest.raises(ValueError, match="not divisible by the group size 5"):
        algos.grpo_advantages(scores, 5)
    with pytest.raises(ValueError, match="RLOO needs"):
        algos.rloo_advantages(scores, 1)
    tokens = algos.broadcast_to_tokens(grpo[:B], make_mask())
    assert tokens[0, 3].item() == grpo[0].item() and tokens[2].abs().sum() == 0


def test_reinforce_pp_against_loop():
    rewards, mask = rand(B, T, seed=8), make_mask()
    adv = algos.reinforce_pp_advantages(rewards, mask, gamma=0.9)
    returns = [[0.0] * T for _ in range(B)]
    for b, n in enumerate(LENGTHS):
        running = 0.0
        for t in reversed(range(n)):
            running = rewards[b, t].item() + 0.9 * running
            returns[b][t] = running
    vals = [returns[b][t] for b, t in valid(mask)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    for b, t in valid(mask):
        assert math.isclose(adv[b, t].item(), (returns[b][t] - mean) / math.sqrt(std ** 2 + 1e-8),
                            rel_tol=1e-9)
    assert (adv * (1 - mask)).abs().sum() == 0


def loop_whiten(adv, mask):
    """Whitening over the valid tokens (unbiased variance, eps 1e-8), zero elsewhere."""
    vals = [adv[b][t] for b, t in valid(mask)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(adv[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
             for t in range(T)] for b in range(B)]


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp", "grpo", "rloo"])
@pytest.mark.parametrize("whiten", [True, False])
def test_estimate_advantages_dispatch_against_loops(estimator, whiten):
    """The experience maker's one call for every estimator, against plain loops: GAE
    (returns = A + V) and RLOO whitened when asked, GRPO normalised in its groups only,
    REINFORCE++ always whitened; critic-free estimators return their advantages before
    batch whitening as the returns."""
    rewards, values, mask = rand(B, T, seed=5), rand(B, T, seed=6), make_mask()
    scores = torch.tensor([0.3, -1.2, 0.7, 2.0, 0.1])
    adv, ret = algos.estimate_advantages(
        estimator, scores_B=scores, rewards_BT=rewards, values_BT=values, mask_BT=mask,
        gamma=1.0, lam=0.95, group_size=5 if estimator in ("grpo", "rloo") else 1,
        whiten=whiten)
    if estimator == "gae":
        raw = naive_gae(rewards.tolist(), values.tolist(), LENGTHS, 1.0, 0.95)
        expect_ret = [[raw[b][t] + values[b, t].item() if mask[b, t] else 0.0
                       for t in range(T)] for b in range(B)]
    elif estimator == "reinforce_pp":
        raw = [[0.0] * T for _ in range(B)]
        for b, n in enumerate(LENGTHS):
            running = 0.0
            for t in reversed(range(n)):
                running = rewards[b, t].item() + running
                raw[b][t] = running
        raw = loop_whiten(raw, mask)
    else:
        s = scores.tolist()
        mean = sum(s) / 5
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / 4)
        per_sample = [(x - mean) / (std + 1e-6) if estimator == "grpo"
                      else x - (sum(s) - x) / 4 for x in s]
        raw = [[per_sample[b] if mask[b, t] else 0.0 for t in range(T)] for b in range(B)]
    expect = loop_whiten(raw, mask) if whiten and estimator in ("gae", "rloo") else raw
    if estimator != "gae":
        expect_ret = raw  # before batch whitening (nothing trains on them)
    for b in range(B):
        for t in range(T):
            assert math.isclose(adv[b, t].item(), expect[b][t], abs_tol=1e-9), (b, t)
            assert math.isclose(ret[b, t].item(), expect_ret[b][t], abs_tol=1e-9), (b, t)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        algos.estimate_advantages("ppo", scores_B=scores, rewards_BT=rewards,
                                  values_BT=values, mask_BT=mask, gamma=1.0, lam=0.95,
                                  group_size=1, whiten=True)


# ---------------------------------------------------------------- losses

def loop_aggregate(loss, mask, mode):
    if mode == "token_mean":
        vals = [loss[b][t] for b, t in valid(mask)]
        return sum(vals) / len(vals)
    per_seq = []
    for b in range(len(loss)):
        toks = [loss[b][t] for t in range(len(loss[b])) if mask[b, t]]
        if toks:
            per_seq.append(sum(toks) / (len(toks) if mode == "seq_mean_token_mean" else 1))
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_against_loop(agg, dual_clip):
    lp, old, adv, mask = rand(B, T, seed=9) * 0.5, rand(B, T, seed=10) * 0.5, rand(B, T, seed=11), make_mask()
    total, count, stats = algos.policy_loss(lp, old, adv, mask, clip_eps=0.2,
                                            dual_clip=dual_clip, agg=agg)
    loss = [[0.0] * T for _ in range(B)]
    clipped = 0
    for b, t in valid(mask):
        r = math.exp(lp[b, t].item() - old[b, t].item())
        a = adv[b, t].item()
        s1, s2 = -a * r, -a * min(max(r, 0.8), 1.2)
        value = max(s1, s2)
        if dual_clip is not None and a < 0:
            value = min(value, -a * dual_clip)
        loss[b][t] = value
        clipped += s2 > s1
    assert math.isclose((total / count).item(), loop_aggregate(loss, mask, agg), rel_tol=1e-10)
    assert math.isclose(algos.aggregate(torch.tensor(loss), mask, agg).item(),
                        (total / count).item(), rel_tol=1e-12)
    assert math.isclose(stats["clipfrac"].item(), clipped / len(valid(mask)), rel_tol=1e-12)
    diffs = [lp[b, t].item() - old[b, t].item() for b, t in valid(mask)]
    assert math.isclose(stats["approxkl"].item(), sum(-d for d in diffs) / len(diffs), rel_tol=1e-10)
    assert math.isclose(stats["approxkl_k3"].item(),
                        sum(math.exp(d) - 1 - d for d in diffs) / len(diffs), rel_tol=1e-10)
    assert math.isclose(stats["ratio_max"].item(), math.exp(max(diffs)), rel_tol=1e-12)
    assert math.isclose(stats["ratio_min"].item(), math.exp(min(diffs)), rel_tol=1e-12)


def test_dual_clip_bounds_negative_advantage():
    lp, old = torch.tensor([[3.0]]), torch.tensor([[0.0]])  # ratio e^3 ~ 20
    adv, mask = torch.tensor([[-1.0]]), torch.ones(1, 1)
    total, count, _ = algos.policy_loss(lp, old, adv, mask, dual_clip=3.0)
    assert math.isclose(total.item(), 3.0)
    total, _, _ = algos.policy_loss(lp, old, adv, mask, dual_clip=None)
    assert math.isclose(total.item(), math.exp(3.0))


def test_policy_loss_gradient_is_zero_when_clipped():
    lp = torch.tensor([[1.0, -1.0]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    total, count, _ = algos.policy_loss(lp, old, adv, mask, clip_eps=0.2)
    (total / count).backward()
    assert lp.grad.abs().sum() == 0  # ratio e (A>0) and 1/e (A<0) are both clipped


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_value_loss_against_loop(clip, agg):
    v, old, ret, mask = rand(B, T, seed=12), rand(B, T, seed=13), rand(B, T, seed=14), make_mask()
    total, count, stats = algos.value_loss(v, old, ret, mask, cliprange_value=clip, agg=agg)
    loss = [[0.0] * T for _ in range(B)]
    clipped = 0
    for b, t in valid(mask):
        l1 = (v[b, t].item() - ret[b, t].item()) ** 2
        if clip is None:
            loss[b][t] = 0.5 * l1
            continue
        vc = old[b, t].item() + min(max(v[b, t].item() - old[b, t].item(), -clip), clip)
        l2 = (vc - ret[b, t].item()) ** 2
        loss[b][t] = 0.5 * max(l1, l2)
        clipped += l2 > l1
    assert math.isclose((total / count).item(), loop_aggregate(loss, mask, agg), rel_tol=1e-10)
    if clip is not None:
        assert math.isclose(stats["clipfrac"].item(), clipped / len(valid(mask)), rel_tol=1e-12)


def test_decoupled_loss_against_loop():
    lp, prox, behav = rand(B, T, seed=15) * 0.3, rand(B, T, seed=16) * 0.3, rand(B, T, seed=17) * 0.3
    adv, mask = rand(B, T, seed=18), make_mask()
    total, count, stats = algos.decoupled_policy_loss(lp, prox, behav, adv, mask, clip_eps=0.2,
                                                      behavior_weight_cap=1.3)
    vals, capped = [], 0
    for b, t in valid(mask):
        r = math.exp(lp[b, t].item() - prox[b, t].item())
        a = adv[b, t].item()
        w = math.exp(prox[b, t].item() - behav[b, t].item())
        if w > 1.3:
            w, capped = 0.0, capped + 1
        vals.append(max(-a * r, -a * min(max(r, 0.8), 1.2)) * w)
    assert math.isclose((total / count).item(), sum(vals) / len(vals), rel_tol=1e-10)
    assert capped > 0
    assert math.isclose(stats["behavior_capped_frac"].item(), capped / len(vals), rel_tol=1e-12)
    # with proximal == behaviour it is the ordinary clipped loss
    plain = algos.policy_loss(lp, prox, adv, mask)[0]
    same = algos.decoupled_policy_loss(lp, prox, prox, adv, mask)[0]
    assert torch.allclose(plain, same)


def test_entropy_ptx_and_explained_variance():
    ent, lp, mask = rand(B, T, seed=19).abs(), -rand(B, T, seed=20).abs(), make_mask()
    total, count = algos.entropy_bonus(ent, mask, coef=0.01)
    vals = [ent[b, t].item() for b, t in valid(mask)]
    assert math.isclose((total / count).item(), -0.01 * sum(vals) / len(vals), rel_tol=1e-12)
    total, count = algos.ptx_loss(lp, mask)
    nll = [-lp[b, t].item() for b, t in valid(mask)]
    assert math.isclose((total / count).item(), sum(nll) / len(nll), rel_tol=1e-12)
    obj = algos.ppo_ptx_objective(torch.tensor(0.5), total / count, 2.0)
    assert math.isclose(obj.item(), 0.5 + 2.0 * sum(nll) / len(nll), rel_tol=1e-12)
    ret = rand(B, T, seed=21)
    assert math.isclose(algos.explained_variance(ret, ret, mask).item(), 1.0)
    vals_r = [ret[b, t].item() for b, t in valid(mask)]
    mean = sum(vals_r) / len(vals_r)
    const = torch.full((B, T), mean)
    assert abs(algos.explained_variance(const, ret, mask).item()) < 1e-12


def test_empty_batch_losses_are_finite():
    z, mask = torch.zeros(2, 3), torch.zeros(2, 3)
    for fn in (lambda: algos.policy_loss(z, z, z, mask), lambda: algos.value_loss(z, z, z, mask)):
        total, count, stats = fn()
        assert algos.aggregate(z, mask).item() == 0.0 and count.item() == 0
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in stats.values())


# ---------------------------------------------------------------- controllers, EMA, batches

def test_adaptive_kl_controller_against_formula():
    ctl = algos.AdaptiveKLController(0.15, target=6.0, horizon=10000)
    value = 0.15
    for kl in [0.5, 3.0, 6.0, 9.0, 40.0, 5.9]:
        ctl.update(kl, 64)
        value *= 1 + max(-0.2, min(0.2, kl / 6.0 - 1)) * 64 / 10000
        assert math.isclose(ctl.value, value, rel_tol=1e-15)
    restored = algos.make_kl_controller("adaptive", 1.0, 1.0, 1)
    restored.load_state_dict(ctl.state_dict())
    assert restored == ctl
    fixed = algos.make_kl_controller("fixed", 0.05, 6, 100)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05


def test_ema_true_polyak_form():
    params = [torch.ones(3), torch.zeros(2)]
    ema = algos.ParameterEMA(params, decay=0.9)
    history = []
    for step in range(5):
        params[0].add_(1.0)
        params[1].sub_(2.0)
        ema.update(params)
        history.append((params[0].clone(), params[1].clone()))
    expect0, expect1 = torch.ones(3), torch.zeros(2)
    for p0, p1 in history:
        expect0 = 0.9 * expect0 + 0.1 * p0
        expect1 = 0.9 * expect1 + 0.1 * p1
    assert torch.allclose(ema.shadow[0].double(), expect0, atol=1e-6)
    assert torch.allclose(ema.shadow[1].double(), expect1, atol=1e-6)
    target = [torch.empty(3, dtype=torch.bfloat16), torch.empty(2)]
    ema.copy_to(target)
    assert torch.allclose(target[1], expect1, atol=1e-6)
    # the shadow stays fp32 even for bf16 parameters, so small updates are not lost
    bf = [torch.ones(4, dtype=torch.bfloat16)]
    ema_bf = algos.ParameterEMA(bf, decay=0.992)
    bf[0].fill_(1.5)
    ema_bf.update(bf)
    assert ema_bf.shadow[0].dtype == torch.float32
    assert math.isclose(ema_bf.shadow[0][0].item(), 1.004, rel_tol=1e-6)
    with pytest.raises(ValueError, match="decay must be in"):
        algos.ParameterEMA(params, decay=1.0)


def test_batch_sizes():
    sizes = BatchSizes(rollout_batch_size=64, mini_batch_size=16, micro_batch_size=4,
                       dp_size=2, group_size=2).validate()
    assert (sizes.samples, sizes.num_mini_batches, sizes.mini_batch_per_rank,
            sizes.micro_batches_per_mini_batch) == (128, 8, 8, 2)
    assert "8 mini-batches of 16" in sizes.describe()
    with pytest.raises(ValueError, match=r"ppo.mini_batch_size \(2\) is not divisible by "
                                         r"the data-parallel size \(4\)"):
        BatchSizes(10, 2, 1, 4).validate()
    with pytest.raises(ValueError, match=r"ppo.mini_batch_size per data-parallel rank \(8\) is "
                                         r"not divisible by ppo.micro_batch_size \(3\)"):
        BatchSizes(64, 16, 3, 2).validate()
    with pytest.raises(ValueError, match=r"is not divisible by ppo.mini_batch_size \(24\)"):
        BatchSizes(64, 24, 4, 1).validate()


def make_experience(n=6, p=3, t=4):
    g = torch.Generator().manual_seed(0)
    fields = {}
    for name in Experience.__dataclass_fields__:
        suffix = name.rsplit("_", 1)[-1]
        if suffix == "BLSK":  # a mixture of experts' routing: 2 layers, top 2 of 4
            fields[name] = torch.randint(0, 4, (n, 2, p + t, 2), generator=g,
                                         dtype=torch.int16)
            continue
        shape = {"BT": (n, t), "B": (n,), "BP": (n, p)}[suffix]
        fields[name] = torch.randn(*shape, generator=g)
    return Experience(**fields)


def test_experience_batches():
    exp = make_experience()
    assert len(exp) == 6
    mini = list(exp.mini_batches(3, torch.Generator().manual_seed(1)))
    assert len(mini) == 2 and all(len(m) == 3 for m in mini)
    seen = sorted(m.scores_B[i].item() for m in mini for i in range(3))
    assert seen == sorted(exp.scores_B.tolist())
    micro = list(mini[0].micro_batches(1))
    assert len(micro) == 3 and torch.equal(micro[0].values_BT, mini[0].values_BT[:1])
    # the routing follows its rows (and a batch without one stays without)
    assert torch.equal(micro[0].routing_BLSK, mini[0].routing_BLSK[:1])
    row = int((exp.scores_B == mini[0].scores_B[0]).nonzero())
    assert torch.equal(mini[0].routing_BLSK[0], exp.routing_BLSK[row])
    assert Experience(**{**exp.__dict__, "routing_BLSK": None}).select([1]).routing_BLSK is None
    with pytest.raises(ValueError, match="Experience.routing_BLSK has shape"):
        Experience(**{**exp.__dict__, "routing_BLSK": exp.routing_BLSK[:, :, :5]})
    with pytest.raises(ValueError, match=r"samples on this rank \(6\) is not divisible"):
        list(exp.mini_batches(4))
    with pytest.raises(ValueError, match="Experience.values_BT has shape"):
        Experience(**{**exp.__dict__, "values_BT": torch.zeros(6, 5)})


# ------------------------------------------------------------------ PPO fidelity (issue 14)

def _loop_grpo(scores, mask, k, norm):
    """GRPO advantages by plain loops, per group, from the definitions."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for g in range(B // k):
        rows = range(g * k, (g + 1) * k)
        if norm == "token":
            vals = [float(scores[i]) for i in rows for t in range(T) if mask[i, t]]
            mean = sum(vals) / len(vals)
            std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
            for i in rows:
                for t in range(T):
                    if mask[i, t]:
                        out[i, t] = (float(scores[i]) - mean) / (std + 1e-5)
        else:
            vals = [float(scores[i]) for i in rows]
            mean = sum(vals) / k
            std = (sum((v - mean) ** 2 for v in vals) / (k - 1)) ** 0.5
            for i in rows:
                a = float(scores[i]) - mean
                if norm == "sequence":
                    a /= std + 1e-6
                for t in range(T):
                    if mask[i, t]:
                        out[i, t] = a
    return out


@pytest.mark.parametrize("norm", ["sequence", "token", "center"])
def test_grpo_normalisations_match_loops(norm):
    gen = torch.Generator().manual_seed(3)
    B, T, k = 8, 6, 4
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([1, 6, 3, 2, 5, 5, 4, 6])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).double()
    zeros = torch.zeros(B, T, dtype=torch.float64)
    adv, _ = algos.estimate_advantages("grpo", scores_B=scores, rewards_BT=zeros,
                                       values_BT=zeros, mask_BT=mask, gamma=1.0,
                                       lam=1.0, group_size=k, whiten=True, group_norm=norm)
    # float64 throughout: measured within 5e-16 of the loop
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, _loop_grpo(scores, mask, k, norm), rtol=0, atol=1e-13)
    if norm == "token":  # token-level normalisation: the group's tokens average to zero
        assert abs(float((adv * mask)[:4].sum())) < 1e-12


def test_overlong_penalty_is_dapos_linear_ramp():
    lengths = torch.tensor([0, 12, 13, 14, 15, 16, 20])
    got = algos.overlong_penalty(lengths, max_len=16, buffer=4, penalty=0.5)
    want = [0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]
    assert got.tolist() == pytest.approx(want)
    assert algos.overlong_penalty(lengths, 16, 0).abs().sum() == 0


def test_value_loss_coef_scales_the_loss():
    gen = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(3, 5, generator=gen) for _ in range(3))
    mask = torch.ones(3, 5)
    half, _, _ = algos.value_loss(v, old, ret, mask, 0.2)
    one, _, _ = algos.value_loss(v, old, ret, mask, 0.2, coef=1.0)
    torch.testing.assert_close(one, 2 * half)


def test_policy_loss_token_weights_multiply_each_token():
    gen = torch.Generator().manual_seed(1)
    lp, old, adv = (torch.randn(2, 4, generator=gen) * 0.1 for _ in range(3))
    mask = torch.ones(2, 4)
    w = torch.rand(2, 4, generator=gen) * 2
    total, count, _ = algos.policy_loss(lp, old, adv, mask, 0.2, token_weights_BT=w)
    ratio = torch.exp(lp - old)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * w
    torch.testing.assert_close(total, per_token.sum())
    assert count == 8


def test_batch_sizes_count_samples_not_prompts():
    """8 prompts x 4 responses = 32 samples: one mini-batch of 32 is valid (GRPO)."""
    sizes = BatchSizes(rollout_batch_size=8, mini_batch_size=32, micro_batch_size=4,
                       dp_size=2, group_size=4).validate()
    assert sizes.num_mini_batches == 1 and sizes.micro_batches_per_mini_batch == 4
    with pytest.raises(ValueError, match="is not divisible by ppo.mini_batch_size"):
        BatchSizes(8, 24, 4, 1, 4).validate()


def test_every_derived_seed_keeps_its_value():
    """algos.seeds.derive_seed holds every seed a run derives (issue 56: one function, not
    nine multipliers at their call sites). A change here changes every run's samples,
    orders and shuffles - and the resume of every run saved before it."""
    from megarlhf.algos.seeds import derive_seed

    assert derive_seed("row", 3, 5) == 3 * 1000003 + 5
    assert derive_seed("turn", 3, 5, 2) == (3 * 1000003 + 5) * 64 + 2
    assert derive_seed("refill", 3, 2) == 3 * 65537 + 2
    assert derive_seed("prompt_round", 3, 2) == derive_seed("supervised_epoch", 3, 2) \
        == 3 + 7919 * 2
    assert derive_seed("prompt_epoch", 3, 2) == 3 + 104729 * 2
    assert derive_seed("ptx", 3) == 34 and derive_seed("update", 3, 4) == 25
    with pytest.raises(ValueError, match="no seed stream"):
        derive_seed("rows", 3)
