"""Reading the launcher's environment (torchrun, srun, single process)."""

import pytest

from megarlhf.parallel.launch import first_slurm_host, read_dist_env


def test_torchrun_env():
    env = read_dist_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                         "MASTER_ADDR": "n1", "MASTER_PORT": "1234", "SLURM_PROCID": "9"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port,
            env.launcher) == (3, 8, 1, "n1", 1234, "torchrun")


def test_slurm_env():
    env = read_dist_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_JOB_NODELIST": "gpu[003-005,9]", "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (
        5, 16, 1, "gpu003", "slurm")
    assert env.master_port == 20000 + 123456 % 20000


def test_single_process_env():
    env = read_dist_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"), ("node[01-04]", "node01"), ("a[7,9],b1", "a7"), ("x-1,y", "x-1")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_megatron_fusion_kernels_compile_on_first_call_not_at_import():
    """megatron's ``jit_fuser`` is ``torch.compile``, applied as its modules import; with
    speedups.lazy_jit installed first it compiles on a kernel's first call instead, so
    start-up does not import torch's compiler (measured: 5.5 -> 3.5 s per process on
    CPU). Importing megarlhf alone changes nothing."""
    import subprocess
    import sys

    probe = ("import megatron.core.models.gpt, megatron.core.jit as j;"
             "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu;"
             "print('torch._dynamo' in sys.modules, j.jit_fuser.__name__,"
             " bias_swiglu.__name__)")
    for setup, want in (("from megarlhf import speedups; speedups.install('lazy_jit');",
                         ["False", "_compile_on_first_call", "bias_swiglu"]),
                        ("import megarlhf;", ["True", "compile", "bias_swiglu"])):
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", "import sys;" + setup + probe],
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == want, (setup, out)


def test_a_deferred_fusion_kernel_is_torch_compiled_once_on_its_first_call(monkeypatch):
    import torch

    from megarlhf.speedups import lazy_jit

    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda x: fn(x) + 0  # stands for the compiled kernel

    monkeypatch.setattr(torch, "compile", fake_compile)

    def kernel(x):
        return x * 2

    fused = lazy_jit._compile_on_first_call(kernel)
    assert compiled == [] and fused.__name__ == "kernel"
    assert fused(torch.ones(2)).tolist() == [2.0, 2.0] and compiled == [kernel]
    assert fused(torch.ones(2)).tolist() == [2.0, 2.0] and compiled == [kernel]
