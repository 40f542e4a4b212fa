"""Per-token log-probs and values are the same at every parallel layout (fp32, 1e-5):
both architectures with grouped-query attention, a Qwen3-shaped llama (head size of its
own, q/k norms, llama3 RoPE scaling), an OLMo-3-shaped one (norms after the sublayers, q/k
over all heads, sliding windows in three of four layers, partial rotary) and a
Gemma-3-shaped one (sandwich and (1 + w) norms, GeGLU, a scaled embedding, the local
layers' own RoPE base), a gpt-oss-shaped one (sinks split over TP with the heads, biased
experts, the clamped SwiGLU, windows, YaRN), LM and value heads, temperature scaling; and
the `megarlhf score` CLI at TP=1/PP=1, TP=2 and PP=2."""

import json
import os

import pytest
import torch

from conftest import WORKERS, run_cli, torchrun
from workers.common import fixed_sequences
from workers.score_layouts import PROMPT

TOL = 1e-5


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("layouts"))
    worker = os.path.join(WORKERS, "score_layouts.py")
    torchrun(worker, 2, out)
    torchrun(worker, 1, out)
    return (torch.load(os.path.join(out, "layouts_world1.pt"), weights_only=False),
            torch.load(os.path.join(out, "layouts_world2.pt"), weights_only=False))


LAYOUT_CASES = [(arch, role, tp, pp, vpp, temp)
                for arch in ("llama", "gpt2", "qwen3", "olmo3", "gemma3", "gptoss")
                for role in ("lm", "value")
                for tp, pp, vpp in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2)]
                for temp in ((1.0, 0.7) if role == "lm" else (1.0,))]


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_layout_matches_single_process(layout_results, case):
    ref_all, run_all = layout_results
    arch, role, tp, pp, vpp, temp = case
    ref, run = ref_all[(arch, role, 1, 1, 1, temp)], run_all[case]
    field = "values" if role == "value" else "logprobs"
    assert len(ref) == len(run) == 8
    for a, b in zip(ref, run, strict=True):
        assert a["tokens"] == b["tokens"]
        assert len(a[field]) == len(b[field]) == len(a["tokens"]) - (role == "lm")
        assert max(abs(x - y) for x, y in zip(a[field], b[field], strict=True)) < TOL
    flat = [x for r in ref for x in r[field]]
    assert max(flat) - min(flat) > 1e-3  # not a constant output
    if role == "lm":
        assert all(x < 0 for x in flat)


@pytest.mark.slow
def test_response_only_outputs_equal_the_full_forwards(layout_results):
    """The sequence step computes the last layer's MLP, the final norm and the head at the
    response positions only (LM: P - 1 .. S - 2; value: P - 1 .. S - 1, for each row's
    last value); its log-probs, entropy and values equal the full forward's there, at
    every layout, for both architectures (with speedups.positions; without it the whole
    sequence runs and the output is sliced)."""
    gaps = [{key: value[0] for key, value in results.items() if key[0] == "response_only"}
            for results in layout_results]
    assert [len(g) for g in gaps] == [3 * 2, 3 * 2 * 4]  # archs x roles; world 1, world 2
    assert max(max(g.values()) for g in gaps) < 1e-6, gaps
    # the last MLP saw (positions kept) x (rows per micro-batch) rows, on the last stage
    length = max(len(s) for s in fixed_sequences(8))
    for results in layout_results:
        for key, value in results.items():
            if key[0] == "response_only":
                rows = value[1]
                kept = length - PROMPT + (key[2] == "value")
                if not results["positions_cut"]:
                    kept = length
                assert rows and set(rows) == {kept * 2}, (key, rows)


@pytest.mark.slow
def test_head_only_cut_equals_the_full_forwards(layout_results):
    """Where a model does not allow the MLP cut, the head (LM or scalar) cuts instead: the
    same outputs, and the last MLP sees every position."""
    cases = {key: value for key, value in layout_results[0].items() if key[0] == "head_only"}
    assert len(cases) == 3 * 2  # archs x roles, world 1
    length = max(len(s) for s in fixed_sequences(8))
    for key, (gap, rows) in cases.items():
        assert gap < 1e-6, key
        assert set(rows) == {length * 2}, (key, rows)


@pytest.mark.slow
def test_temperature_changes_logprobs(layout_results):
    ref = layout_results[0]
    a = ref[("llama", "lm", 1, 1, 1, 1.0)][0]["logprobs"]
    b = ref[("llama", "lm", 1, 1, 1, 0.7)][0]["logprobs"]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) > 1e-3


def write_sequences(path):
    gen = torch.Generator().manual_seed(3)
    with open(path, "w") as f:
        for n in (12, 5, 9, 16, 3, 7, 2):
            f.write(json.dumps({"tokens": torch.randint(0, 500, (n,), generator=gen).tolist()})
                    + "\n")


def read_rows(path):
    return [json.loads(line) for line in open(path)]


def score_cli(tmp_path, name: str, nprocs: int, seqs, args: list[str]) -> list[dict]:
    """``megarlhf score`` on ``seqs`` in ``nprocs`` processes; the rows it wrote."""
    out = tmp_path / f"{name}.jsonl"
    argv = ["score", "--input", str(seqs), "--output", str(out), *args]
    if nprocs == 1:
        run_cli(*argv)
    else:
        torchrun(argv, nprocs)
    return read_rows(out)


@pytest.mark.extended
@pytest.mark.slow
def test_score_cli_same_logprobs_at_three_layouts(tmp_path):
    seqs = tmp_path / "seqs.jsonl"
    write_sequences(seqs)
    common = ["model.vocab_size=500", "model.num_layers=4", "model.num_query_groups=2",
              "run.seed=11"]
    outs = {}
    for name, nprocs, extra in [("tp1pp1", 1, []),
                                ("tp2", 2, ["parallel.tensor_model_parallel_size=2"]),
                                ("pp2", 2, ["parallel.pipeline_model_parallel_size=2"])]:
        outs[name] = score_cli(tmp_path, name, nprocs, seqs, [*common, *extra])
    for name in ("tp2", "pp2"):
        for a, b in zip(outs["tp1pp1"], outs[name], strict=True):
            assert a["tokens"] == b["tokens"]
            assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < TOL


def test_read_sequences_errors(tmp_path):
    from megarlhf.stages.score import read_sequences

    bad = tmp_path / "bad.jsonl"
    cases = [('{"tokens": [1, 2, 3]}\nnot json\n', "bad.jsonl:2: not valid JSON"),
             ('{"tokens": [1, "a"]}\n', "bad.jsonl:1: 'tokens' must be a list of integers"),
             ('{"tokens": [1]}\n', "bad.jsonl:1: a sequence needs at least 2 tokens"),
             ('{"ids": [1, 2]}\n', "bad.jsonl:1: each row needs 'tokens' or 'text'"),
             ('{"text": "hello"}\n', "bad.jsonl:1: a 'text' row needs tokenizer.path"),
             ('\n\n', "holds no sequences")]
    for text, message in cases:
        bad.write_text(text)
        with pytest.raises(ValueError) as err:
            read_sequences(str(bad), None, 500)
        assert message in str(err.value)
    with pytest.raises(FileNotFoundError):
        read_sequences(str(tmp_path / "none.jsonl"))


def test_score_cli_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [1, 900]}\n')
    proc = run_cli("score", "--input", str(bad), "--output", str(tmp_path / "o.jsonl"),
                   "model.vocab_size=500", check=False)
    assert proc.returncode == 2 and "bad.jsonl:2: token id out of range [0, 500)" in proc.stderr
    proc = run_cli("score", "--input", str(bad), "--output", str(tmp_path / "o.jsonl"),
                   "model.vocab_size=500", "parallel.tensor_model_parallel_size=2",
                   check=False)
    assert proc.returncode == 2 and "world size=1 is invalid" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.fixture(scope="module")
def role_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("roles"))
    worker = os.path.join(WORKERS, "role_layouts.py")
    torchrun(worker, 2, out)
    torchrun(worker, 1, out)
    return (torch.load(os.path.join(out, "roles_world1.pt"), weights_only=False),
            torch.load(os.path.join(out, "roles_world2.pt"), weights_only=False))


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("actor", "TP=2 PP=1 DP=1"),
                                          ("critic", "TP=1 PP=2 DP=1"),
                                          ("reference", "TP=1 PP=2 DP=1 VPP=2"),
                                          ("reward", "TP=1 PP=1 DP=2")])
def test_each_role_at_its_own_layout_matches_one_process(role_results, name, layout):
    """Actor (4x64) at TP=2, critic (2x32) at PP=2, reference at PP=2 x VPP=2 and reward
    model (2x32) at DP=2, built side by side in one job: per-token log-probs / values equal
    the same roles at TP=1 PP=1 in one process (fp32, 1e-5)."""
    ref, run = role_results[0][name], role_results[1][name]
    assert ref["layout"] == "TP=1 PP=1 DP=1" and run["layout"] == layout
    field = "values" if name in ("critic", "reward") else "logprobs"
    flat = []
    for a, b in zip(ref["rows"], run["rows"], strict=True):
        assert a["tokens"] == b["tokens"] and len(a[field]) == len(b[field])
        assert max(abs(x - y) for x, y in zip(a[field], b[field], strict=True)) < TOL
        flat += a[field]
    assert max(flat) - min(flat) > 1e-3  # a real output, not a constant


@pytest.mark.slow
@pytest.mark.extended
def test_score_cli_packed_equals_padded(tmp_path):
    """``megarlhf score --max-tokens``: packed sequences (one process, and data-parallel
    shares balanced by tokens at DP=2; the other layouts: tests/test_packing.py) give the
    padded run's log-probs and entropies, and a value model's values (the last position's
    too); a sequence over the budget is refused before any work."""
    seqs = tmp_path / "seqs.jsonl"
    write_sequences(seqs)
    longest = max(len(r["tokens"]) for r in read_rows(seqs))
    common = ["model.vocab_size=500", "model.num_layers=4", "model.num_query_groups=2",
              "run.seed=11"]
    outs = {}
    for name, nprocs, extra in [("padded", 1, []), ("packed", 1, ["--max-tokens", "80"]),
                                ("packed_dp2", 2, ["--max-tokens", "80"]),
                                ("value_padded", 1, ["--role", "value",
                                                     "model.value_head_init=normal"]),
                                ("value_packed", 1, ["--role", "value", "--max-tokens", "80",
                                                     "model.value_head_init=normal"])]:
        outs[name] = score_cli(tmp_path, name, nprocs, seqs, [*common, *extra])
    pairs = [("padded", n, k) for n in ("packed", "packed_dp2")
             for k in ("logprobs", "entropy")] + [("value_padded", "value_packed", "values")]
    for ref, name, key in pairs:
        for a, b in zip(outs[ref], outs[name], strict=True):
            assert a["tokens"] == b["tokens"] and len(a[key]) == len(b[key])
            assert max(abs(x - y) for x, y in zip(a[key], b[key])) < TOL, (name, key)
    assert max(abs(v) for r in outs["value_packed"] for v in r["values"]) > 0.01
    small = run_cli("score", "--input", str(seqs), "--output", str(tmp_path / "x.jsonl"),
                    "--max-tokens", str(longest - 1), *common, check=False)
    assert small.returncode != 0 and f"more than --max-tokens={longest - 1}" in small.stderr
