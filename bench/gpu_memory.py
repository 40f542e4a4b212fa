"""The memory planner against one CUDA GPU at long sequences (printed; nothing asserted).

    python bench/gpu_memory.py [--tokens 2048 8192] [--recompute none full] [--out DIR]
                               [--quick]

A PPO iteration (actor, critic, reference and reward model, one GPU, bf16, Llama-shaped
8 x 1024, a word-level tokenizer of ``--vocab`` words - the synthetic task's and made-up
ones - so the logits weigh what a real vocabulary's do) on prompts about as long as each
``--tokens`` less 64, with 64 new tokens: ``tests/workers/memory_paths.py`` runs two iterations and
records the allocator's peak per phase (``torch.cuda.max_memory_allocated`` between the
phase's start and end, the ``memory/<phase>/peak_allocated`` metric) and ``megarlhf
plan``'s figures for the same config and the same prompt and response widths. Printed per
phase: the plan's total, the measured peak, their ratio; and the training phase's
activations, planned and measured (autograd's saved tensors). ``--recompute``: each length
without recomputation (``none``) and with the trained roles' full recomputation, one layer
at a time (``full``). Log-probs are always taken a chunk of positions at a time, with the
head in the chunks; micro-batches are packed (the default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT  # noqa: E402

SIZE = dict(layers=8, hidden=1024, heads=16, kv_heads=8, ffn=2816)
QUICK = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=352)
NEW = 64
GIB = 2**30


def word_tokenizer(path: str, vocab: int) -> list[str]:
    """A ``tokenizers`` word-level tokenizer.json of ``vocab`` entries: the special tokens,
    the synthetic task's words, then made-up ones. Returns its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megarlhf.data.synthetic import WORDS

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    words = list(dict.fromkeys(["words:", *WORDS]))
    words += [f"w{i}" for i in range(vocab - len(special) - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(special + words)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    tok.save(path)
    return words


def long_prompts(path: str, words: list[str], tokens: int, rows: int, seed: int) -> str:
    """``rows`` prompts of ``tokens`` words (one token each)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words)
                                                    for _ in range(tokens))}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--recompute", nargs="+", default=["none", "full"],
                        choices=["none", "full"])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--quick", action="store_true", help="a tiny model (a smoke run)")
    args = parser.parse_args()
    from megarlhf.data.synthetic import write_task

    out = args.out or tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    s = QUICK if args.quick else SIZE
    longest = max(args.tokens)
    task = write_task(os.path.join(out, "task"), seed=0)
    tokenizer = os.path.join(out, "tokenizer.json")
    words = word_tokenizer(tokenizer, args.vocab)
    sizes = [f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
             f"model.num_attention_heads={s['heads']}",
             f"model.num_query_groups={s['kv_heads']}", f"model.ffn_hidden_size={s['ffn']}",
             "model.params_dtype=bfloat16", f"model.max_position_embeddings={longest + 64}"]
    common = ["tokenizer.type=hf", f"tokenizer.path={tokenizer}", f"run.output_dir={out}",
              "logging.progress_bar=false", "logging.tensorboard=false"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def cli(*argv):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "megarlhf.cli", *argv], cwd=ROOT,
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"gpu_memory: {argv[0]} failed")
        print(f"  ({argv[0]}: {time.perf_counter() - start:.0f} s)", flush=True)

    cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", "train.max_steps=1",
        "checkpoint.save_interval=1", *sizes, *common)
    cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}", "train.max_steps=1",
        "checkpoint.save_interval=1", *sizes, *common)
    cases = {}
    for tokens in args.tokens:
        prompts = long_prompts(os.path.join(out, f"prompts_{tokens}.jsonl"), words,
                               tokens - NEW - 8, rows=8, seed=tokens)
        for recompute in args.recompute:
            cases[f"seq{tokens}-{recompute}"] = {"iterations": 2, "overrides": [
                *(f"roles.{role}.model.recompute.granularity={recompute}"
                  for role in ("actor", "critic") if recompute != "none"),
                f"data.train_path={prompts}", f"data.eval_path={prompts}",
                f"data.max_prompt_len={tokens - NEW}", f"data.max_seq_len={tokens}",
                f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
                f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_eval_prompts=2",
                "ppo.rollout_batch_size=8", "ppo.mini_batch_size=4", "ppo.micro_batch_size=2",
                "ppo.ppo_epochs=1", "ppo.eval_interval=100", f"rollout.max_new_tokens={NEW}",
                "rollout.stop_at_eos=false", "logging.sample_table_interval=0", *common]}
    table = os.path.join(out, "memory_cases.json")
    with open(table, "w") as f:
        json.dump(cases, f)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "1", os.path.join(ROOT, "tests", "workers",
                                                          "memory_paths.py"), table, out],
                   cwd=ROOT, env=env, check=True)
    print(f"  (PPO cases: {time.perf_counter() - start:.0f} s)")
    print(f"\nPPO, one GPU, bf16, {s['layers']} x {s['hidden']} actor, critic, reference and "
          f"reward model, vocabulary {args.vocab}, 8 rows, micro-batch 2, {NEW} new tokens:")
    print("| sequence | recompute | phase | planned GiB | measured peak GiB | "
          "measured / planned |")
    print("|---|---|---|---|---|---|")
    for name in cases:
        result = json.load(open(os.path.join(out, f"{name}.rank0.json")))
        length, recompute = name[3:].split("-")
        measured, planned = result["measured"], result["planned_full_totals"]
        for phase, plan in planned.items():
            peak = measured.get(f"{phase}/all/peak_allocated")
            if peak is None:
                continue
            print(f"| {length} | {recompute} | {phase} | {plan / GIB:.2f} | {peak / GIB:.2f} | "
                  f"{peak / plan:.2f} |")
        for key in sorted(k for k in measured if k.startswith("train/")
                          and k.endswith("/activations")):
            print(f"| {length} | {recompute} | {key} | "
                  f"{result['planned'].get(key, 0) / GIB:.2f} | "
                  f"{measured[key] / GIB:.2f} | "
                  f"{measured[key] / max(result['planned'].get(key, 1), 1):.2f} |")
    # The cases share one process: a case's peaks hold what was still allocated when it began.
    began = {name[3:]: json.load(open(os.path.join(out, f"{name}.rank0.json")))
             .get("leftover_allocated") or 0 for name in cases}
    print("allocated when each case began (GiB): "
          + ", ".join(f"{name} {value / GIB:.2f}" for name, value in began.items()))
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
