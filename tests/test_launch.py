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
