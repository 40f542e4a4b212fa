#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
# The Slurm tests need a real Slurm; as root, install Debian's packages when absent.
if ! command -v slurmctld >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing slurmctld slurmd slurm-client munge for the Slurm tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        slurmctld slurmd slurm-client munge) >/dev/null 2>&1 || echo "Slurm install failed; its tests will be skipped"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two pytest workers, one test file each at a time (a file's module fixtures run once):
# most tests wait on one single-threaded subprocess, so two keep both cores busy.
# MEGARLHF_TEST_WORKERS=0 runs everything in this process (pdb, -x, one test).
exec .venv/bin/python -m pytest -q -rs -n "${MEGARLHF_TEST_WORKERS:-2}" --dist loadfile "$@"
