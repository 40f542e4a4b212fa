"""LoRA (``model.lora``) against PEFT on transformers' model: a random Llama with GQA,
converted, and a PEFT adapter with every projection adapted and both matrices random."""

import os

import pytest
import torch

from conftest import ROOT, WORKERS, checkpoint_tensors, run_cli, tiny_ppo_args, torchrun

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(folder, the PEFT model, the converted base's folder, the adapter's folder)."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, rope_theta=50000.0))
    base.save_pretrained(root / "hf")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"),
                    "--hf-dir", str(root / "hf"), "--out", str(root / "conv")],
                   check=True, capture_output=True, cwd=ROOT)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                             lora_dropout=0.0, init_lora_weights=False)  # B random too
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(root / "peft")
    return root, model


@pytest.fixture(scope="module")
def scored(adapted):
    root, _ = adapted
    out = {}
    for world in (1, 2):
        torchrun(os.path.join(WORKERS, "lora_peft.py"), world, str(root), str(root / "conv"),
                 str(root / "peft"), str(RANK), str(ALPHA))
        out.update(torch.load(root / f"lora_world{world}.pt", weights_only=False))
    return out


def _peft_reference(model):
    """PEFT's per-token log-probs of the worker's sequences and the adapters' gradients
    of their sum, by PEFT's saved key."""
    from workers.lora_peft import SEQS
    model.zero_grad()
    logprobs = []
    for seq in SEQS:
        logits = model(torch.tensor([seq])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])
        lp.sum().backward()
        logprobs.append(lp.squeeze(-1).detach())
    grads = {name.replace(".default", ""): p.grad for name, p in model.named_parameters()
             if "lora_" in name}
    return logprobs, grads


@pytest.mark.parametrize("layout", [(1, 1, False, None), (2, 1, False, None),
                                    (2, 1, True, None), (1, 2, False, None), (1, 2, False, 2)],
                         ids=["tp1", "tp2", "tp2_sp", "pp2", "pp2_vpp2"])
def test_logprobs_and_adapter_gradients_equal_peft(adapted, scored, layout):
    """The LoRA model with PEFT's adapter loaded scores every token as PEFT's model does
    (1e-5) at TP=1, TP=2 (with and without sequence parallelism), PP=2 and PP=2 with two
    virtual stages each (the adapters of the layers in every chunk), and the
    gradients of every adapter matrix from the summed log-probs equal autograd through
    PEFT's (1e-5 relative to the largest): catches a q/k/v or gate/up part laid out in
    the wrong place of the fused linear, a TP split on the wrong axis, a missing scale,
    and TP ranks' gradients of a whole matrix not summed."""
    _, model = adapted
    logprobs, grads = _peft_reference(model)
    got = scored[layout]
    if layout[3] is None:  # the planner lists the built parameters, adapters included
        assert got["shapes_agree"]
    for ours, ref in zip(got["logprobs"], logprobs, strict=True):
        assert (torch.tensor(ours) - ref).abs().max() < 1e-5
    if "grads" not in got:
        return
    assert sorted(got["grads"]) == sorted(grads)
    for key, ref in grads.items():
        torch.testing.assert_close(got["grads"][key], ref, rtol=0,
                                   atol=1e-5 * float(ref.abs().max()), msg=key)


_checkpoint_tensors = checkpoint_tensors


def _sft(tiny, runs, name, *extra):
    out, task, common = tiny
    return ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            f"checkpoint.load={out}/sft-tiny/checkpoints/step_0000006", "train.max_steps=3",
            "checkpoint.save_interval=0", "run.deterministic=true", f"run.name={name}",
            *common, f"run.output_dir={runs}", f"model.lora.rank={RANK}", *extra]


def _three_steps_agree(runs, one: str, two: str) -> None:
    """Two training runs' three steps: losses and gradient norms within 1e-6, relative."""
    from megarlhf.engine.metrics import read_metrics
    first, second = ([r for r in read_metrics(str(runs / n)) if "train/loss" in r]
                     for n in (one, two))
    assert len(first) == len(second) == 3
    for a, b in zip(first, second):
        for key in ("train/loss", "train/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["step"], key)


def test_lora_sft_at_tp2_sp_follows_one_process_and_trains_only_the_adapters(
        tiny_checkpoints, tmp_path):
    """Three SFT steps with LoRA on the tiny SFT policy: at TP=2 with sequence
    parallelism they equal one process (losses and gradient norms within 1e-6: the
    norm counts each TP-split adapter's parts once each); the saved checkpoint's base
    weights are the loaded checkpoint's, bit for bit, every adapter's B moved from zero,
    and the optimizer holds state for the adapters alone. Catches a base weight that
    trains, a gradient norm that counts a split matrix on one rank, and adapters left out
    of the optimizer or the checkpoint."""
    out, _, _ = tiny_checkpoints
    run_cli(*_sft(tiny_checkpoints, tmp_path, "one", "checkpoint.adapters_only=false"))
    torchrun(_sft(tiny_checkpoints, tmp_path, "tp2", "parallel.tensor_model_parallel_size=2",
                  "parallel.sequence_parallel=true"), 2)
    _three_steps_agree(tmp_path, "one", "tp2")
    base = _checkpoint_tensors(out / "sft-tiny" / "checkpoints" / "step_0000006")
    saved = _checkpoint_tensors(tmp_path / "one" / "checkpoints" / "step_0000003")
    weights = {k: v for k, v in saved.items() if k.startswith("policy.")}
    adapters = {k: v for k, v in weights.items() if "_lora." in k}
    # seven projections, A and B, each stacked over the two layers
    assert len(adapters) == 2 * 7 and all(v.shape[0] == 2 for v in adapters.values())
    assert all(v[layer].abs().max() > 0 for k, v in adapters.items() if k.endswith("lora_B")
               for layer in range(2))
    for key, value in weights.items():
        if key not in adapters:
            assert torch.equal(value, base[key]), key
    state = [k for k in saved if k.startswith("optimizer.state.")]
    assert len(state) == 3 * len(adapters)  # the fp32 copy, exp_avg and exp_avg_sq
    assert all("_lora." in k for k in state)


def test_an_adapter_only_checkpoint_resumes_at_tp2_and_names_a_missing_or_changed_base(
        tiny_checkpoints, tmp_path):
    """LoRA SFT saves its adapters only (``checkpoint.adapters_only``, the default), naming
    the checkpoint its base came from: steps 1-3 in one process, resumed at TP=2 for steps
    4-5 (the base read from the named checkpoint, the adapters and their optimizer state
    resharded), follow the unbroken one-process run within the resharding tolerance of
    tests/test_engine.py. A base that is gone, or changed since, is refused naming it
    before any work. Catches an adapter-only load that leaves the base random, loses the
    adapters' optimizer state, or trusts whatever now lies at the base's path."""
    import json
    import shutil

    from megarlhf.engine.metrics import read_metrics
    out, task, _ = tiny_checkpoints
    common = ("optimizer.lr_schedule=constant", "optimizer.warmup_steps=0")
    run_cli(*_sft(tiny_checkpoints, tmp_path, "unbroken", "train.max_steps=5", *common,
                  "checkpoint.save_interval=3", "checkpoint.adapters_only=false"))
    run_cli(*_sft(tiny_checkpoints, tmp_path, "broken", *common))
    saved = tmp_path / "broken" / "checkpoints" / "step_0000003"
    base = out / "sft-tiny" / "checkpoints" / "step_0000006"
    stored = checkpoint_tensors(saved)
    assert stored and all("_lora." in k for k in stored)  # adapters and their Adam state
    meta = json.loads((saved / "megarlhf_meta.json").read_text())
    assert meta["roles"]["policy"]["base"]["path"] == str(base)
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text('{"tokens": [3, 7, 9, 11, 4]}\n{"tokens": [5, 6, 7]}\n')
    for name in ("unbroken", "broken"):  # loaded as a run's start: base, then adapters
        run_cli("score", "--config", "configs/sft_tiny.yaml", "--input", str(seqs),
                "--output", str(tmp_path / f"{name}.jsonl"),
                f"checkpoint.load={tmp_path / name / 'checkpoints' / 'step_0000003'}",
                f"tokenizer.path={task['tokenizer']}")
    assert (tmp_path / "broken.jsonl").read_text() == (tmp_path / "unbroken.jsonl").read_text()
    proc = torchrun(_sft(tiny_checkpoints, tmp_path, "broken", "train.max_steps=5", *common,
                         "parallel.tensor_model_parallel_size=2"), 2)
    assert "resumed step_0000003" in proc.stdout
    unbroken, broken = ({r["step"]: r["train/loss"] for r in read_metrics(str(tmp_path / n))
                         if "train/loss" in r} for n in ("unbroken", "broken"))
    for step in (4, 5):  # measured: equal
        assert abs(broken[step] - unbroken[step]) < 1e-5, (step, broken[step], unbroken[step])

    for fault, says in (("path", "cannot be read"), ("meta_sha256", "has changed since")):
        copy = tmp_path / f"bad_{fault}"
        shutil.copytree(saved, copy)
        bad = json.loads((copy / "megarlhf_meta.json").read_text())
        bad["roles"]["policy"]["base"][fault] += "x"
        (copy / "megarlhf_meta.json").write_text(json.dumps(bad))
        proc = run_cli(*_sft(tiny_checkpoints, tmp_path, f"from_{fault}",
                             f"checkpoint.load={copy}"), check=False)
        assert proc.returncode != 0 and says in proc.stdout + proc.stderr, proc.stderr[-2000:]
        assert "holds LoRA adapters only" in proc.stderr and str(copy) in proc.stderr
        assert not (tmp_path / f"from_{fault}" / "checkpoints").exists()


def _ppo(tiny, runs, name, *extra):
    """Two PPO iterations with a LoRA actor, each update one epoch of one mini-batch."""
    return tiny_ppo_args(tiny, runs, name, "ppo.ppo_epochs=1", "ppo.mini_batch_size=32",
                         "ppo.micro_batch_size=8", f"model.lora.rank={RANK}", *extra)


def test_lora_ppo_scores_the_reference_with_the_adapters_off(tiny_checkpoints, tmp_path):
    """PPO with a LoRA actor on the SFT checkpoint: its reference is the actor's own
    model with the adapters off (one process: no reference model resident, said in the
    log), and that run equals one whose reference is a model of its own (two processes,
    the reference at TP=2) metric for metric within 1e-5 - the KL to the reference after
    the adapters moved included. Each iteration's update, one epoch of one mini-batch,
    is a no-op at the old policy (approx-KL 0, clip fraction 0), and the rollout samples
    with the adapters (its log-probs equal the actor's). Catches a reference that scores
    with the adapters on, adapters the rollout does not receive, and base weights that
    move."""
    from megarlhf.engine.metrics import read_metrics
    proc = run_cli(*_ppo(tiny_checkpoints, tmp_path, "shared"))
    assert "reference the actor's model with its LoRA adapters off" in proc.stdout
    torchrun(_ppo(tiny_checkpoints, tmp_path, "own",
                  "roles.reference.parallel.tensor_model_parallel_size=2"), 2)
    shared, own = ([r for r in read_metrics(str(tmp_path / name)) if "objective/kl" in r]
                   for name in ("shared", "own"))
    assert len(shared) == len(own) == 2
    assert shared[1]["objective/kl"] > 1e-4  # the adapters moved the actor off the base
    for a, b in zip(shared, own):
        assert abs(a["ppo/policy/approxkl"]) < 1e-7 and a["ppo/policy/clipfrac"] == 0.0
        assert a["rollout/logprob_diff_max"] < 1e-5
        assert not any(k.startswith("memory/") and "/reference/" in k for k in a)
        assert any(k.startswith("memory/") and "/reference/" in k for k in b)
        for key, value in a.items():
            if key.startswith(("timing/", "perf/", "memory/")) or not isinstance(
                    value, (int, float)):
                continue
            assert abs(value - b[key]) <= 1e-5 * max(1.0, abs(value)), (a["step"], key)


@pytest.mark.parametrize("saved", ["ckpt", "ckpt_adapters"], ids=["whole", "adapters_only"])
def test_exports_give_back_peft_bytes_and_peft_merged_weights(adapted, scored, tmp_path,
                                                               saved):
    """The checkpoint the worker saved at TP=2 (the converted base, PEFT's adapter as
    ``model.lora.init_from``) - whole, and with the adapters only, naming the converted
    base - exported in one process: ``--peft`` writes PEFT's two files byte for byte, and
    the merged export's tensors equal PEFT's ``merge_and_unload`` (each within 1e-6 of its
    largest value; measured: equal) - catches a q/k/v or gate/up delta folded into the
    wrong rows, a missing alpha / r, adapters lost on the way, and an adapter-only
    checkpoint whose base weights are not read from the base it names."""
    import copy
    import subprocess
    import sys

    root, model = adapted
    if saved == "ckpt_adapters":  # megabytes: the adapters, not the model
        stored = checkpoint_tensors(root / saved / "step_1")
        assert stored and all("_lora." in k for k in stored)
    export = [sys.executable, "-m", "megarlhf.cli", "export", str(root / "conv" / "config.yaml"),
              "--ckpt", str(root / saved), f"model.lora.rank={RANK}",
              f"model.lora.alpha={ALPHA}", f"model.lora.init_from={root / 'peft'}"]
    for extra in (["--peft", "--out", str(tmp_path / "peft")],
                  ["--out", str(tmp_path / "merged")]):
        subprocess.run(export + extra, check=True, capture_output=True, cwd=ROOT)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "peft" / name).read_bytes() == (root / "peft" / name).read_bytes()
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert sorted(got) == sorted(k for k in want if "rotary" not in k)
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=0,
                                   atol=1e-6 * float(want[key].abs().max()), msg=key)


def test_lora_dpo_reference_is_the_policy_with_adapters_off_and_rm_trains_its_head(
        tiny_checkpoints, tmp_path):
    """DPO with a LoRA policy on the SFT checkpoint: scoring each batch with the policy's
    adapters off (``dpo.use_cache=false``, no reference model) gives every step's loss,
    gradient norm and margins of the run whose reference log-probs come from the base
    model's cache, bit for bit (the margins moved from zero by the last step: the
    adapters are trained). A LoRA reward model trains its scalar head with the adapters:
    the head moved from its checkpoint's, the trunk did not."""
    from megarlhf.engine.metrics import read_metrics
    out, task, common = tiny_checkpoints
    dpo = ["dpo", "configs/dpo_tiny.yaml", f"data.train_path={task['prefs']}",
           f"checkpoint.load={out}/sft-tiny/checkpoints", "train.global_batch_size=8",
           "train.micro_batch_size=2", "train.eval_interval=0", "dpo.gold_reward_fn=null",
           "dpo.gold_eval_path=null", "train.max_steps=3", "checkpoint.save_interval=0",
           "run.deterministic=true", *common, f"run.output_dir={tmp_path}",
           f"model.lora.rank={RANK}"]
    run_cli(*dpo, "run.name=cached", f"cache.path={tmp_path}/cache")
    proc = run_cli(*dpo, "run.name=shared", "dpo.use_cache=false")
    assert "reference: the policy's model with its LoRA adapters off" in proc.stdout
    cached, shared = ([r for r in read_metrics(str(tmp_path / n)) if "train/loss" in r]
                      for n in ("cached", "shared"))
    assert cached == [{**r, **{k: v for k, v in c.items() if k.startswith(("timing/", "perf/"))}}
                      for r, c in zip(shared, cached)]
    assert abs(shared[-1]["train/rewards/margin"]) > 1e-6
    run_cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}",
            f"checkpoint.load={out}/rm-tiny/checkpoints", "train.max_steps=2",
            "checkpoint.save_interval=0", *common, f"run.output_dir={tmp_path}",
            "run.name=rm", f"model.lora.rank={RANK}")
    (base,) = [p for p in (out / "rm-tiny" / "checkpoints").iterdir() if p.name.startswith("step_")]
    base = _checkpoint_tensors(base)
    saved = _checkpoint_tensors(tmp_path / "rm" / "checkpoints" / "step_0000002")
    weights = [k for k in saved if k.startswith("reward.") and "_lora." not in k]
    assert weights and "reward.output_layer.weight" in weights
    for key in weights:
        moved = not torch.equal(saved[key], base[key])  # (the head's bias cancels out of
        assert moved == (key == "reward.output_layer.weight"), key  # a pair's difference)


def test_bad_lora_inputs_are_refused_before_any_work(adapted, tiny_checkpoints, tmp_path):
    """A target the model does not have, a rank larger than a targeted layer, a model
    kind LoRA does not take, and a PEFT adapter that does not fit - its rank, another
    base's shapes, a missing or damaged file - each refused naming the field or file;
    the run writes nothing."""
    from megarlhf.config import ConfigError, load_config
    for extra, message in (
            (["model.lora.target_modules=[q_proj,qkv_proj]"],
             r"model.lora.target_modules=.*names \['qkv_proj'\]"),
            (["model.lora.rank=65"], r"model.lora.rank=65 is invalid: is larger than q_proj"),
            (["model.lora.rank=4", "model.arch=gpt2"], r"model.arch='gpt2' is invalid: must be llama"),
            (["model.lora.rank=4", "model.transformer_impl=transformer_engine"],
             r"model.transformer_impl='transformer_engine' is invalid"),
            (["model.lora.rank=4", "model.lora.dropout=1.0"], r"model.lora.dropout")):
        with pytest.raises((ConfigError, ValueError), match=message):
            load_config(None, ["model.hidden_size=64", "model.num_attention_heads=4", *extra])
    root, _ = adapted
    out, task, common = tiny_checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((root / "peft" / "adapter_config.json")
                                                .read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    for folder, extra, message in (
            (root / "peft", [], "adapter_model.safetensors: holds adapters this model does "
                                "not take: 28 tensors, e.g. base_model.model.model.layers.2"),
            (root / "peft", ["model.lora.rank=8"], "adapter_config.json: r=4 does not match "
                                                   "this model's 8"),
            (tmp_path / "nowhere", [], "adapter_config.json is missing"),
            (broken, [], "adapter_model.safetensors: not a readable safetensors file")):
        proc = run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                       f"checkpoint.load={out}/sft-tiny/checkpoints", *common,
                       f"run.output_dir={tmp_path}", "run.name=bad", f"model.lora.rank={RANK}",
                       f"model.lora.alpha={ALPHA}", f"model.lora.init_from={folder}", *extra,
                       check=False)
        assert proc.returncode != 0 and "model.lora.init_from=" in proc.stderr, proc.stderr
        assert message in proc.stderr, proc.stderr
        assert not (tmp_path / "bad").exists()


def test_split_placement_sends_the_base_once_then_only_the_adapters(tiny_checkpoints,
                                                                    tmp_path):
    """A LoRA actor sampled on a rollout rank of its own (split placement, the weights'
    SHA-256 checked on arrival): the first sync sends the whole model, every later one the
    adapters' bytes alone (the frozen base does not change), the run equals the
    colocated one metric for metric within 1e-5, and each update (one epoch of one
    mini-batch) is a no-op at the old policy on both: the rollout rank samples with the
    adapters the training rank has."""
    import dataclasses

    from megarlhf.config import LoRAConfig
    from megarlhf.engine.metrics import read_metrics
    from megarlhf.models.shapes import chunk_params
    from megarlhf.roles.spec import read_saved_role
    out, _, _ = tiny_checkpoints
    three = ["ppo.num_iterations=3", "ppo.eval_interval=3"]
    run_cli(*_ppo(tiny_checkpoints, tmp_path, "colocated", *three))
    torchrun(_ppo(tiny_checkpoints, tmp_path, "split", *three, "rollout.placement.mode=split",
                  "rollout.placement.ranks=1", "rollout.placement.weight_checksum=true"), 2)
    colocated, split = ([r for r in read_metrics(str(tmp_path / n)) if "objective/kl" in r]
                        for n in ("colocated", "split"))
    model = read_saved_role(str(out / "sft-tiny" / "checkpoints"), ("policy",), "test").model
    model = dataclasses.replace(model, lora=LoRAConfig(rank=RANK))
    adapters = sum(p.numel for p in chunk_params(model, kind="lm", padded_vocab=1, tp=1, pp=1,
                                                 pp_rank=0) if not p.frozen)
    sent = [r["perf/weight_sync_bytes"] for r in split]
    assert sent[0] > 10 * sent[1] and sent[1:] == [4.0 * adapters] * 2, sent
    for a, b in zip(colocated, split, strict=True):
        for r in (a, b):
            assert abs(r["ppo/policy/approxkl"]) < 1e-7 and r["ppo/policy/clipfrac"] == 0.0
        for key in ("objective/score", "objective/kl", "ppo/policy/loss", "ppo/val/loss",
                    "rollout/logprob_diff_max"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (a["step"], key)


@pytest.mark.extended
@pytest.mark.parametrize("case", ["moe_ep2", "distill_tp2"])
def test_lora_with_experts_split_and_in_distillation_follows_one_process(
        tiny_checkpoints, tmp_path, case):
    """Three steps with LoRA adapters against one process within 1e-6: SFT of a mixture
    of experts (padded rows) with its experts over two ranks (EP=2; the attention and none
    of the experts adapted), and distillation at TP=2 (the student from the SFT policy's
    step 3, the teacher its step 6)."""
    out, task, common = tiny_checkpoints
    if case == "moe_ep2":
        argv = ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                "model.num_layers=2", "model.moe.num_experts=4", "model.moe.top_k=2",
                "model.moe.ffn_hidden_size=32", "train.max_tokens_per_micro_batch=null"]
        layout = "parallel.expert_model_parallel_size=2"
    else:
        argv = ["distill", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
                f"distill.teacher_checkpoint={out}/sft-tiny/checkpoints",
                f"checkpoint.load={out}/sft-tiny/checkpoints/step_0000003",
                "train.eval_interval=0"]
        layout = "parallel.tensor_model_parallel_size=2"
    argv += ["train.max_steps=3", "checkpoint.save_interval=0", "run.deterministic=true",
             *common, f"run.output_dir={tmp_path}", f"model.lora.rank={RANK}"]
    run_cli(*argv, "run.name=one", f"cache.path={tmp_path}/cache_one")
    torchrun([*argv, "run.name=two", f"cache.path={tmp_path}/cache_two", layout], 2)
    _three_steps_agree(tmp_path, "one", "two")
