"""LoRA (``model.lora``) against PEFT on transformers' model: a random Llama with GQA,
converted, and a PEFT adapter with every projection adapted and both matrices random."""

import os

import pytest
import torch

from conftest import ROOT, WORKERS, run_cli, torchrun

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


@pytest.mark.parametrize("layout", [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)],
                         ids=["tp1", "tp2", "tp2_sp", "pp2"])
def test_logprobs_and_adapter_gradients_equal_peft(adapted, scored, layout):
    """The LoRA model with PEFT's adapter loaded scores every token as PEFT's model does
    (1e-5) at TP=1, TP=2 (with and without sequence parallelism) and PP=2, and the
    gradients of every adapter matrix from the summed log-probs equal autograd through
    PEFT's (1e-5 relative to the largest): catches a q/k/v or gate/up part laid out in
    the wrong place of the fused linear, a TP split on the wrong axis, a missing scale,
    and TP ranks' gradients of a whole matrix not summed."""
    _, model = adapted
    logprobs, grads = _peft_reference(model)
    got = scored[layout]
    assert got["shapes_agree"]  # the planner lists the built parameters, adapters included
    for ours, ref in zip(got["logprobs"], logprobs, strict=True):
        assert (torch.tensor(ours) - ref).abs().max() < 1e-5
    if "grads" not in got:
        return
    assert sorted(got["grads"]) == sorted(grads)
    for key, ref in grads.items():
        torch.testing.assert_close(got["grads"][key], ref, rtol=0,
                                   atol=1e-5 * float(ref.abs().max()), msg=key)


def _checkpoint_tensors(path) -> dict:
    """Every tensor of a megarlhf checkpoint folder, whole, by its sharded key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in meta.items() if hasattr(v, "chunks")}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _sft(tiny, runs, name, *extra):
    out, task, common = tiny
    return ["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
            f"checkpoint.load={out}/sft-tiny/checkpoints/step_0000006", "train.max_steps=3",
            "checkpoint.save_interval=0", "run.deterministic=true", f"run.name={name}",
            *common, f"run.output_dir={runs}", f"model.lora.rank={RANK}", *extra]


def test_lora_sft_at_tp2_sp_follows_one_process_and_trains_only_the_adapters(
        tiny_checkpoints, tmp_path):
    """Three SFT steps with LoRA on the tiny SFT policy: at TP=2 with sequence
    parallelism they equal one process (losses and gradient norms within 1e-6: the
    norm counts each TP-split adapter's parts once each); the saved checkpoint's base
    weights are the loaded checkpoint's, bit for bit, every adapter's B moved from zero,
    and the optimizer holds state for the adapters alone. Catches a base weight that
    trains, a gradient norm that counts a split matrix on one rank, and adapters left out
    of the optimizer or the checkpoint."""
    from megarlhf.engine.metrics import read_metrics
    out, _, _ = tiny_checkpoints
    run_cli(*_sft(tiny_checkpoints, tmp_path, "one"))
    torchrun(_sft(tiny_checkpoints, tmp_path, "tp2", "parallel.tensor_model_parallel_size=2",
                  "parallel.sequence_parallel=true"), 2)
    one, two = ([r for r in read_metrics(str(tmp_path / name)) if "train/loss" in r]
                for name in ("one", "tp2"))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        for key in ("train/loss", "train/grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["step"], key)
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


def _ppo(tiny, runs, name, *extra):
    out, task, common = tiny
    return ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_iterations=2",
            "ppo.eval_interval=2", "ppo.num_eval_prompts=8", "checkpoint.save_interval=0",
            "ppo.ppo_epochs=1", "ppo.mini_batch_size=32", "ppo.micro_batch_size=8",
            "run.deterministic=true", f"run.name={name}", *common, f"run.output_dir={runs}",
            f"model.lora.rank={RANK}", *extra]


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
