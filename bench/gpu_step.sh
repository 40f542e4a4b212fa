# Sourced by bench/gpu_checks.sh and bench/gpu_session.sh (run on the device machine).
# step NAME SECONDS COMMAND...: the command under its own time limit, its output kept in
# $OUT/NAME.txt as it goes (so a cut session still leaves it), the tail shown without
# warnings, and the exit status and seconds appended.
step() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (limit ${limit} s): $*"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    grep -v "warn" "$OUT/$name.txt" | tail -n 30
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/$name.txt"
}
