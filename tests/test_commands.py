"""Every command shown to a user runs as written: the ```bash blocks of README.md and
docs/*.md, the pipeline in ``megarlhf --help`` and the examples of each command's
``--help``, extracted from the text and run in a scratch copy of the repository after the
demo (``MEGARLHF_DEMO_QUICK=1``: the same pipeline, a few steps of each stage).

"Shortened" means only: training commands get a step or iteration budget appended
(``SHORT``), and every command the progress bar and TensorBoard switched off. The
preconditions the docs name (a Hugging Face directory ``./my-llama`` / ``my-hf``, token
sequences ``seqs.jsonl``, chat data ``chat_*.jsonl``) are made first, from the tiny random
chat model of tests/chat_model.py. ``NOT_RUN`` lists, with the reason, what is not run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

# command start -> why it does not run here
NOT_RUN = {
    "pip install": "installs packages (the suite runs in the environment it sets up)",
    "bash scripts/test.sh": "the test suite itself",
    "bash scripts/demo.sh": "run first, shortened (MEGARLHF_DEMO_QUICK=1)",
}
QUIET = "logging.progress_bar=false logging.tensorboard=false"
# the command (its first word after `megarlhf` / `megarlhf.cli`) -> what is appended
SHORT = {
    "sft": "train.max_steps=2",
    "rm": "train.max_steps=2",
    "dpo": "train.max_steps=2",
    "distill": "train.max_steps=2",
    "ppo": "ppo.num_iterations=1 ppo.eval_interval=1 ppo.num_eval_prompts=4",
}
TRAINING = tuple(SHORT)


def markdown_commands(path: str) -> list[str]:
    """Commands of the file's ```bash blocks: continuation lines joined, comments cut."""
    text = open(path).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = re.sub(r"\s{2,}#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def help_commands() -> list[str]:
    """The pipeline of ``megarlhf --help``, the examples of each command's help, and the
    tools' --help."""
    from megarlhf.cli import build_parser

    parser = build_parser()
    texts = [parser.description]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, command in sub.choices.items():
        texts.append(command.description or "")
        for action in command._actions:  # cache build
            if action.__class__.__name__ == "_SubParsersAction":
                texts += [c.description or "" for c in action.choices.values()]
    for tool in sorted(os.listdir(os.path.join(ROOT, "tools"))):
        if tool.endswith(".py"):
            texts.append(subprocess.run([sys.executable, os.path.join("tools", tool), "--help"],
                                        cwd=ROOT, capture_output=True, text=True,
                                        check=True).stdout)
    out = []
    for text in texts:
        joined = re.sub(r"\\\n\s*", "", text)
        for line in joined.splitlines():
            if not line.startswith(" "):  # examples are indented; prose is not
                continue
            line = re.sub(r"\s{2,}#.*$", "", line).strip()
            # a synopsis names its arguments in capitals (HF_DIR, CONFIG.yaml): not a command
            if re.match(r"^(megarlhf |torchrun |echo .*\| *megarlhf |python tools/)", line) \
                    and not re.search(r"\b[A-Z][A-Z_]{1,}\b", line):
                out.append(line)
    return out


def shortened(command: str) -> str:
    found = re.search(r"(?:megarlhf(?:\.cli)?) (\w+)", command)
    word = found.group(1) if found else None
    if word in TRAINING:
        return f"{command} {SHORT[word]} {QUIET}"
    return command


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A copy of the repository with the demo's outputs and the docs' preconditions."""
    from chat_model import make_chat_model

    root = tmp_path_factory.mktemp("commands") / "repo"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(root, rel)) or root, exist_ok=True)
            shutil.copy2(src, os.path.join(root, rel))
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "MEGARLHF_DEMO_QUICK": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    demo = subprocess.run([sys.executable, "scripts/demo.py"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    model = make_chat_model(str(root / "chat-task"))
    for name in ("my-llama", "my-hf"):
        shutil.copytree(model["hf"], root / name)
    for doc_name, key in (("chat_sft.jsonl", "sft"), ("chat_prefs.jsonl", "prefs"),
                          ("chat_prompts.jsonl", "prompts")):
        shutil.copy(model[key], root / doc_name)
    vocab = model["tokenizer"].vocab_size
    with open(root / "seqs.jsonl", "w") as f:
        for n in (5, 9, 3):
            f.write(json.dumps({"tokens": [(7 * i + n) % vocab for i in range(n)]}) + "\n")
    return root, env


def sources() -> dict[str, list[str]]:
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    out = {"README.md": markdown_commands(os.path.join(ROOT, "README.md"))}
    for name in docs:
        commands = markdown_commands(os.path.join(ROOT, "docs", name))
        if commands:
            out[f"docs/{name}"] = commands
    out["megarlhf --help"] = help_commands()
    return out


def test_the_commands_are_found():
    """The extraction itself: every place that shows commands gives some, and the ones the
    issue named are among them."""
    found = sources()
    assert len(found["README.md"]) >= 15 and len(found["megarlhf --help"]) >= 10
    assert {"docs/conversion.md", "docs/launching.md", "docs/ppo.md",
            "docs/your-own-model.md"} <= set(found)
    assert "megarlhf sft configs/sft_tiny.yaml" in found["megarlhf --help"]


def megarlhf_argv(command: str) -> list[str] | None:
    """The arguments a shown command gives megarlhf (after ``megarlhf`` or ``-m
    megarlhf.cli``, up to a pipe or redirection), or None when it runs no megarlhf command."""
    import shlex

    words = shlex.split(command)
    for i, word in enumerate(words):
        if word in ("megarlhf", "megarlhf.cli"):
            argv = []
            for w in words[i + 1:]:
                if w in ("|", ">", ">>", "&&", ";", "<"):
                    break
                argv.append(w)
            return argv
    return None


def test_every_shown_command_parses_and_its_config_loads():
    """The fast tier's keeper of the commands (the extended tier runs them all): every
    megarlhf command shown in README.md, docs/ and the help parses with the CLI's own
    parser, and its YAML file and overrides load into a valid config where the file is
    part of the repository (a command's config written by an earlier step is only
    parsed). Catches a renamed command, option or config field, and a moved config."""
    from megarlhf.cli import build_parser
    from megarlhf.config import ConfigError, read_config

    parser = build_parser()
    problems, parsed, loaded = [], 0, 0
    for where, commands in sources().items():
        for command in commands:
            argv = megarlhf_argv(command)
            if argv is None or any(command.startswith(start) for start in NOT_RUN):
                continue
            try:
                args, extra = parser.parse_known_args(argv)
            except SystemExit:
                problems.append(f"{where}: {command}: the CLI does not parse it")
                continue
            parsed += 1
            bad = [a for a in extra if a.startswith("-") or "=" not in a]
            if bad:
                problems.append(f"{where}: {command}: unrecognized arguments {bad}")
                continue
            config = getattr(args, "config", None)
            if config and "=" not in config and os.path.isfile(os.path.join(ROOT, config)):
                overrides = list(getattr(args, "overrides", None) or []) + extra
                try:
                    read_config(os.path.join(ROOT, config), overrides)
                    loaded += 1
                except (ConfigError, ValueError) as err:
                    problems.append(f"{where}: {command}: {err}")
    assert not problems, "\n".join(problems)
    assert parsed >= 30 and loaded >= 15, (parsed, loaded)
    print(f"{parsed} commands parsed, {loaded} configs loaded")


@pytest.mark.extended
@pytest.mark.parametrize("source", ["README.md", "docs", "megarlhf --help"])
def test_every_shown_command_runs_as_written(scratch, source):
    root, env = scratch
    found = sources()
    chosen = {k: v for k, v in found.items()
              if k == source or (source == "docs" and k.startswith("docs/"))}
    failures, ran, skipped = [], 0, []
    for where, commands in chosen.items():
        for command in commands:
            why = next((reason for start, reason in NOT_RUN.items()
                        if command.startswith(start)), None)
            if why:
                skipped.append((command, why))
                continue
            run = shortened(command)
            proc = subprocess.run(run, shell=True, cwd=root, env=env, capture_output=True,
                                  text=True, timeout=600)
            ran += 1
            if proc.returncode != 0:
                failures.append(f"{where}: {command}\n  (ran: {run})\n  exit {proc.returncode}:"
                                f"\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)
    assert ran > 0
