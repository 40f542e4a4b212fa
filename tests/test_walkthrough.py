"""docs/your-own-model.md, run exactly: a Hugging Face Llama directory with a chat
template -> convert -> SFT on ``messages`` -> reward model on preference conversations ->
PPO on chat prompts -> export -> transformers ``generate``, whose greedy tokens must be
megarlhf's (``megarlhf generate``, also at TP=2 and PP=2 under torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chat_model import make_chat_model
from conftest import ROOT, run_cli, torchrun

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    model = make_chat_model(str(tmp / "my"))
    conv = str(tmp / "my-model")
    subprocess.run([sys.executable, "tools/convert_hf_to_megatron.py", "--hf-dir",
                    model["hf"], "--out", conv], check=True, cwd=ROOT, capture_output=True)
    common = [f"tokenizer.path={conv}", f"run.output_dir={tmp}", "logging.progress_bar=false",
              "logging.tensorboard=false"]
    sft = run_cli("sft", "configs/chat/sft.yaml", f"checkpoint.load={conv}/checkpoints",
                  f"data.train_path={model['sft']}", *common)
    rm = run_cli("rm", "configs/chat/rm.yaml", f"checkpoint.load={conv}/checkpoints",
                 f"data.train_path={model['prefs']}", "train.max_steps=16", *common)
    ppo_args = ["configs/chat/ppo.yaml", f"ppo.sft_checkpoint={tmp}/chat-sft/checkpoints",
                f"ppo.reward_checkpoint={tmp}/chat-rm/checkpoints",
                f"data.train_path={model['prompts']}", "ppo.num_iterations=2", *common]
    ppo = run_cli("ppo", *ppo_args)
    out = str(tmp / "exported")
    export = run_cli("export", *ppo_args, "--out", out)
    return {"tmp": tmp, "model": model, "conv": conv, "out": out, "ppo_args": ppo_args,
            "common": common, "logs": {"sft": sft, "rm": rm, "ppo": ppo, "export": export}}


def test_the_stages_read_conversations(walk):
    logs = walk["logs"]
    assert "of 512 sft rows kept" in logs["sft"].stdout
    assert "of 512 preference rows kept" in logs["rm"].stdout
    assert "of 256 prompt rows kept" in logs["ppo"].stdout
    sft = [json.loads(line) for line in open(walk["tmp"] / "chat-sft" / "metrics.jsonl")]
    evals = [r["eval/loss"] for r in sft if "eval/loss" in r]
    assert evals[-1] < 0.7 * evals[0]  # SFT on the assistant turns learns
    # the sample table shows chat prompts ending with the generation prompt
    assert "<|im_start|>assistant" in logs["ppo"].stdout
    rows = [json.loads(line) for line in open(walk["tmp"] / "chat-ppo" / "metrics.jsonl")]
    assert rows[-1]["objective/score"] == rows[-1]["objective/score"]  # finite, logged


def test_exported_directory_loads_in_transformers_with_its_tokenizer(walk):
    out = walk["out"]
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    tok = transformers.AutoTokenizer.from_pretrained(out)
    gen_cfg = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen_cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "words: red cat"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nwords: red cat<|im_end|>\n<|im_start|>assistant\n"


def test_the_ema_policy_exports_too(walk):
    import torch

    out = str(walk["tmp"] / "exported_ema")
    run_cli("export", *walk["ppo_args"], "--out", out, "--role", "ema")
    ema = transformers.AutoModelForCausalLM.from_pretrained(out)
    actor = transformers.AutoModelForCausalLM.from_pretrained(walk["out"])
    gaps = [float((a - b).abs().max()) for a, b in zip(ema.parameters(), actor.parameters(), strict=True)]
    assert 0 < max(gaps) < 1.0  # the average lags the actor it follows
    assert all(torch.isfinite(p).all() for p in ema.parameters())


def _megarlhf_greedy(walk, nprocs: int, *layout: str) -> list[dict]:
    key = (nprocs, *layout)
    if key in walk.setdefault("greedy", {}):
        return walk["greedy"][key]
    prompts = walk["tmp"] / "gen_prompts.jsonl"
    rows = [json.loads(line) for line in open(walk["model"]["eval_prompts"])][:6]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = walk["tmp"] / f"gen_{nprocs}_{'_'.join(layout) or 'base'}.jsonl"
    argv = ["generate", walk["ppo_args"][0], f"checkpoint.load={walk['tmp']}/chat-ppo/checkpoints",
            *walk["common"], "rollout.greedy=true", "rollout.max_new_tokens=12",
            "rollout.stop_at_eos=false",  # 12 tokens each: a long comparison
            "-i", str(prompts), "-o", str(out), *layout]
    if nprocs == 1:
        run_cli(*argv)
    else:
        torchrun(argv, nprocs)
    written = [json.loads(line) for line in open(out)]
    assert len(written) == len(rows) == 6, (len(written), len(rows))
    assert all(len(r["response_tokens"]) == 12 for r in written)  # stop_at_eos=false
    walk["greedy"][key] = written, rows
    return walk["greedy"][key]


def test_transformers_greedy_generation_equals_megarlhf(walk):
    import torch

    ours, rows = _megarlhf_greedy(walk, 1)
    out = walk["out"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    model.generation_config.eos_token_id = None  # as rollout.stop_at_eos=false
    for row, mine in zip(rows, ours, strict=True):
        ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)
        theirs = full[0, len(ids):].tolist()
        assert len(theirs) == 12 and mine["response_tokens"] == theirs, (row, mine, theirs)
        assert mine["prompt"] == tok.decode(ids)


@pytest.mark.parametrize("layout", [["parallel.tensor_model_parallel_size=2",
                                     "rollout.tensor_parallel_size=2"],
                                    pytest.param(["parallel.pipeline_model_parallel_size=2"],
                                                 marks=pytest.mark.extended)])
def test_generate_at_other_layouts_equals_one_process(walk, layout):
    one, _ = _megarlhf_greedy(walk, 1)
    two, _ = _megarlhf_greedy(walk, 2, *layout)
    assert [r["response_tokens"] for r in two] == [r["response_tokens"] for r in one]


@pytest.mark.extended
def test_generate_reads_stdin_and_refuses_what_it_cannot_do(tiny_checkpoints, tmp_path):
    """Plain-text prompts on stdin, JSONL on stdout (the notes go to stderr), the same
    samples for the same seed; a value model, an empty prompt and a too-long prompt are
    errors before any work."""
    out, task, common = tiny_checkpoints
    base = ["generate", "configs/sft_tiny.yaml", f"checkpoint.load={out}/sft-tiny/checkpoints",
            *common, "rollout.max_new_tokens=6", "-i", "-", "-o", "-"]

    def run(*extra, stdin="words: red cat\nwords: blue tree house\n", check=True):
        return subprocess.run([sys.executable, "-m", "megarlhf.cli", *base, *extra],
                              input=stdin, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=check)

    first, again = run(), run()
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["words: red cat", "words: blue tree house"]
    assert first.stdout == again.stdout and "[generate]" in first.stderr
    assert all(1 <= len(r["response_tokens"]) <= 6 for r in rows)
    bad = run(f"checkpoint.load={out}/rm-tiny/checkpoints", check=False)
    assert bad.returncode == 2 and "is a value model" in bad.stderr
    bad = run(stdin='{"tokens": []}\n', check=False)
    assert bad.returncode == 2 and "the prompt is empty" in bad.stderr
    bad = run(stdin="words: " + "red " * 80 + "\n", check=False)
    assert bad.returncode == 2 and "beyond the model's 64" in bad.stderr


@pytest.mark.parametrize("name", ["llama3", pytest.param("qwen3", marks=pytest.mark.extended)])
def test_a_family_directory_generates_as_transformers_and_stops_at_its_end_tokens(name, tmp_path):
    """docs/your-own-model.md's first steps with a Llama-3-shaped and a Qwen3-shaped model
    directory: convert, then ``megarlhf generate`` on chat prompts gives transformers'
    greedy tokens, stopping where it stops - at every end token generation_config.json
    lists, not only the tokenizer's EOS (one is made the greedy choice often)."""
    from collections import Counter

    import torch

    model = make_chat_model(str(tmp_path / "my"), family=name)
    hf_model, tok, ends = model["model"], model["tokenizer"], model["ends"]
    rows = [json.loads(line) for line in open(model["eval_prompts"])][:6]
    prompts = []
    for row in rows:
        ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    with torch.no_grad():
        free = [hf_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                                  min_new_tokens=16, pad_token_id=tok.pad_token_id
                                  )[0, len(p):].tolist() for p in prompts]
        top = Counter(t for seq in free for t in seq[2:] if t not in ends).most_common(1)[0][0]
        end = ends[0] if ends[0] != tok.eos_token_id else ends[1]  # not the tokenizer's EOS
        hf_model.lm_head.weight[end] = 1.5 * hf_model.lm_head.weight[top]
    hf_model.save_pretrained(model["hf"])
    conv = str(tmp_path / "my-model")
    subprocess.run([sys.executable, "tools/convert_hf_to_megatron.py", "--hf-dir",
                    model["hf"], "--out", conv], check=True, cwd=ROOT, capture_output=True)
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "generated.jsonl"
    run_cli("generate", "configs/chat/sft.yaml", f"checkpoint.load={conv}/checkpoints",
            f"tokenizer.path={conv}", "rollout.greedy=true", "rollout.max_new_tokens=16",
            "logging.progress_bar=false", "-i", str(src), "-o", str(out))
    ours = [json.loads(line)["response_tokens"] for line in open(out)]
    stopped_at = Counter()
    with torch.no_grad():
        for prompt, mine in zip(prompts, ours, strict=True):
            theirs = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                       max_new_tokens=16, pad_token_id=tok.pad_token_id
                                       )[0, len(prompt):].tolist()
            assert mine == theirs, (mine, theirs)
            stopped_at[theirs[-1] if theirs[-1] in ends else None] += 1
    assert stopped_at[end] >= 1, stopped_at


@pytest.mark.parametrize("name", ["llama3", pytest.param("qwen3", marks=pytest.mark.extended)])
def test_the_walkthrough_with_a_llama3_and_a_qwen3_directory(name, tmp_path):
    """docs/your-own-model.md's commands, shortened, on a Llama-3-shaped and a Qwen3-shaped
    model directory (their templates, end tokens, q/k norms, head sizes, RoPE scaling):
    convert, SFT on messages (Qwen3's multi-turn rows one per turn), a reward model on
    preference conversations, PPO, export; transformers loads the export with its family's
    config and the end tokens generation_config.json listed."""
    model = make_chat_model(str(tmp_path / "my"), family=name)
    conv = str(tmp_path / "my-model")
    subprocess.run([sys.executable, "tools/convert_hf_to_megatron.py", "--hf-dir",
                    model["hf"], "--out", conv], check=True, cwd=ROOT, capture_output=True)
    common = [f"tokenizer.path={conv}", f"run.output_dir={tmp_path}",
              "logging.progress_bar=false", "logging.tensorboard=false",
              "data.max_prompt_len=160", "data.max_seq_len=200"]
    run_cli("sft", "configs/chat/sft.yaml", f"checkpoint.load={conv}/checkpoints",
            f"data.train_path={model['sft']}", "train.max_steps=6", *common)
    run_cli("rm", "configs/chat/rm.yaml", f"checkpoint.load={conv}/checkpoints",
            f"data.train_path={model['prefs']}", "train.max_steps=6", *common)
    ppo_args = ["configs/chat/ppo.yaml", f"ppo.sft_checkpoint={tmp_path}/chat-sft/checkpoints",
                f"ppo.reward_checkpoint={tmp_path}/chat-rm/checkpoints",
                f"data.train_path={model['prompts']}", "ppo.num_iterations=1", *common]
    ppo = run_cli("ppo", *ppo_args)
    assert "of 256 prompt rows kept" in ppo.stdout
    rows = [json.loads(line) for line in open(tmp_path / "chat-ppo" / "metrics.jsonl")]
    assert rows and rows[-1]["objective/score"] == rows[-1]["objective/score"]
    out = tmp_path / "exported"
    run_cli("export", *ppo_args, "--out", str(out))
    config = json.load(open(out / "config.json"))
    assert config["model_type"] == {"llama3": "llama", "qwen3": "qwen3"}[name]
    assert ("rope_scaling" in config) == (name == "llama3") and \
        ("head_dim" in config) == (name == "qwen3")
    ends = json.load(open(out / "generation_config.json"))["eos_token_id"]
    assert set(ends) == set(model["ends"])
    transformers.AutoModelForCausalLM.from_pretrained(out)
