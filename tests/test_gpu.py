"""The CUDA path (marked ``gpu``; skipped without CUDA): the same seeded models give the
same numbers on the GPU as on the CPU (fp32), bf16 stays close to fp32, KV-cached
generation, offload/reload, resharding over NCCL, and the CLI's SFT, reward-model and PPO
runs with a checkpoint resume on the GPU. The TransformerEngine/fp8 case also needs TE.
The CPU rejection messages are tested everywhere."""

import json
import os

import pytest
import torch

from conftest import WORKERS, run_cli, torchrun
from megarlhf.config import load_config
from megarlhf.models.spec import resolve_impl, transformer_engine_available
from workers.gpu_paths import PROMPTS

FP32_TOL = 1e-4  # CUDA vs CPU kernels in fp32 (TF32 is off for matmuls by default)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rejection")
def test_fp8_and_te_rejected_without_cuda():
    cfg = load_config(None, ["model.fp8.enabled=true", "model.params_dtype=bfloat16"])
    with pytest.raises(ValueError, match="needs TransformerEngine and a CUDA GPU"):
        resolve_impl(cfg.model)
    cfg = load_config(None, ["model.transformer_impl=transformer_engine"])
    with pytest.raises(ValueError, match="TransformerEngine cannot be used here"):
        resolve_impl(cfg.model)
    assert resolve_impl(load_config(None).model) == "local"


def test_backend_choice():
    from megarlhf.parallel.launch import process_group_backend
    assert process_group_backend("auto", cuda=False) == "gloo"
    assert process_group_backend("auto", cuda=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("nccl", cuda=True) == "cuda:nccl,cpu:gloo"
    with pytest.raises(ValueError, match="needs CUDA"):
        process_group_backend("nccl", cuda=False)
    with pytest.raises(ValueError, match="use 'auto'"):
        process_group_backend("gloo", cuda=True)


def test_auto_layers_and_packed_attention_by_dtype(monkeypatch):
    """TransformerEngine's attention has no float32 kernel for packed (THD) micro-batches
    (seen on an H200 with TE 2.10: "No dot product attention backend is available"), and
    packing is PPO's default: 'auto' picks its layers in bfloat16 and float16 only, and
    its layers in float32 refuse a packed micro-batch naming the ways out, before TE's
    own message."""
    from types import SimpleNamespace

    import megarlhf.models.spec as spec
    from megarlhf.engine.steps import attention_inputs

    monkeypatch.setattr(spec, "transformer_engine_available", lambda: True)
    impl = lambda *o: spec.resolve_impl(load_config(None, list(o)).model)  # noqa: E731
    assert impl() == "local"
    assert impl("model.params_dtype=bfloat16") == "transformer_engine"
    assert impl("model.params_dtype=float16") == "transformer_engine"
    assert impl("model.transformer_impl=transformer_engine") == "transformer_engine"
    packed = {"tokens": torch.zeros(1, 6, dtype=torch.long),
              "cu_seqlens": torch.tensor([0, 2, 6])}
    for impl_name, dtype in (("transformer_engine", torch.float32), ("local", torch.float32),
                             ("transformer_engine", torch.bfloat16)):
        model = SimpleNamespace(config=SimpleNamespace(transformer_impl=impl_name,
                                                       params_dtype=dtype))
        refusal = spec.packed_attention_refusal(impl_name, dtype)
        if (impl_name, dtype) == ("transformer_engine", torch.float32):
            assert "model.params_dtype=bfloat16" in refusal and "--max-tokens" in refusal
            with pytest.raises(ValueError, match="cannot take packed micro-batches"):
                attention_inputs(model, packed)
        else:
            assert refusal is None
            mask, extra = attention_inputs(model, packed)
            assert mask is None and extra["packed_seq_params"].qkv_format == "thd"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The worker once on the CPU (CUDA hidden) and once on the GPU."""
    out = str(tmp_path_factory.mktemp("gpu_paths"))
    worker = os.path.join(WORKERS, "gpu_paths.py")
    torchrun(worker, 1, out, env={"CUDA_VISIBLE_DEVICES": ""})
    torchrun(worker, 1, out)
    load = lambda name: torch.load(os.path.join(out, f"gpu_paths_{name}.pt"),  # noqa: E731
                                   weights_only=False)
    return load("cpu"), load("cuda")


def max_gap(rows_a, rows_b) -> float:
    return max(float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())
               for a, b in zip(rows_a, rows_b, strict=True))


def mean_gap(rows_a, rows_b) -> float:
    gaps = torch.cat([(torch.as_tensor(a) - torch.as_tensor(b)).abs().flatten()
                      for a, b in zip(rows_a, rows_b, strict=True)])
    return float(gaps.mean())


@pytest.mark.gpu
def test_cuda_logprobs_equal_cpu(paths):
    cpu, cuda = paths
    assert cpu["fp32"]["device"] == "cpu" and cuda["fp32"]["device"].startswith("cuda")
    gap = max_gap(cpu["fp32"]["logprobs"], cuda["fp32"]["logprobs"])
    print(f"\nfp32 log-probs, CUDA vs CPU: max |diff| {gap:.2e}")
    assert gap < FP32_TOL


@pytest.mark.gpu
def test_cuda_kv_cached_generation(paths):
    """Greedy with the KV cache equals full recompute on CUDA, and equals the CPU's tokens
    in fp32; sampled log-probs equal teacher-forced scoring (no rollout/train mismatch)."""
    cpu, cuda = paths
    for dtype in ("fp32", "bf16"):
        cached, full = cuda[dtype]["greedy_cached"], cuda[dtype]["greedy_full"]
        assert cached.fed_mask_BT.sum() > 0
        if dtype == "fp32":
            assert torch.equal(cached.response_tokens_BT, full.response_tokens_BT)
            assert (cached.logprobs_BT - full.logprobs_BT).abs().max() < FP32_TOL
    assert torch.equal(cuda["fp32"]["greedy_cached"].response_tokens_BT,
                       cpu["fp32"]["greedy_cached"].response_tokens_BT)
    sampled = cuda["fp32"]["sampled"]
    for b, prompt in enumerate(PROMPTS):
        n = int(sampled.fed_mask_BT[b].sum())
        teacher = torch.as_tensor(cuda["fp32"]["teacher"][b])[len(prompt) - 1:][:n]
        assert (teacher - sampled.logprobs_BT[b, :n]).abs().max() < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["moe", "lora", "olmo3"])
def test_cuda_moe_and_lora_equal_cpu(paths, name):
    """fp32: a mixture of experts (its routing too), a model with non-zero LoRA adapters
    (their gradients too) and an OLMo-3-shaped one (issue 61: its windows through the
    CUDA-graph decode step) give the CPU's numbers on the GPU, and greedy decoding the
    CPU's tokens. Catches a device-specific path of any: the experts' dispatch, the
    adapters' matmuls in a CUDA graph or out of one, a window mask built on the wrong
    device or captured stale."""
    cpu, cuda = (side[name] for side in paths)
    gap = max_gap(cpu["logprobs"], cuda["logprobs"])
    print(f"\n{name}: fp32 log-probs, CUDA vs CPU: max |diff| {gap:.2e}")
    assert gap < FP32_TOL
    assert cpu["greedy"].fed_mask_BT.sum() > 0
    assert torch.equal(cpu["greedy"].response_tokens_BT, cuda["greedy"].response_tokens_BT)
    assert (cpu["greedy"].logprobs_BT - cuda["greedy"].logprobs_BT).abs().max() < FP32_TOL
    if name == "moe":
        assert torch.equal(cpu["greedy"].routing_BLSK, cuda["greedy"].routing_BLSK.cpu())
    elif name == "lora":
        assert max(float(g.abs().max()) for g in cpu["adapter_grads"]) > 0
        assert max_gap(cpu["adapter_grads"], cuda["adapter_grads"]) < FP32_TOL


@pytest.mark.gpu
def test_bf16_gap_to_fp32_and_rollout_train_mismatch(paths):
    """bf16 weights and compute (the precision real runs use) against fp32 on the same
    seeded model; and in bf16, the sampler's log-probs against the trainer's."""
    _, cuda = paths
    gap_max = max_gap(cuda["fp32"]["logprobs"], cuda["bf16"]["logprobs"])
    gap_mean = mean_gap(cuda["fp32"]["logprobs"], cuda["bf16"]["logprobs"])
    sampled = cuda["bf16"]["sampled"]
    rollout, train = [], []
    for b, prompt in enumerate(PROMPTS):
        n = int(sampled.fed_mask_BT[b].sum())
        train.append(torch.as_tensor(cuda["bf16"]["teacher"][b])[len(prompt) - 1:][:n])
        rollout.append(sampled.logprobs_BT[b, :n])
    mismatch_max, mismatch_mean = max_gap(rollout, train), mean_gap(rollout, train)
    print(f"\nbf16 vs fp32 log-probs: mean |diff| {gap_mean:.2e}, max {gap_max:.2e}; "
          f"bf16 rollout vs train log-probs: mean |diff| {mismatch_mean:.2e}, "
          f"max {mismatch_max:.2e}")
    # bf16 keeps 8 bits of mantissa: log-probs near -log(300) = -5.7 move by ~1e-2.
    assert 0 < gap_mean < 0.05 and gap_max < 0.5
    assert mismatch_mean < 0.05 and mismatch_max < 0.5


@pytest.mark.gpu
def test_cuda_offload_frees_the_parameters_and_reload_is_exact(paths):
    _, cuda = paths
    for dtype in ("fp32", "bf16"):
        off = cuda[dtype]["offload"]
        assert off["param_bytes"] <= off["freed"] <= off["param_bytes"] * 1.05, off
        assert off["pinned"]  # host copies in page-locked memory
        for a, b in zip(off["logprobs"], cuda[dtype]["logprobs"], strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


@pytest.mark.gpu
def test_cuda_reshard_through_nccl_copy_service(paths):
    _, cuda = paths
    r = cuda["reshard"]
    assert r["service"] == "nccl"
    assert r["bytes"] > 0
    assert max_gap(r["train"], r["inference"]) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.slow
def test_cli_sft_rm_ppo_and_resume_on_cuda(tiny_checkpoints, tmp_path):
    """SFT and the reward model (the shared fixture) and PPO through the CLI on the GPU; a
    PPO run resumed from its iteration-1 checkpoint matches the uninterrupted run; the SFT
    checkpoint written on the GPU scores the same on the CPU."""
    from megarlhf.engine.metrics import read_metrics

    out, task, common = tiny_checkpoints

    def ppo(name, iterations):
        return run_cli("ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
                       f"data.eval_path={task['eval_prompts']}", f"run.name={name}",
                       f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
                       f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints",
                       "ppo.num_eval_prompts=8", "ppo.eval_interval=2",
                       "logging.sample_table_interval=0", f"ppo.num_iterations={iterations}",
                       "checkpoint.save_interval=1", *common)

    ppo("gpu_full", 2)
    ppo("gpu_resumed", 1)
    resumed = ppo("gpu_resumed", 2)
    assert "resumed iter_000001" in resumed.stdout
    full = {r["step"]: r for r in read_metrics(str(out / "gpu_full"))}
    again = {r["step"]: r for r in read_metrics(str(out / "gpu_resumed"))}
    assert sorted(full) == sorted(again) == [0, 1, 2]
    for key, value in full[2].items():
        if key.startswith(("timing/", "perf/", "memory/")) or not isinstance(value, float):
            continue
        assert abs(again[2][key] - value) <= 1e-4 * max(1.0, abs(value)), (key, value,
                                                                           again[2][key])
    for row in full.values():
        assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN

    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text("\n".join(json.dumps({"tokens": t}) for t in ([3, 7, 9, 11], [5, 6, 7])))
    scores = {}
    for device, env in (("cuda", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        dest = tmp_path / f"score_{device}.jsonl"
        run_cli("score", "--config", "configs/sft_tiny.yaml", "--input", str(seqs),
                "--output", str(dest), f"checkpoint.load={out}/sft-tiny/checkpoints",
                f"tokenizer.path={task['tokenizer']}", env=env)
        scores[device] = [json.loads(line) for line in dest.read_text().splitlines()]
    for a, b in zip(scores["cuda"], scores["cpu"], strict=True):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason=(
    "measured on one H100 (2026-11-23): the plan's exact parts match and offload is bitwise "
    "neutral, but the allocator's rollout peak was 71.37 MB with offload against 70.25 MB "
    "without, though 1.65 MB of live storage left; the actor's parameters are still "
    "resident while it is resharded at the start of the phase, and the rest is not "
    "explained yet"))
def test_cuda_memory_plan_and_trained_role_offload(tiny_checkpoints):
    """On the GPU the plan's exact parts equal the measured bytes, offload (pinned host
    memory) is bitwise neutral, and the allocator's rollout peak falls by at least the
    bytes that left."""
    from test_memory import base_overrides, exact_parts, run_cases, OFFLOAD

    load = run_cases(tiny_checkpoints[0], base_overrides(tiny_checkpoints),
                     {"cuda_none": [], "cuda_offload": OFFLOAD}, 1, "cuda")
    (none,), (off,) = load("cuda_none"), load("cuda_offload")
    for result in (none, off):
        assert exact_parts(result) == exact_parts(result, "planned")
    assert none["metrics"] == off["metrics"]
    freed = none["measured_totals"]["rollout"] - off["measured_totals"]["rollout"]
    peak = "rollout/all/peak_allocated"
    assert freed > 0 and none["measured"][peak] - off["measured"][peak] >= freed


@pytest.mark.gpu
def test_te_spec_fp8_forward_single_gpu():
    if not transformer_engine_available():
        pytest.skip("TransformerEngine is not installed (pip install -e .[fp8])")
    import torch.distributed as dist

    from megarlhf.roles.spec import single_role_spec
    from megarlhf.roles.build import build_role
    from megarlhf.models.logprobs import vocab_parallel_logprobs
    from megarlhf.parallel.launch import init_distributed, shutdown

    cfg = load_config(None, [
        "model.vocab_size=256", "model.hidden_size=128", "model.num_attention_heads=4",
        "model.num_layers=2", "model.params_dtype=bfloat16", "model.fp8.enabled=true",
        "model.fp8.recipe=delayed", "model.fp8.amax_history_len=16"])
    assert resolve_impl(cfg.model) == "transformer_engine"
    spec = single_role_spec(cfg, name="model", kind="lm", world_size=1, trained=False)
    init_distributed(cfg)
    try:
        role = build_role(spec, seed=cfg.run.seed)
        layout, (model,) = role.layout, role.chunks
        tokens = torch.randint(0, 256, (2, 32), device="cuda")
        pos = torch.arange(32, device="cuda").expand(2, -1)
        logits = model(tokens, pos, None)
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:],
                                              tp_group=layout.tp_group, true_vocab=256)
        assert torch.isfinite(logprobs).all()
        assert "nccl" in dist.get_backend()
    finally:
        shutdown()


@pytest.mark.slow
def test_bf16_reward_model_trains_and_saves(tiny_checkpoints):
    """bf16 weights on any device: every weight in one dtype (megatron's local norms are
    built in fp32 otherwise, and the distributed optimizer's checkpoint mapping then
    breaks on the scalar head); a bf16 reward model trains and saves its checkpoint."""
    import torch.distributed as dist

    from megarlhf.roles.build import build_from_config
    from megarlhf.parallel.launch import init_distributed, shutdown

    cfg = load_config(None, ["model.vocab_size=64", "model.hidden_size=32",
                             "model.num_attention_heads=4", "model.num_layers=1",
                             "model.params_dtype=bfloat16"])
    init_distributed(cfg)
    try:
        for kind in ("lm", "value"):
            role = build_from_config(cfg, kind=kind, trained=True)
            assert {p.dtype for p in role.parameters} == {torch.bfloat16}, kind
    finally:
        shutdown()
    assert not dist.is_initialized()
    out, task, common = tiny_checkpoints
    args = ["rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}",
            "model.params_dtype=bfloat16", "checkpoint.save_interval=1", "run.name=rm-bf16",
            *common]
    proc = run_cli(*args, "train.max_steps=1")
    assert "saved checkpoint" in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_cuda_packed_scores_equal_padded(tmp_path, impl):
    """Packed micro-batches on CUDA (issue 39): ``megarlhf score --max-tokens`` through
    megatron-core's THD format - TransformerEngine's varlen attention, or the local
    layers' per-sample SDPA - gives the padded run's log-probs and a value model's
    values: in float32 for the local layers, in bfloat16 for TransformerEngine's (its
    packed attention has no float32 kernel), within bf16's rounding."""
    if impl == "transformer_engine" and not transformer_engine_available():
        pytest.skip("TransformerEngine is not installed (pip install -e .[fp8])")
    from test_layouts import read_rows, write_sequences

    seqs = tmp_path / "seqs.jsonl"
    write_sequences(seqs)
    bf16 = impl == "transformer_engine"
    common = ["model.vocab_size=500", "model.num_layers=4", "model.num_query_groups=2",
              "run.seed=11", f"model.transformer_impl={impl}",
              "model.value_head_init=normal",
              f"model.params_dtype={'bfloat16' if bf16 else 'float32'}"]
    rows = {}
    for name, extra in [("lm_padded", []), ("lm_packed", ["--max-tokens", "80"]),
                        ("value_padded", ["--role", "value"]),
                        ("value_packed", ["--role", "value", "--max-tokens", "80"])]:
        out = tmp_path / f"{name}.jsonl"
        run_cli("score", "--input", str(seqs), "--output", str(out), *extra, *common)
        rows[name] = read_rows(out)
    for kind, key in (("lm", "logprobs"), ("value", "values")):
        gap = max_gap([r[key] for r in rows[f"{kind}_padded"]],
                      [r[key] for r in rows[f"{kind}_packed"]])
        print(f"\n{impl} {kind} packed vs padded on CUDA: max |diff| {gap:.2e}")
        assert gap < (0.25 if bf16 else FP32_TOL)


@pytest.mark.gpu
def test_te_sliding_windows_equal_the_local_layers(tmp_path):
    """Sliding windows through TransformerEngine's attention (issue 61: megatron hands TE
    window_size and window_attn_skip_freq) against megarlhf's SDPA band, bf16, padded and
    packed: within bf16's rounding. Catches TE given no window, the window off by one,
    or the full layer windowed too."""
    if not transformer_engine_available():
        pytest.skip("TransformerEngine is not installed (pip install -e .[fp8])")
    from test_layouts import read_rows, write_sequences

    seqs = tmp_path / "seqs.jsonl"
    write_sequences(seqs)
    common = ["model.vocab_size=500", "model.num_layers=4", "model.num_query_groups=2",
              "run.seed=11", "model.params_dtype=bfloat16", "model.sliding_window=2",
              "model.full_attention_layers=[3]"]
    rows = {}
    for impl in ("local", "transformer_engine"):
        for name, extra in (("padded", []), ("packed", ["--max-tokens", "80"])):
            out = tmp_path / f"{impl}_{name}.jsonl"
            run_cli("score", "--input", str(seqs), "--output", str(out), *extra, *common,
                    f"model.transformer_impl={impl}")
            rows[impl, name] = [r["logprobs"] for r in read_rows(out)]
    for name in ("padded", "packed"):
        gap = max_gap(rows["local", name], rows["transformer_engine", name])
        print(f"\nsliding windows, TE vs local ({name}, bf16): max |diff| {gap:.2e}")
        assert gap < 0.25
    # the window mattered: TE's numbers are nearer the windowed local ones than the
    # unwindowed (a window of 2 over up to 16 tokens)
    out = tmp_path / "full.jsonl"
    run_cli("score", "--input", str(seqs), "--output", str(out),
            *[c for c in common if "window" not in c and "full_attention" not in c],
            "model.transformer_impl=local")
    unwindowed = max_gap(rows["transformer_engine", "padded"],
                         [r["logprobs"] for r in read_rows(out)])
    assert unwindowed > max_gap(rows["local", "padded"], rows["transformer_engine", "padded"])


@pytest.mark.gpu
def test_cuda_recomputation_keeps_the_numbers(tmp_path):
    """megatron's recomputation on CUDA, where its CUDA RNG tracker (not the CPU backend's
    stand-in) hands the recomputed forward the dropout masks the first one drew: the PPO
    update's and the SFT step's gradients with full and selective recomputation, with and
    without dropout, padded and packed, equal keeping every activation, and full
    recomputation keeps less for backward."""
    from test_recompute import FAST, _check, _results

    results = _results(tmp_path, FAST, world=1)
    assert {name for _, _, name, _, _ in results} == set(FAST.split())
    _check(results)
