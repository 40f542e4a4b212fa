"""HF <-> megarlhf conversion, with transformers as the oracle (random tiny models saved
with save_pretrained; nothing downloaded)."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, CommandFailed, checkpoint_tensors, torchrun

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
# name -> the model_type its config.json has. The scaled-RoPE families pretrained at a context
# of 16 (the test's longest sequence is 48 tokens); qwen3 and mistral_nemo have a head size
# of their own (32, where hidden / heads is 16); qwen3_yarn is Qwen's long-context YaRN
# (factor 4 over an original context of 16); *_rm are sequence-classification heads.
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gpt2": "gpt2",
            "llama3": "llama", "llama_linear": "llama", "qwen3": "qwen3",
            "mistral_nemo": "mistral", "qwen3_yarn": "qwen3", "llama3_rm": "llama",
            "qwen3_rm": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
            "qwen3_moe_rm": "qwen3_moe", "deepseek_v3": "deepseek_v3",
            "deepseek_v3_yarn": "deepseek_v3", "glm4_moe": "glm4_moe", "smollm3": "smollm3",
            "smollm3_rm": "smollm3", "phi3": "phi3", "phi3_rm": "phi3",
            "mistral_window": "mistral", "olmo2": "olmo2", "olmo2_rm": "olmo2",
            "olmo3": "olmo3", "gemma3": "gemma3_text", "gemma3_rm": "gemma3_text",
            "gpt_oss": "gpt_oss", "gpt_oss_rm": "gpt_oss"}
# Mixtures of experts (4 experts, top 2): also at EP=2 (tests/workers/converted_models.py).
MOE_ARCHS = [a for a, t in FAMILIES.items()
             if t in ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")]
ARCHS = list(FAMILIES)
LM_ARCHS = [a for a in ARCHS if not a.endswith("_rm")]
# The fast tier's families (converted together, once): a Llama, Qwen3's head size and q/k
# norms, a mixture of experts, DeepSeek-V3's latent attention and grouped routing, GLM-4.5's
# partial rotary and biases, Phi-3's fused projections and sliding window, OLMo 3's norms
# (after the sublayers, q/k over all heads) and local/global layers, Gemma 3's (sandwich and
# (1 + w) norms, GeGLU, a scaled embedding, a RoPE base per layer type), gpt-oss's (sinks,
# linear biases, stacked experts, the clamped SwiGLU, YaRN untruncated), a value head. The
# extended tier adds every other family (tests/README.md, "Tiers").
FAST_ARCHS = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "phi3", "olmo3",
              "gemma3", "gpt_oss", "qwen3_rm")


def tiered(archs):
    """``archs`` as parameters, the ones outside FAST_ARCHS in the extended tier."""
    return [pytest.param(a, marks=() if a in FAST_ARCHS else pytest.mark.extended)
            for a in archs]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tool(name, *args, check=True):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if check and proc.returncode != 0:
        raise CommandFailed(proc.stdout + proc.stderr[-4000:])
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
    rm = dict(num_labels=1) if arch.endswith("_rm") else {}
    common = dict(**rm, vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
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
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common,
                                                                       tie_word_embeddings=True))
    elif arch in ("llama3", "llama3_rm"):  # Llama 3.2's shape: tied, llama3 scaling
        config = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                          tie_word_embeddings=True)
        model = (transformers.LlamaForSequenceClassification if arch.endswith("_rm")
                 else transformers.LlamaForCausalLM)(config)
    elif arch == "llama_linear":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **common, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    elif arch in ("qwen3", "qwen3_rm"):  # q/k RMSNorm, head size 32 with hidden 64 / 4 heads
        config = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        model = (transformers.Qwen3ForSequenceClassification if arch.endswith("_rm")
                 else transformers.Qwen3ForCausalLM)(config)
    elif arch == "qwen3_yarn":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **common, head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 16}))
    elif arch in ("qwen3_moe", "qwen3_moe_rm"):  # a dense first layer, then 4 experts, top 2
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True, mlp_only_layers=[0], rope_theta=1000000.0)
        model = (transformers.Qwen3MoeForSequenceClassification if arch.endswith("_rm")
                 else transformers.Qwen3MoeForCausalLM)(config)
    elif arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=None))
    elif arch in ("deepseek_v3", "deepseek_v3_yarn"):
        # multi-latent attention (query and key/value latents, a rotary part per head); a
        # dense first layer, then 4 experts in 2 groups (a token's 2 experts from its best
        # group), sigmoid scores, a shared expert, a scaling factor, and an expert bias
        # that changes the choice (transformers initialises it to zero)
        config = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=48,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, **({"rope_scaling": {  # DeepSeek-V3's own form of YaRN
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}
                if arch.endswith("_yarn") else {}))
        model = transformers.DeepseekV3ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    elif arch in ("smollm3", "smollm3_rm"):  # no RoPE in every 2nd layer (1 and 3), tied
        config = transformers.SmolLM3Config(**common, no_rope_layer_interval=2, pad_token_id=0,
                                            rope_theta=5000000.0, tie_word_embeddings=True)
        assert config.no_rope_layers == [1, 0, 1, 0]
        model = (transformers.SmolLM3ForSequenceClassification if arch.endswith("_rm")
                 else transformers.SmolLM3ForCausalLM)(config)
    elif arch in ("phi3", "phi3_rm"):
        # Phi-4-mini's shape: fused qkv_proj and gate_up_proj, 3/4 of each head rotated,
        # tied; with a sliding window of 8 (Phi-3's configs carry one) over a sequence of 48
        config = transformers.Phi3Config(**common, partial_rotary_factor=0.75, sliding_window=8,
                                         pad_token_id=0, tie_word_embeddings=True)
        model = (transformers.Phi3ForSequenceClassification if arch.endswith("_rm")
                 else transformers.Phi3ForCausalLM)(config)
    elif arch == "mistral_window":  # Mistral 7B v0.1's sliding window, 8 positions here
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            **common, sliding_window=8))
    elif arch in ("olmo2", "olmo2_rm"):  # norms after the sublayers, q/k over all heads
        config = transformers.Olmo2Config(**common, pad_token_id=0, rope_theta=500000.0)
        model = (transformers.Olmo2ForSequenceClassification if arch.endswith("_rm")
                 else transformers.Olmo2ForCausalLM)(config)
    elif arch == "olmo3":  # OLMo 2's layer; three sliding-window layers of 8, one full
        model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **common, pad_token_id=0, sliding_window=8))
        assert model.config.layer_types[3] == "full_attention"
    elif arch in ("gemma3", "gemma3_rm"):
        # Gemma 3: sandwich and (1 + w) norms, GeGLU, the embedding scaled by sqrt(hidden),
        # query_pre_attn_scalar, three local layers (window 8, RoPE base 10000) and a global
        # one (base 1e6, linear scaling 2), tied; norms randomised (zero-initialised)
        config = transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=12, sliding_window=8,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], pad_token_id=0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1e6}})
        model = (transformers.Gemma3TextForSequenceClassification if arch.endswith("_rm")
                 else transformers.Gemma3ForCausalLM)(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.2)
    elif arch in ("gpt_oss", "gpt_oss_rm"):
        # gpt-oss: sliding-window (8) and full layers alternating, a sink per head, YaRN
        # without truncation (factor 4 over an original context of 32), biases on q, k, v,
        # o, the router and the experts, 4 experts (top 2) stacked with gate and up
        # interleaved, the clamped SwiGLU - its limit lowered to 0.1 so that it clamps
        # these small activations (gpt-oss's own is 7); sinks and biases randomised
        config = transformers.GptOssConfig(
            **{**common, "intermediate_size": 48}, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.1, pad_token_id=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 32})
        assert config.layer_types == ["sliding_attention", "full_attention"] * 2
        model = (transformers.GptOssForSequenceClassification if arch.endswith("_rm")
                 else transformers.GptOssForCausalLM)(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_(0.0, 1.0)
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.1)
    elif arch == "glm4_moe":
        # GLM-4.5: half of each head rotated (partial_rotary_factor 0.5), q/k/v biases
        # (randomised: transformers initialises them to zero), DeepSeek-V3's routing
        # without groups (sigmoid scores, an expert bias that changes the choice, a shared
        # expert, a scaling factor), a dense first layer
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
            **common, partial_rotary_factor=0.5, attention_bias=True, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_theta=1000000.0))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, proj).bias.normal_(0.0, 0.1)
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    else:  # Mistral-Nemo's head size of its own, no sliding window
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            **common, head_dim=32, sliding_window=None))
    model.save_pretrained(path)
    return model.eval()


class Converted:
    """The families' tiny random models, converted at TP=2 and scored by megarlhf at
    every layout (workers/converted_models.py) - each family on first use, so a run of
    a few tests pays for a few families. Unpacks as (root, models, results); ``models``
    and ``results`` make what they are asked for."""

    def __init__(self, root):
        self.root, self.done = root, set()
        self.hf: dict = {}
        self.scored: dict = {}
        self.models = _Lazy(self, lambda arch: arch, self.hf)
        self.results = _Lazy(self, lambda key: key[0] if key[0] != "shapes_wrong" else None,
                             self.scored)

    def __iter__(self):
        return iter((self.root, self.models, self.results))

    def ensure(self, *archs: str) -> "Converted":
        if any(a in FAST_ARCHS for a in archs):  # the fast tier's families in one batch
            archs = tuple(dict.fromkeys((*archs, *FAST_ARCHS)))
        todo = [a for a in archs if a not in self.done]
        if not todo:
            return self
        for arch in todo:
            self.hf[arch] = make_hf(arch, self.root / "hf" / arch)
            out = tool("convert_hf_to_megatron.py", "--hf-dir", str(self.root / "hf" / arch),
                       "--out", str(self.root / "conv" / arch), "--tp", "2",
                       *(["--role", "reward"] if arch.endswith("_rm") else []))
            assert "parameters:" in out.stdout and "layout: TP=2 PP=1" in out.stdout
        batch = self.root / f"scored-{len(self.done)}"
        batch.mkdir()
        worker = os.path.join(WORKERS, "converted_models.py")
        for world in (1, 2):
            torchrun(worker, world, str(batch), str(self.root / "conv"), *todo)
            got = torch.load(batch / f"converted_world{world}.pt", weights_only=False)
            wrong = got.pop(("shapes_wrong", world))
            self.scored.update(got)
            for arch in todo:  # the planner's shapes that disagree, by family
                self.scored[("shapes_wrong", world, arch)] = [
                    line for line in wrong if line.startswith(arch + " ")]
        self.done.update(todo)
        return self


class _Lazy:
    def __init__(self, owner: Converted, arch_of, store: dict):
        self.owner, self.arch_of, self.store = owner, arch_of, store

    def __getitem__(self, key):
        arch = self.arch_of(key)
        if arch is not None:
            self.owner.ensure(arch)
        elif len(key) == 3:  # ("shapes_wrong", world, arch)
            self.owner.ensure(key[2])
        return self.store[key]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return Converted(tmp_path_factory.mktemp("convert"))


@pytest.mark.parametrize("arch", tiered(LM_ARCHS))
@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_logprobs_match_transformers(converted, arch, layout):
    from workers.converted_models import SEQS
    _, models, results = converted
    ours = results[(arch, *layout)]["logprobs"]
    for seq, lp in zip(SEQS, ours, strict=True):
        with torch.no_grad():
            logits = models[arch](torch.tensor([seq])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])
        assert (ref.squeeze(-1) - torch.tensor(lp)).abs().max() < 1e-5


@pytest.mark.parametrize("arch", tiered(["phi3", "mistral_window", "olmo3", "gemma3", "gpt_oss"]))
@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_sliding_windows_in_a_packed_row_match_transformers(converted, arch, layout):
    """The four sequences packed into one row (megatron's THD format; a window of 8, the
    longest sequence 48): the log-probs transformers gives each alone, within 1e-5.
    Catches a window lost on the packed path or reaching across a sample's start."""
    from workers.converted_models import SEQS
    _, models, results = converted
    for seq, lp in zip(SEQS, results[(arch, *layout)]["packed"], strict=True):
        with torch.no_grad():
            logits = models[arch](torch.tensor([seq])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])
        assert (ref.squeeze(-1) - torch.tensor(lp)).abs().max() < 1e-5


@pytest.mark.parametrize("arch", tiered(MOE_ARCHS))
def test_experts_split_over_two_ranks_match_transformers(converted, arch):
    """A mixture of experts at EP=2 (two experts on each rank; tokens gathered over the
    expert-parallel group and their outputs reduced back): transformers' log-probs within
    1e-5, or its score for a sequence-classification head."""
    from workers.converted_models import SEQS
    _, models, results = converted
    ours = results[(arch, 1, 1, 2)]
    for i, seq in enumerate(SEQS):
        with torch.no_grad():
            logits = models[arch](torch.tensor([seq])).logits[0].float()
        if "values" in ours:
            assert abs(float(logits[0]) - ours["values"][i][-1]) < 1e-5
            continue
        ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])
        assert (ref.squeeze(-1) - torch.tensor(ours["logprobs"][i])).abs().max() < 1e-5


@pytest.mark.extended
def test_experts_on_four_ranks_match_transformers(converted):
    """Qwen3-MoE on four processes: EP=2 with each expert over two tensor-parallel ranks
    (ETP=2, dense TP=2, DP=2), and EP=4: transformers' log-probs within 1e-5."""
    from workers.converted_models import SEQS
    root, models, _ = converted.ensure("qwen3_moe")
    torchrun(os.path.join(WORKERS, "moe_four_ranks.py"), 4, str(root), str(root / "conv"),
             "qwen3_moe")
    results = torch.load(root / "moe_four_ranks.pt", weights_only=False)
    assert [r["layout"] for r in results.values()] == ["TP=2 PP=1 DP=2 EP=2 ETP=2",
                                                        "TP=1 PP=1 DP=4 EP=4 ETP=1"]
    for result in results.values():
        for seq, lp in zip(SEQS, result["logprobs"], strict=True):
            with torch.no_grad():
                logits = models["qwen3_moe"](torch.tensor([seq])).logits[0].float()
            ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])
            assert (ref.squeeze(-1) - torch.tensor(lp)).abs().max() < 1e-5


@pytest.mark.parametrize("arch", tiered(LM_ARCHS))
def test_greedy_generation_matches_transformers(converted, arch):
    from workers.converted_models import PROMPTS
    _, models, results = converted
    ours = results[(arch, 1, 1)]["greedy"]
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        ref = models[arch].generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                    min_new_tokens=32, pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == tokens


@pytest.mark.parametrize("arch", tiered(["phi3", "mistral_window", "olmo3", "gemma3", "gpt_oss"]))
def test_sliding_windows_decode_alike_on_every_kv_cache(converted, arch):
    """A sliding window of 8 over 4 prompt + 32 new tokens, through megatron's inference
    context, decode slots on the columns cache and on the paged cache (blocks of 4): the
    greedy tokens transformers' generate gives. Catches a window missing from, or
    misplaced in, any cache's decode step (the static batch's: the test above); for
    gpt-oss, its sinks and YaRN's angles there too."""
    from workers.converted_models import PROMPTS
    _, models, results = converted
    got = results[(arch, 1, 1)]["greedy_caches"]
    for prompt, row in zip(PROMPTS, range(len(PROMPTS))):
        ref = models[arch].generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                    min_new_tokens=32, pad_token_id=0)[0, len(prompt):].tolist()
        for cache, tokens in got.items():
            assert tokens[row] == ref, (cache, row)


@pytest.mark.parametrize("arch", tiered(LM_ARCHS))
def test_planner_kv_cache_equals_the_rollouts(converted, arch):
    """The planner's KV cache (key and value per query group, or multi-latent attention's
    up-projected keys and values per head) is the bytes megatron's inference context
    allocated for the greedy rollout."""
    _, _, results = converted
    measured, planned = results[(arch, 1, 1)]["kv_cache"]
    assert measured > 0 and planned == measured


@pytest.mark.parametrize("arch", tiered([a for a in ARCHS if a.endswith("_rm")]))
@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_value_heads_match_transformers(converted, arch, layout):
    """A converted *ForSequenceClassification head: megarlhf's value at each sequence's last
    token is transformers' score (it pools the last token)."""
    from workers.converted_models import SEQS
    _, models, results = converted
    ours = results[(arch, *layout)]["values"]
    for seq, values in zip(SEQS, ours, strict=True):
        with torch.no_grad():
            ref = models[arch](torch.tensor([seq])).logits[0, 0].float()
        assert abs(float(ref) - values[-1]) < 1e-5


@pytest.mark.parametrize("arch", tiered(ARCHS))
def test_planner_parameter_shapes_equal_the_built_models(converted, arch):
    """models.shapes (what `megarlhf plan` counts) names and sizes every parameter of each
    family as built, at TP=1, TP=2 and PP=2: head sizes of their own, q/k norms, tied
    embeddings, value heads."""
    _, _, results = converted
    assert results[("shapes_wrong", 1, arch)] == [] and results[("shapes_wrong", 2, arch)] == []


@pytest.mark.extended
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bitwise(converted, arch):
    from safetensors.torch import load_file
    root, _, _ = converted.ensure(arch)
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
    model_type = FAMILIES[arch]
    assert json.load(open(back / "config.json"))["model_type"] == model_type
    auto = (transformers.AutoModelForSequenceClassification if arch.endswith("_rm")
            else transformers.AutoModelForCausalLM)
    reloaded = auto.from_pretrained(back).eval()
    assert type(reloaded).__name__.lower().startswith(model_type.replace("_", "")[:4])
    # the exported config describes the same network: same outputs as the original
    from workers.converted_models import SEQS
    _, models, _ = converted
    with torch.no_grad():
        for seq in SEQS:
            assert torch.equal(reloaded(torch.tensor([seq])).logits,
                               models[arch](torch.tensor([seq])).logits)


def test_bad_inputs(converted, tmp_path):
    root, _, _ = converted.ensure("llama")
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


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 16, "attention_factor": 1.2}},
     "rope_scaling.attention_factor=1.2 is not supported for yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling.rope_type='llama3' has no 'low_freq_factor'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type='dynamic' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2},
     "layer_types holds ['sliding_attention']"),
    ({"hidden_size": None}, "config.json has no 'hidden_size'"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [1]},
     "mlp_only_layers=[1] is not supported: dense layers must be the first ones"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [], "decoder_sparse_step": 2},
     "decoder_sparse_step=2 is not supported"),
    ({"model_type": "qwen3_moe", "num_local_experts": None}, "config.json has no "
     "'num_local_experts'"),
    # Mixtral's (its family is converted in the extended tier only)
    pytest.param({"model_type": "mixtral", "router_jitter_noise": 0.1},
                 "router_jitter_noise=0.1 is not supported", marks=pytest.mark.extended),
    ({"model_type": "deepseek_v3", "rope_interleave": False},
     "rope_interleave=false is not supported"),
    ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}},
     "quantization_config (fp8) is not supported: dequantise the checkpoint"),
    ({"model_type": "deepseek_v3", "num_experts_per_tok": 4, "n_group": 2, "topk_group": 1},
     "num_experts_per_tok=4 with topk_group=1 is not supported"),
    ({"model_type": "deepseek_v3", "norm_topk_prob": False},
     "norm_topk_prob=False with num_experts_per_tok=2 is not supported"),
    ({"model_type": "deepseek_v3", "scoring_func": "softmax"},
     "scoring_func='softmax' is not supported (sigmoid only)"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": None}, "config.json has no 'kv_lora_rank'"),
    ({"use_qk_norm": True}, "use_qk_norm=true is not supported for model_type 'llama'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e4,
                          "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is not supported for model_type 'llama'"),
    ({"model_type": "glm4_moe", "mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"model_type": "gemma3_text", "hidden_activation": "silu"},
     "hidden_activation='silu' is not supported"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True},
     "use_bidirectional_attention=true is not supported"),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e6}}},
     "rope_parameters.full_attention.factor=3.0 is not supported for gemma3_text"),
    ({"model_type": "glm4_moe", "partial_rotary_factor": 0.3125},
     "partial_rotary_factor=0.3125 is not supported: it rotates 5 of a head's 16 channels"),
    ({"model_type": "glm4_moe", "scoring_func": "softmax"},
     "scoring_func='softmax' is not supported (sigmoid only)"),
    ({"model_type": "gpt_oss", "attention_bias": False},
     "attention_bias=false is not supported for gpt_oss"),
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}},
     "quantization_config (mxfp4) is not supported: dequantise the checkpoint"),
    ({"model_type": "gpt_oss", "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32,
                                                   "attention_factor": 1.2}},
     "rope_parameters.attention_factor=1.2 is not supported for yarn"),
])
def test_unsupported_options_are_refused_naming_the_key(converted, tmp_path, change, message):
    """Every option a family may carry that megarlhf does not implement: exit 2 before any
    work, the file and the key named, no output folder."""
    own = change.get("model_type") in ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe",
                                       "gemma3_text", "gpt_oss")  # a family's own, else Llama's
    arch = {"gemma3_text": "gemma3"}.get(change.get("model_type"), change.get("model_type")) \
        if own else "llama"
    root, _, _ = converted.ensure(arch)
    hf = root / "hf" / arch
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = {**json.load(open(hf / "config.json")), **change}
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(hf / "model.safetensors")
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr
    assert f"{bad / 'config.json'}: " in proc.stderr and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.partial-*"))


def test_deepseek_multi_token_prediction_layers_are_left_out(converted, tmp_path):
    """DeepSeek-V3's checkpoints carry multi-token-prediction layers after the last decoder
    layer (num_hidden_layers onwards): not converted, said so, never read; the model is
    the one converted without them."""
    from safetensors.torch import load_file, save_file
    root, _, _ = converted.ensure("deepseek_v3")
    hf = root / "hf" / "deepseek_v3"
    with_mtp = tmp_path / "mtp"
    with_mtp.mkdir()
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.4.enorm.weight"] = torch.full((64,), float("nan"))  # never read
    save_file(tensors, with_mtp / "model.safetensors", metadata={"format": "pt"})
    (with_mtp / "config.json").write_text((hf / "config.json").read_text())
    proc = convert_here("--hf-dir", str(with_mtp), "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    assert "not converted: 2 tensors of the layers after num_hidden_layers=4" in proc.stdout


def test_a_failed_conversion_leaves_no_output_and_a_full_folder_is_refused(converted, tmp_path):
    from safetensors.torch import load_file, save_file
    root, _, _ = converted.ensure("qwen3")
    hf = root / "hf" / "qwen3"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((hf / "config.json").read_text())
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.2.self_attn.q_norm.weight"] = torch.ones(16)  # head size 32
    save_file(tensors, bad / "model.safetensors")
    proc = convert_here("--hf-dir", str(bad), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and f"{bad / 'model.safetensors'}: shape mismatch for HF " \
        "'model.layers.2.self_attn.q_norm.weight': (16,), config.json implies (32,)" \
        in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.partial-*"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    proc = convert_here("--hf-dir", str(hf), "--out", str(full))
    assert proc.returncode == 2 and "exists and is not an empty folder" in proc.stderr
    assert os.listdir(full) == ["notes.txt"]


@pytest.mark.extended
def test_the_checkpoint_keeps_the_models_dtype(converted, tmp_path):
    """bf16 in, bf16 out (--dtype auto reads config.json's), and bf16 back out of the
    export; --dtype float32 on request, with the same values."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    root, models, _ = converted
    hf = tmp_path / "bf16"
    copy.deepcopy(models["llama3"]).to(torch.bfloat16).save_pretrained(hf)
    outs = {}
    for dtype in ("auto", "float32"):
        outs[dtype] = tmp_path / dtype
        tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(outs[dtype]),
             "--dtype", dtype)
    assert "params_dtype: bfloat16" in (outs["auto"] / "config.yaml").read_text()
    assert "params_dtype: float32" in (outs["float32"] / "config.yaml").read_text()
    tensors = {}
    for dtype, out in outs.items():
        path = out / "checkpoints" / "step_0000000"
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                 for k, v in meta.items() if hasattr(v, "chunks")}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        tensors[dtype] = state
    assert set(tensors["auto"]) == set(tensors["float32"])
    for key, value in tensors["auto"].items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value.float(), tensors["float32"][key]), key
    # and back: bf16 out again, bitwise the bf16 files it came from
    from safetensors.torch import load_file
    back = tmp_path / "back"
    tool("convert_megatron_to_hf.py", "--config", str(outs["auto"] / "config.yaml"),
         "--out", str(back))
    original, restored = load_file(hf / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(original) == set(restored)
    for key in original:
        assert restored[key].dtype == torch.bfloat16 and torch.equal(original[key],
                                                                    restored[key]), key
    assert json.load(open(back / "config.json"))["torch_dtype"] == "bfloat16"
    # the streamed export lays the file out as the safetensors library does: the same bytes
    assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


_checkpoint_tensors = checkpoint_tensors


@pytest.mark.extended
@pytest.mark.parametrize("arch, args", [
    ("llama3", ["--tp", "2"]), ("qwen3", ["--pp", "2"]), ("gpt2", ["--tp", "2"]),
    ("qwen3_rm", ["--role", "reward", "--pp", "2"]),
    ("mistral_nemo", ["--role", "critic", "--tp", "2"]), ("gpt_oss", ["--tp", "2"])],
    ids=lambda x: str(x))
def test_streaming_conversion_equals_the_model_built_whole(converted, tmp_path, arch, args):
    """The default write (a meta-device model, each tensor made as it is written) gives
    the checkpoint of the model built whole and saved as a run saves it (--in-memory),
    tensor for tensor, at TP=2 and PP=2 targets; a causal LM as a critic starts a fresh,
    seeded head in both."""
    root, _, _ = converted.ensure(arch)
    outs = {}
    for way in ("stream", "in-memory"):
        outs[way] = tmp_path / way
        proc = tool("convert_hf_to_megatron.py", "--hf-dir", str(root / "hf" / arch),
                    "--out", str(outs[way]), *args,
                    *(["--in-memory"] if way == "in-memory" else []))
        assert ("new scalar head" in proc.stdout) == (arch == "mistral_nemo")
    a, b = (_checkpoint_tensors(out / "checkpoints" / "step_0000000") for out in outs.values())
    assert set(a) == set(b) and len(a) >= 8
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _export(config, out, *args):
    return tool("convert_megatron_to_hf.py", "--config", str(config), "--out", str(out), *args)


def _same_files(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return names


@pytest.mark.extended
@pytest.mark.parametrize("arch, args", [
    ("llama3", []), ("mistral_nemo", ["--shard-layers", "1"]), ("gpt2", ["--shard-layers", "3"]),
    ("qwen2", []), ("qwen3_rm", ["--role", "reward"]), ("qwen3_moe", ["--shard-layers", "1"]),
    ("mixtral", []), ("gpt_oss", ["--shard-layers", "1"])], ids=lambda x: str(x))
def test_streamed_export_writes_the_bytes_of_the_in_memory_export(converted, tmp_path, arch, args):
    """The default export (a meta-device model; each layer read from the checkpoint,
    converted and written to its place in the safetensors files) writes the same bytes as
    the model loaded whole and saved by the safetensors library (--in-memory): tied and
    untied heads, GPT-2's biases and Qwen2's, a value head, one file and sharded with an
    index."""
    root, _, _ = converted.ensure(arch)
    config = root / "conv" / arch / "config.yaml"
    _export(config, tmp_path / "stream", *args)
    _export(config, tmp_path / "whole", "--in-memory", *args)
    names = _same_files(tmp_path / "stream", tmp_path / "whole")
    assert ("model.safetensors.index.json" in names) == bool(args and args[0] == "--shard-layers")


@pytest.mark.extended
def test_streamed_export_reads_a_checkpoint_saved_at_tp2(tmp_path):
    """A policy trained at TP=2 is stored in halves of each layer's tensors (the gated MLP's
    halves interleaved by rank): the layer-at-a-time reads put them together as the whole
    load does, byte for byte."""
    from conftest import tiny_common
    from megarlhf.data.synthetic import write_task

    task = write_task(str(tmp_path / "task"), seed=0)
    torchrun(["sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}",
              "train.max_steps=1", "checkpoint.save_interval=1",
              "parallel.tensor_model_parallel_size=2", *tiny_common(tmp_path, task)], 2)
    ckpt = next(tmp_path.glob("*/checkpoints"))
    for way in ("stream", "whole"):
        tool("convert_megatron_to_hf.py", "--config", os.path.join(ROOT, "configs/sft_tiny.yaml"),
             "--ckpt", str(ckpt), "--out", str(tmp_path / way), "--shard-layers", "1",
             *(["--in-memory"] if way == "whole" else []))
    _same_files(tmp_path / "stream", tmp_path / "whole")


def test_safetensors_files_are_the_librarys_bytes(tmp_path):
    """The header-first writer lays a file out as safetensors' save_file does (mixed dtypes
    sorted as it sorts them), whatever order the tensors come in; a tensor of the wrong
    shape, one not planned or one missing is an error."""
    from safetensors.torch import save_file

    from megarlhf.engine.streaming import SafetensorsFiles

    g = torch.Generator().manual_seed(0)
    tensors = {"b.w": torch.randn(3, 5, generator=g).bfloat16(), "a.x": torch.randn(7, generator=g),
               "z": torch.randn(2, 2, generator=g).half(), "m": torch.arange(5),
               "flag": torch.tensor([True, False]), "s": torch.tensor(2.5)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    plan = {"mine.safetensors": {k: v.to("meta") for k, v in tensors.items()}}
    writer = SafetensorsFiles(str(tmp_path), plan, {"format": "pt"})
    for key in ["z", "s", "a.x", "flag", "b.w", "m"]:
        writer.write(key, tensors[key])
    writer.finish()
    assert (tmp_path / "mine.safetensors").read_bytes() == \
        (tmp_path / "ref.safetensors").read_bytes()
    writer = SafetensorsFiles(str(tmp_path), plan)
    with pytest.raises(ValueError, match="planned"):
        writer.write("b.w", tensors["b.w"].float())
    with pytest.raises(KeyError, match="not in the planned"):
        writer.write("other", tensors["m"])
    writer.write("m", tensors["m"])
    with pytest.raises(RuntimeError, match="5 of 6 tensors never written"):
        writer.finish()
