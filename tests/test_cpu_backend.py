"""The CPU backend: pinned megatron-core, each redirection, and every megatron path it
exists for (pipeline-schedule training step, DDP + distributed optimizer, checkpoint save),
run on real gloo process groups and compared with a single-process reference."""

import os

import pytest
import torch

from conftest import WORKERS, torchrun
from megarlhf.parallel import cpu_backend

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend is CPU-only")


def test_pinned_megatron_core_version():
    import megatron.core
    assert megatron.core.__version__ == cpu_backend.PINNED_MEGATRON_CORE, (
        "megatron-core changed: the CPU backend redirects internals measured on "
        f"{cpu_backend.PINNED_MEGATRON_CORE}; re-verify tests/test_cpu_backend.py before "
        "bumping the pin")


def test_megatron_still_hardcodes_what_we_redirect():
    """If these call sites move, the redirections may no longer be needed or enough."""
    import inspect

    from megatron.core.optimizer import optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    assert 'device="cuda"' in inspect.getsource(schedules)
    assert "torch.cuda.current_device()" in inspect.getsource(p2p_communication)
    assert "torch.cuda.FloatTensor" in inspect.getsource(optimizer)


def test_redirections_and_deactivate():
    was_active = cpu_backend.is_active()
    cpu_backend.activate()
    try:
        assert torch.cuda.current_device() == torch.device("cpu")  # process-wide
        torch.cuda.synchronize()
        assert torch.ones(1).type() == "torch.FloatTensor"  # outside a door: no mode
        with cpu_backend.at_megatron():
            assert torch.zeros(2, device="cuda").device.type == "cpu"
            assert torch.empty(3, device=torch.device("cuda", 0)).device.type == "cpu"
            t = torch.ones(2)
            assert t.type() == "torch.cuda.FloatTensor"
            assert t.cuda() is t
            assert t.to("cuda").device.type == "cpu"
            assert t.type(torch.float64).dtype == torch.float64  # casts still work
            with cpu_backend.at_megatron():  # a door inside a door: still one mode
                assert torch._C._len_torch_function_stack() == 1
        assert torch.ones(1).type() == "torch.FloatTensor"  # and off after the door
    finally:
        if not was_active:
            cpu_backend.deactivate()
    if not was_active:
        assert torch.ones(1).type() == "torch.FloatTensor"


def test_the_named_generator_states_are_cpu_ones():
    """Redirection 6: megatron's tracker (sequence parallelism's dropout forks into its
    tensor-parallel state) seeds CPU generator states as ``model_parallel_cuda_manual_seed``
    does - a state per TP rank - and a fork draws from the named state, keeps where it got
    to, and puts the generator back where it was."""
    from megatron.core.tensor_parallel import random as mrandom
    was_active = cpu_backend.is_active()
    cpu_backend.activate()
    try:
        draws = {}
        for tp_rank in (0, 1):
            mrandom.model_parallel_cuda_manual_seed(5, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
            tracker = mrandom.get_cuda_rng_tracker()
            torch.manual_seed(99)
            outer = torch.get_rng_state()
            with tracker.fork():
                first = torch.rand(4)
            assert torch.equal(torch.get_rng_state(), outer)  # the generator put back
            with tracker.fork():
                second = torch.rand(4)  # goes on from where the first fork stopped
            want = torch.Generator().manual_seed(5 + 2718 + tp_rank)  # megatron's TP seed
            assert torch.equal(first, torch.rand(4, generator=want))
            assert torch.equal(second, torch.rand(4, generator=want))
            draws[tp_rank] = first
        assert not torch.equal(draws[0], draws[1])
    finally:
        if not was_active:
            cpu_backend.deactivate()


def test_suspended_lifts_only_the_mode():
    was_active = cpu_backend.is_active()
    cpu_backend.activate()
    try:
        with cpu_backend.at_megatron():
            with cpu_backend.suspended():
                assert torch.ones(1).type() == "torch.FloatTensor"  # mode lifted
                assert torch.cuda.current_device() == torch.device("cpu")  # patches kept
                with cpu_backend.suspended():  # nesting: nothing more to lift
                    assert torch.ones(1).type() == "torch.FloatTensor"
                with cpu_backend.at_megatron():  # a door inside: the mode again
                    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
            assert torch.ones(1).type() == "torch.cuda.FloatTensor"  # back on exit
            with pytest.raises(ValueError), cpu_backend.suspended():
                raise ValueError  # and back after an exception
            assert torch.zeros(1, device="cuda").device.type == "cpu"
    finally:
        if not was_active:
            cpu_backend.deactivate()
    with cpu_backend.suspended():  # inactive: a no-op
        assert torch.ones(1).type() == "torch.FloatTensor"


def test_the_mode_is_entered_only_at_megatrons_doors():
    """Issue 56: the CPU backend's mode is entered at megatron-core's entry points (role
    build, schedules, optimizer step, checkpoints, resharding) and lifted only inside the
    engine; no other module names either."""
    import megarlhf

    root = os.path.dirname(megarlhf.__file__)
    doors = {"engine/schedule.py", "engine/optimizer.py", "engine/checkpoint.py",
             "roles/build.py", "inference/reshard.py"}
    found: dict[str, set[str]] = {"at_megatron": set(), "suspended": set()}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root)
                text = open(path).read()
                for word in found:
                    if f"cpu_backend.{word}(" in text:
                        found[word].add(rel)
    assert found["at_megatron"] == doors
    assert found["suspended"] and all(p.startswith("engine/") for p in found["suspended"])


@pytest.fixture(scope="module")
def backend_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("backend"))
    worker = os.path.join(WORKERS, "backend_paths.py")
    torchrun(worker, 2, out)
    torchrun(worker, 1, out, "dp2", "pp2", "tp2")
    return (torch.load(os.path.join(out, "results_world1.pt"), weights_only=False),
            torch.load(os.path.join(out, "results_world2.pt"), weights_only=False))


def max_logprob_diff(rows_a, rows_b):
    return max(abs(x - y) for a, b in zip(rows_a, rows_b, strict=True)
               for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp2", "pp2", "tp2"])
def test_training_steps_match_single_process(backend_results, case):
    """3 Adam steps (lr 0.01, clip 1.0): DP=2 with the distributed optimizer, PP=2 1F1B,
    TP=2 reproduce the single-process losses and the trained model's log-probs."""
    ref, run = backend_results[0]["ref"], backend_results[1][case]
    for a, b in zip(ref["losses"], run["losses"], strict=True):
        assert abs(a - b) < 1e-5, (case, ref["losses"], run["losses"])
    assert ref["losses"][-1] < ref["losses"][0]  # the steps did train
    assert max_logprob_diff(ref["rows"], run["rows"]) < 5e-5


@pytest.mark.slow
def test_nonfinite_gradients_skip_the_step_on_every_rank(backend_results):
    """A NaN loss on one DP rank only: both ranks skip (weights unchanged, one skipped step
    counted), and the next finite step applies."""
    for applied, unchanged, applied2, changed, skipped in backend_results[1]["nonfinite"]:
        assert (applied, unchanged, applied2, changed, skipped) == (0, 1, 1, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp2", "pp2", "tp2"])
def test_parameters_after_training_match_single_process(backend_results, case):
    """The parallel run's trained weights, reloaded into one process, equal the
    single-process run's (Adam amplifies fp32 reduction-order noise a little)."""
    assert backend_results[0][f"reload_{case}"]["param_diff"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp2", "pp2", "tp2"])
def test_checkpoint_saved_in_parallel_loads_in_one_process(backend_results, case):
    run = backend_results[1][case]
    reloaded = backend_results[0][f"reload_{case}"]
    assert max_logprob_diff(run["rows"], reloaded["rows"]) < 1e-5
    ckpt_dir = os.path.dirname(run["ckpt"])
    assert open(os.path.join(ckpt_dir, "latest")).read() == "step_3"
    assert not [d for d in os.listdir(ckpt_dir) if d.startswith(".tmp")]


@pytest.mark.slow
def test_megatrons_old_plain_optimizer_format_still_loads(backend_results):
    """A checkpoint in megatron's own plain-optimizer format (before megarlhf's one format;
    no ``optimizer_format`` in its meta) resumes a plain optimizer with every main weight,
    Adam moment and step equal; the distributed optimizer refuses it and names the fix."""
    legacy = backend_results[0]["legacy"]
    assert legacy["tensors"] > 0 and legacy["moments_nonzero"]
    assert legacy["max_diff"] == 0.0
    assert legacy["refusal"] is not None
    assert "old format" in legacy["refusal"]
    assert "optimizer.use_distributed_optimizer=false" in legacy["refusal"]


@pytest.mark.slow
def test_a_local_layers_checkpoint_loads_into_modules_with_extra_state(backend_results):
    """TransformerEngine's modules keep fp8 metadata as extra state, which a checkpoint of
    the local layers lacks (the H200 run: "Missing key in checkpoint state_dict:
    ...final_layernorm._extra_state"): the weights load exactly and the module keeps its
    own extra state; a weight the checkpoint lacks is still an error, and names it."""
    got = backend_results[0]["extra_state"]
    assert got["param_diff"] == 0.0
    assert torch.equal(got["set_to"], torch.tensor([7.0]))  # its own, given back
    assert got["refusal"] is not None and "lacks" in got["refusal"]
    assert "q_layernorm" in got["refusal"]


def test_loss_functions_run_without_the_mode():
    """megatron's schedule calls the forward step (and its own code around it) under the
    mode; the loss function the step returns runs without it, with the same result."""
    from megarlhf.engine.schedule import _loss_without_mode

    was_active = cpu_backend.is_active()
    cpu_backend.activate()
    seen = {}

    def forward_step(data_iterator, model):
        seen["step"] = torch.ones(1).type()
        batch = next(data_iterator)

        def loss_func(output, non_loss_data=False):
            seen["loss"] = torch.ones(1).type()
            return (output * batch).sum()

        return model * 2, loss_func

    try:
        with cpu_backend.at_megatron():  # as run_schedule calls megatron's schedule
            output, loss_func = _loss_without_mode(forward_step)(iter([torch.arange(3.0)]),
                                                                  torch.ones(3))
            assert float(loss_func(output)) == 6.0
            assert torch.ones(1).type() == "torch.cuda.FloatTensor"  # the mode is back after
    finally:
        if not was_active:
            cpu_backend.deactivate()
    assert seen == {"step": "torch.cuda.FloatTensor", "loss": "torch.FloatTensor"}


@pytest.mark.slow
def test_split_optimizer_step_equals_megatrons_own_step(backend_results):
    """prepare_step + apply_step (megatron's clip skipped where it would not scale, the
    inner Adam step and prepare_grads run without the mode) leave every weight exactly as
    megatron's ``optimizer.step()`` does: plain and distributed optimizer, clipping at
    1e-3 (every step clips), 1e3 (none does) and off."""
    cases = backend_results[0]["megatron_step"]
    assert len(cases) == 6
    for (distributed, clip), case in cases.items():
        assert case["equal"], (distributed, clip, case)
        for ours, theirs in case["norms"]:
            assert ours == theirs
            assert (ours > clip) if clip == 1e-3 else (clip == 0.0 or ours < clip)
