#!/usr/bin/env bash
# Set up the environment if needed, then run the tests.
#
#   bash scripts/test.sh           the fast tier: every test not marked extended, then the
#                                  fast subset of the mutants (CI runs this; under 15 min)
#   bash scripts/test.sh --all     the extended tier too: soaks, the two-node Slurm cluster,
#                                  repeated layouts, and every mutant
#   bash scripts/test.sh ARGS...   pytest with ARGS (a file, -k, -m ...), no mutants
#
# tests/README.md lists each capability with its fast test and its extended tests.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=fast
if [ "${1:-}" = "--all" ]; then
    tier=all
    shift
fi
bash scripts/setup_env.sh test
# The Slurm tests need a real Slurm. As root (CI) Debian's packages are installed when
# absent, and a failed install stops the run with apt's own words: the Slurm tests then
# must run (MEGARLHF_REQUIRE_SLURM=1 turns their skip into a failure). Without root they
# are skipped, and say so. The fast tier runs only the dry-run, which needs none of it.
if [ "$tier" = all ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
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
pytest=(.venv/bin/python -m pytest -q -rs --durations=15 -n "${MEGARLHF_TEST_WORKERS:-2}"
        --dist loadfile)
if [ "$#" != 0 ]; then
    exec "${pytest[@]}" "$@"
fi
# Each test's outcome, for the mutants: the killing tests that passed here are not run
# again on the unmutated copy.
export MEGARLHF_OUTCOMES
MEGARLHF_OUTCOMES=$(mktemp --suffix=.json)
trap 'rm -f "$MEGARLHF_OUTCOMES"' EXIT
start=$SECONDS
if [ "$tier" = all ]; then
    "${pytest[@]}"
    pytest_s=$((SECONDS - start))
    .venv/bin/python tests/mutants.py --passed "$MEGARLHF_OUTCOMES"
else
    "${pytest[@]}" -m "not extended"
    pytest_s=$((SECONDS - start))
    .venv/bin/python tests/mutants.py --fast --passed "$MEGARLHF_OUTCOMES"
fi
echo "scripts/test.sh: the $tier tier took $((SECONDS - start)) s (pytest $pytest_s s, mutants" \
     "$((SECONDS - start - pytest_s)) s)"
