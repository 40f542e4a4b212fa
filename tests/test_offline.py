"""The frozen-model cache, DPO and distillation (issue 16).

DPO's loss and gradients against a plain loop and TRL's formulas; distillation's top-k KL
against a loop; the cache against recomputation, killed builds, damaged shards and stale
keys; DPO at TP=2, PP=2 and DP=2 against one process, with the cache built at TP=2 read at
PP=2 equal to recomputing the reference every step; and both stages learning on the
synthetic task through the CLI."""

import dataclasses
import inspect
import json
import math
import os

import pytest
import torch

from conftest import run_cli, torchrun
from megarlhf.algos.preference import dpo_loss, topk_kl


# ------------------------------------------------------------------ losses

def loop_dpo(pc, pr, rc, rr, beta, loss, eps):
    out = []
    for a, b, c, d in zip(pc, pr, rc, rr, strict=True):
        h = (a - c) - (b - d)
        if loss == "sigmoid":
            sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
            out.append(-(1 - eps) * math.log(sig(beta * h)) - eps * math.log(sig(-beta * h)))
        else:
            out.append((h - 1 / (2 * beta)) ** 2)
    return out


@pytest.mark.parametrize("loss, eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_loss_and_gradients_match_a_loop(loss, eps):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.3, loss=loss,
                                        label_smoothing=eps)
    want = loop_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), 0.3, loss, eps)
    assert torch.allclose(losses, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(chosen, 0.3 * (pc - rc)) and torch.allclose(rejected, 0.3 * (pr - rr))
    losses.sum().backward()
    # d/dpc by central differences of the loop
    h = 1e-6
    for i in range(6):
        up, down = pc.detach().clone(), pc.detach().clone()
        up[i] += h
        down[i] -= h
        num = (loop_dpo(up.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), 0.3, loss, eps)[i]
               - loop_dpo(down.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), 0.3, loss,
                          eps)[i]) / (2 * h)
        assert abs(pc.grad[i].item() - num) < 1e-6
    # At the reference (policy == reference) the sigmoid loss is log 2 and nothing moves
    # the implicit rewards.
    if loss == "sigmoid" and eps == 0.0:
        at_ref, c0, r0 = dpo_loss(rc, rr, rc, rr, beta=0.3)
        assert torch.allclose(at_ref, torch.full_like(at_ref, math.log(2)))
        assert c0.abs().max() == 0 and r0.abs().max() == 0


def test_dpo_loss_equals_trls():
    """TRL 1.12's DPOTrainer computes the losses inline in ``_compute_loss``; these are its
    sigmoid and IPO lines (asserted present), evaluated on the same numbers."""
    import torch.nn.functional as F
    from trl import DPOTrainer

    src = inspect.getsource(DPOTrainer._compute_loss)
    for line in ("per_sequence_loss = -F.logsigmoid(self.beta * delta_score)",
                 "chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)",
                 "per_sequence_loss = (ipo_delta - 1 / (2 * self.beta)) ** 2"):
        assert line in src, line
    g = torch.Generator().manual_seed(1)
    pc, pr, rc, rr = (torch.randn(5, generator=g, dtype=torch.float64) * 4 for _ in range(4))
    n_c, n_r = torch.tensor([3., 5, 1, 7, 2]), torch.tensor([4., 2, 6, 1, 3])
    beta = 0.25
    delta = (pc - rc) - (pr - rr)
    trl_sigmoid = -F.logsigmoid(beta * delta)
    ours, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
    assert torch.allclose(ours, trl_sigmoid, atol=1e-12)
    trl_ipo = ((pc - rc) / n_c - (pr - rr) / n_r - 1 / (2 * beta)) ** 2
    ours, _, _ = dpo_loss(pc / n_c, pr / n_r, rc / n_c, rr / n_r, beta=beta, loss="ipo")
    assert torch.allclose(ours, trl_ipo, atol=1e-12)


def loop_kl(t_logits, s_logits, k, divergence):
    """Full softmax of both; the teacher's top-k ids and one bucket for the rest."""
    p, q = torch.softmax(t_logits.double(), -1), torch.softmax(s_logits.double(), -1)
    out = torch.zeros(t_logits.shape[:-1], dtype=torch.float64)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in t_logits.shape[:-1])):
        idx = tuple(idx.tolist())
        top = torch.topk(p[idx], k).indices.tolist()
        pt = [p[idx][i].item() for i in top] + [1 - sum(p[idx][i].item() for i in top)]
        ps = [q[idx][i].item() for i in top] + [1 - sum(q[idx][i].item() for i in top)]
        a, b = (pt, ps) if divergence == "forward" else (ps, pt)
        out[idx] = sum(x * (math.log(x) - math.log(y)) for x, y in zip(a, b, strict=True) if x > 0)
    return out


@pytest.mark.parametrize("divergence", ["forward", "reverse"])
def test_topk_kl_matches_a_loop_and_full_kl_at_full_k(divergence):
    from megarlhf.models.logprobs import vocab_parallel_gather_logprobs, vocab_parallel_topk

    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(2, 3, 12, generator=g) * 2
    student = torch.randn(2, 3, 12, generator=g, requires_grad=True)
    t_lp, ids = vocab_parallel_topk(teacher, 4)
    s_lp = vocab_parallel_gather_logprobs(student, ids)
    kl = topk_kl(s_lp, t_lp, divergence)
    assert torch.allclose(kl.double(), loop_kl(teacher, student.detach(), 4, divergence),
                          atol=1e-5)
    kl.sum().backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0
    t_all, ids_all = vocab_parallel_topk(teacher, 12)
    full = topk_kl(vocab_parallel_gather_logprobs(student.detach(), ids_all), t_all,
                   divergence)
    p, q = torch.log_softmax(teacher, -1), torch.log_softmax(student.detach(), -1)
    exact = ((p.exp() * (p - q)) if divergence == "forward" else (q.exp() * (q - p))).sum(-1)
    assert torch.allclose(full, exact, atol=1e-5)


# ------------------------------------------------------------------ the cache

def test_cache_equals_recomputation_and_refuses_what_is_stale(tiny_checkpoints, tmp_path):
    """Built and read in one process: equal to scoring, padded or packed; a build killed
    before its manifest (or a shard cut short, or one byte of it changed in place: rebuilt)
    is detected; another checkpoint, data or
    temperature is named; a frozen model that scores NaN is refused, naming the cache,
    before anything is written (the old build wrote the NaNs and DPO trained on them)."""
    from megarlhf.config import load_config
    from megarlhf.engine import logit_cache as lc
    from megarlhf.engine.checkpoint import use_checksums
    from megarlhf.roles.spec import single_role_spec
    from megarlhf.roles.build import build_role
    from megarlhf.parallel.launch import init_distributed, shutdown
    from megarlhf.stages.score import score_sequences

    out = tiny_checkpoints[0]
    ckpt, older = f"{out}/sft-tiny/checkpoints", f"{out}/sft-tiny/checkpoints/step_0000003"
    cfg = load_config(None, [f"checkpoint.load={ckpt}", "parallel.make_vocab_size_divisible_by=16"])
    rows = [[3, 7, 9, 11, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    path = str(tmp_path / "cache")
    init_distributed(cfg)
    try:
        role = build_role(single_role_spec(cfg, name="policy", kind="lm", world_size=1,
                                           trained=False), seed=0)
        key = lc.make_key(ckpt, "policy", rows, top_k=3)
        lc.build_cache(role, rows, path, key, micro_batch_size=2, max_len=32)
        cache = lc.load_cache(path, key)
        scored = score_sequences(role, rows, micro_batch_size=1)
        for row, got in zip(scored, cache.logprobs, strict=True):
            assert torch.allclose(torch.tensor(row["logprobs"]), got, atol=1e-6)
        assert cache.topk_ids[0].shape == (4, 3)
        # the cached top-1 log-prob is at least the scored token's
        assert (cache.topk_logprobs[0][:, 0] >= cache.logprobs[0] - 1e-6).all()
        # packed (issue 39): rows back to back, the same numbers
        lc.build_cache(role, rows, str(tmp_path / "packed"), key, micro_batch_size=2,
                       max_len=32, max_tokens=12)
        packed = lc.load_cache(str(tmp_path / "packed"), key)
        for name in ("logprobs", "topk_logprobs"):
            for a, b in zip(getattr(cache, name), getattr(packed, name), strict=True):
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6), name
        assert all(torch.equal(a, b) for a, b in zip(cache.topk_ids, packed.topk_ids))

        assert lc.inspect(path, lc.make_key(older, "policy", rows, top_k=3))[0] == "stale"
        status, why = lc.inspect(path, lc.make_key(ckpt, "policy", rows[:2], top_k=3))
        assert status == "stale" and "data:" in why and "rows:" in why
        status, why = lc.inspect(path, lc.make_key(ckpt, "policy", rows, top_k=3,
                                                   temperature=0.7))
        assert status == "stale" and "temperature: cache has 1.0, this run needs 0.7" in why
        with pytest.raises(lc.CacheError, match="checkpoint: cache has 'step_0000006"):
            lc.ensure_cache(path, lc.make_key(older, "policy", rows, top_k=3),
                            lambda: None, on_stale="error")

        shard = next(p for p in os.listdir(path) if p.endswith(".safetensors"))
        file = os.path.join(path, shard)
        with open(file, "r+b") as f:  # one byte changed in place: loads, with a wrong value
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
        assert lc.inspect(path, key) == ("damaged", f"{file} was changed since the save (its "
                                         "SHA-256 is not the one recorded)")
        try:
            use_checksums(False)  # checkpoint.checksums=false: taken as it is
            assert lc.inspect(path, key) == ("complete", "")
        finally:
            use_checksums(True)
        messages = []
        rebuilt = lc.ensure_cache(path, key, lambda: lc.build_cache(
            role, rows, path, key, micro_batch_size=2, max_len=32), on_stale="rebuild",
            log=messages.append)
        assert "is damaged" in messages[0] and "rebuilding" in messages[0], messages
        assert all(torch.equal(a, b) for a, b in zip(rebuilt.topk_logprobs, cache.topk_logprobs))
        with open(os.path.join(path, shard), "r+b") as f:  # cut short: a damaged disk
            f.truncate(100)
        assert lc.inspect(path, key) == ("incomplete", f"shard {shard} has 100 bytes, the "
                                         f"manifest says {json.load(open(os.path.join(path, lc.MANIFEST)))['shards'][0]['bytes']}")
        os.remove(os.path.join(path, lc.MANIFEST))  # a build killed before its manifest
        assert lc.inspect(path, key)[0] == "incomplete"
        os.makedirs(str(tmp_path / ".tmp-cache-deadbeef"))  # leftover of a killed build
        messages = []
        rebuilt = lc.ensure_cache(path, key, lambda: lc.build_cache(
            role, rows, path, key, micro_batch_size=2, max_len=32), on_stale="rebuild",
            log=messages.append)
        assert "has no manifest.json" in messages[0] and "rebuilding" in messages[0]
        assert all(torch.equal(a, b) for a, b in zip(rebuilt.logprobs, cache.logprobs, strict=True))
        assert not (tmp_path / ".tmp-cache-deadbeef").exists()
        # damaged weights (a NaN in the final norm): the build names the cache, writes nothing
        norm = next(p for n, p in role.model[0].named_parameters() if "final_layernorm" in n)
        with torch.no_grad():
            norm[0] = float("nan")
        with pytest.raises(lc.CacheError, match=r"cache .*nan_cache: \d+ of the frozen "
                                                r"model's log-probs are not finite"):
            lc.build_cache(role, rows, str(tmp_path / "nan_cache"), key, micro_batch_size=2,
                           max_len=32)
        assert not (tmp_path / "nan_cache").exists()
    finally:
        shutdown()


# ------------------------------------------------------------------ through the CLI

def dpo_args(tiny, name, *extra):
    out, task, common = tiny
    return ["dpo", "configs/dpo_tiny.yaml", f"data.train_path={task['prefs']}",
            f"checkpoint.load={out}/sft-tiny/checkpoints", f"run.name={name}",
            "train.max_steps=4", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.eval_interval=0", "logging.progress_bar=false",
            f"cache.path={out}/dpo-cache", "dpo.gold_reward_fn=null",
            "dpo.gold_eval_path=null", *common, *extra]


def losses(out, name):
    """Every metric per step (a step's train and eval rows merged)."""
    from megarlhf.engine.metrics import read_metrics
    merged: dict = {}
    for r in read_metrics(os.path.join(out, name)):
        merged.setdefault(r["step"], {}).update(r)
    return merged


@pytest.mark.slow
@pytest.mark.extended
def test_dpo_layouts_equal_one_process_and_cache_equals_recomputation(tiny_checkpoints):
    """The reference cache is built at TP=2 in packed micro-batches (``megarlhf cache
    build``); DPO at PP=2 and TP=2 reads it; DP=2 with packed micro-batches recomputes the reference every step; each
    equals one padded process that recomputes the reference every step
    (dpo.use_cache=false)."""
    out = tiny_checkpoints[0]
    built = torchrun(["cache", "build", "dpo", *dpo_args(tiny_checkpoints, "dpo-build",
                      "roles.reference.parallel.tensor_model_parallel_size=2",
                      "cache.max_tokens_per_micro_batch=96")[1:]], 2)
    assert "reference at TP=2 PP=1 DP=1 scores" in built.stdout
    assert "in packed micro-batches of 96 tokens" in built.stdout
    single = run_cli(*dpo_args(tiny_checkpoints, "dpo-1", "dpo.use_cache=false"))
    assert "reference resident" in single.stdout
    pp2 = torchrun(dpo_args(tiny_checkpoints, "dpo-pp2",
                            "parallel.pipeline_model_parallel_size=2"), 2)
    assert "complete, " in pp2.stdout and "the reference model is not resident" in pp2.stdout
    torchrun(dpo_args(tiny_checkpoints, "dpo-tp2",
                      "parallel.tensor_model_parallel_size=2"), 2)
    # packed (issue 39): the reference's passes and the policy's, shares balanced by tokens
    packed = torchrun(dpo_args(tiny_checkpoints, "dpo-dp2", "dpo.use_cache=false",
                               "train.max_tokens_per_micro_batch=96"), 2)
    assert "packed micro-batches of at most 96 tokens" in packed.stdout
    ref = losses(out, "dpo-1")
    assert ref[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    for name in ("dpo-tp2", "dpo-dp2", "dpo-pp2"):
        got = losses(out, name)
        assert sorted(got) == sorted(ref)
        for step, row in ref.items():
            for key, value in row.items():
                if key.endswith("accuracy"):
                    continue  # counts signs of rewards that start as rounding noise (1e-8)
                if key.startswith(("train/loss", "train/rewards", "eval/")):
                    assert got[step][key] == pytest.approx(value, abs=2e-6), (name, step, key)
    assert ref[4]["train/rewards/margin"] > 0


@pytest.mark.slow
def test_distillation_lowers_the_kl_to_the_teacher(tiny_checkpoints):
    """A smaller student distilled from the SFT policy's top-k moves towards it: the
    held-out KL falls. (DPO raising the gold score: tests/test_ppo.py, whose SFT policy is
    trained long enough to have something to prefer.)"""
    out, task, common = tiny_checkpoints
    run_cli("distill", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            f"distill.teacher_checkpoint={out}/sft-tiny/checkpoints", "model.hidden_size=32",
            "run.name=distill", "train.max_steps=20", "train.eval_interval=10",
            "optimizer.lr=3e-3", "logging.progress_bar=false", *common)
    kl = [r["eval/kl"] for _, r in sorted(losses(out, "distill").items()) if "eval/kl" in r]
    assert len(kl) == 3 and kl[2] < 0.8 * kl[0], kl


def test_bad_dpo_and_distill_settings_are_refused_before_any_work(tiny_checkpoints):
    from megarlhf.config import ConfigError, load_config
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.stages.offline import distill_specs, dpo_specs

    out, task, common = tiny_checkpoints
    base = [f"tokenizer.path={task['tokenizer']}", "parallel.make_vocab_size_divisible_by=16",
            "data.max_seq_len=32", "data.max_prompt_len=16"]
    tok = load_tokenizer(load_config(None, base).tokenizer)

    def cfg(*extra):
        c = load_config(None, [*base, *extra])
        return dataclasses.replace(c, model=dataclasses.replace(
            c.model, vocab_size=c.model.vocab_size or tok.vocab_size))

    with pytest.raises(ConfigError, match="DPO needs a reference"):
        dpo_specs(cfg(), tok)
    with pytest.raises(ConfigError, match="roles.teacher is configured but dpo has no teacher"):
        dpo_specs(cfg(f"checkpoint.load={out}/sft-tiny/checkpoints",
                      "roles.teacher.parallel.tensor_model_parallel_size=1"), tok)
    with pytest.raises(ConfigError, match="is a value model .* needs a language model"):
        dpo_specs(cfg(f"checkpoint.load={out}/sft-tiny/checkpoints",
                      f"dpo.reference_checkpoint={out}/rm-tiny/checkpoints"), tok)
    with pytest.raises(ConfigError, match="distill needs a teacher"):
        distill_specs(cfg(), tok)
    with pytest.raises(ConfigError, match="label_smoothing"):
        cfg("dpo.loss=ipo", "dpo.label_smoothing=0.1")
    with pytest.raises(ConfigError, match="go together"):
        cfg("dpo.gold_reward_fn=megarlhf.data.synthetic:gold_reward_pair")
    with pytest.raises(ConfigError, match="roles.teacher is configured but ppo"):
        from megarlhf.roles.spec import ppo_role_specs
        ppo_role_specs(cfg(f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
                           f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints",
                           "roles.teacher.parallel.tensor_model_parallel_size=1"), 1)
