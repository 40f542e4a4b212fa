"""HF <-> megarlhf conversion, with transformers as the oracle (random tiny models saved
with save_pretrained; nothing downloaded)."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, torchrun

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
ARCHS = ["llama", "mistral", "qwen2", "gpt2"]


def tool(name, *args, check=True):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout + proc.stderr[-4000:])
    return proc


def convert_here(*args):
    """tools/convert_hf_to_megatron.py's main() in this process (its error paths; the
    subprocess runs above cover the command itself): (returncode, stdout, stderr)."""
    import contextlib
    import importlib.util
    import io
    import types

    spec = importlib.util.spec_from_file_location(
        "convert_hf_to_megatron", os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = module.main(list(args))
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def make_hf(arch, path):
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=300, n_embd=64, n_layer=4, n_head=4, n_positions=128, bos_token_id=1,
            eos_token_id=2))
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=50000.0))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common,
                                                                       tie_word_embeddings=True))
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    models = {}
    for arch in ARCHS:
        models[arch] = make_hf(arch, root / "hf" / arch)
        out = tool("convert_hf_to_megatron.py", "--hf-dir", str(root / "hf" / arch),
                   "--out", str(root / "conv" / arch), "--tp", "2")
        assert "parameters:" in out.stdout and "layout: TP=2 PP=1" in out.stdout
    worker = os.path.join(WORKERS, "converted_models.py")
    torchrun(worker, 1, str(root), str(root / "conv"), *ARCHS)
    torchrun(worker, 2, str(root), str(root / "conv"), *ARCHS)
    results = {**torch.load(root / "converted_world1.pt", weights_only=False),
               **torch.load(root / "converted_world2.pt", weights_only=False)}
    return root, models, results


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_logprobs_match_transformers(converted, arch, layout):
    from workers.converted_models import SEQS
    _, models, results = converted
    ours = results[(arch, *layout)]["logprobs"]
    for seq, lp in zip(SEQS, ours, strict=True):
        with torch.no_grad():
            logits = models[arch](torch.tensor([seq])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])
        assert (ref.squeeze(-1) - torch.tensor(lp)).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(converted, arch):
    from workers.converted_models import PROMPTS
    _, models, results = converted
    ours = results[(arch, 1, 1)]["greedy"]
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        ref = models[arch].generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                    min_new_tokens=20, pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bitwise(converted, arch):
    from safetensors.torch import load_file
    root, _, _ = converted
    back = root / "back" / arch
    tool("convert_megatron_to_hf.py", "--config", str(root / "conv" / arch / "config.yaml"),
         "--out", str(back), "--shard-layers", "2")
    original = load_file(root / "hf" / arch / "model.safetensors")
    restored = {}
    for f in glob.glob(str(back / "*.safetensors")):
        restored.update(load_file(f))
    assert set(restored) == set(original)
    for key in original:
        assert torch.equal(original[key], restored[key]), key
    assert json.load(open(back / "config.json"))["model_type"] == arch
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(reloaded).__name__.lower().startswith(arch.replace("gpt2", "gpt2lm")[:4])


def test_bad_inputs(converted, tmp_path):
    root, _, _ = converted
    hf = root / "hf" / "llama"
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.load(open(hf / "config.json"))
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "unsupported model_type 'falcon'" in proc.stderr
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "shard model-00001-of-00002.safetensors" in proc.stderr
    # wrong shape: a k_proj with too many rows
    from safetensors.torch import load_file, save_file
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    (bad / "model.safetensors.index.json").unlink()
    save_file(tensors, bad / "model.safetensors")
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "shape mismatch for HF 'model.layers.0.self_attn.k_proj.weight'" in proc.stderr
    # an unknown key
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, bad / "model.safetensors")
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "unknown HF keys" in proc.stderr \
        and "model.layers.0.extra.weight" in proc.stderr
    # damaged files: truncated (a copy cut short), and NaN written over a tensor
    data = (hf / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:len(data) // 2])
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and f"{bad / 'model.safetensors'}" in proc.stderr \
        and "truncated or damaged" in proc.stderr and "Traceback" not in proc.stderr
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, :5] = float("nan")
    save_file(tensors, bad / "model.safetensors")
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "tensor 'model.layers.1.mlp.up_proj.weight' holds 5 " \
        "non-finite values" in proc.stderr
    assert not (tmp_path / "o" / "latest").exists()
