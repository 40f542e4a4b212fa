#!/usr/bin/env bash
# Set up the environment if needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
# The Slurm tests need a real Slurm. As root (CI) Debian's packages are installed when
# absent, and a failed install stops the run with apt's own words: the Slurm tests then
# must run (MEGARLHF_REQUIRE_SLURM=1 turns their skip into a failure). Without root they
# are skipped, and say so.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! command -v slurmctld >/dev/null || ! command -v ip >/dev/null; then
        echo "installing slurmctld slurmd slurm-client munge iproute2 for the Slurm tests" \
             "(a two-node cluster of network namespaces: scripts/local_cluster.sh)"
        log=$(mktemp)
        if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                slurmctld slurmd slurm-client munge iproute2) >"$log" 2>&1; then
            tail -n 20 "$log"
            echo "scripts/test.sh: installing Slurm failed (above); the Slurm tests need it" >&2
            exit 1
        fi
        rm -f "$log"
    fi
    export MEGARLHF_REQUIRE_SLURM=1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two pytest workers, one test file each at a time (a file's module fixtures run once):
# most tests wait on one single-threaded subprocess, so two keep both cores busy.
# MEGARLHF_TEST_WORKERS=0 runs everything in this process (pdb, -x, one test).
.venv/bin/python -m pytest -q -rs --durations=25 -n "${MEGARLHF_TEST_WORKERS:-2}" --dist loadfile "$@"
# The whole suite (no arguments) also runs the mutants: planted bugs its tests must catch.
if [ "$#" = 0 ]; then
    .venv/bin/python tests/mutants.py
fi
