# Background jobs for the test scripts (sourced, not run): a command runs with its output in a log file, and the
# log is printed whole, with the job's exit status and time, when the job is collected, so that suites running at
# the same time never interleave their output.
#   source scripts/jobs.sh
#   job_start NAME CMD...   # CMD in the background, stdout and stderr to $JOB_DIR/NAME.log
#   JOB_NICE=N job_start ...  # the same at a lower CPU priority (nice N): it yields the cores to the critical path
#   job_finish NAME         # waits for it, prints its log; returns its exit status
#   job_last_line NAME      # the last non-empty line of its log (pytest's closing line, for a summary)
# On exit (an interrupt included) the jobs not collected yet are stopped, with their child processes, and the logs
# are removed.

JOB_DIR=${JOB_DIR:-$(mktemp -d -t pf-trl-jobs.XXXXXX)}
declare -A JOB_PID=()

job_start() {
  local name=$1
  shift
  (
    [[ -n "${JOB_NICE:-}" ]] && renice -n "$JOB_NICE" -p "$BASHPID" > /dev/null 2>&1
    start=$(date +%s)
    rc=0
    "$@" || rc=$?
    echo "$rc $(( $(date +%s) - start ))" > "$JOB_DIR/$name.done"
    exit "$rc"
  ) > "$JOB_DIR/$name.log" 2>&1 < /dev/null &
  JOB_PID[$name]=$!
}

job_finish() {
  local name=$1 rc=0 seconds="?"
  wait "${JOB_PID[$name]}" || rc=$?
  unset "JOB_PID[$name]"
  [[ -f "$JOB_DIR/$name.done" ]] && read -r _ seconds < "$JOB_DIR/$name.done"
  echo "---------------- $name: exit $rc after ${seconds} s (ran in the background; its output follows)"
  cat "$JOB_DIR/$name.log"
  return "$rc"
}

job_last_line() {
  grep -v '^[[:space:]]*$' "$JOB_DIR/$1.log" 2>/dev/null | tail -n 1
}

_job_kill_tree() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    _job_kill_tree "$child"
  done
  kill "$1" 2>/dev/null
}

_job_cleanup() {
  local pid
  for pid in "${JOB_PID[@]}"; do
    _job_kill_tree "$pid"
  done
  rm -rf "$JOB_DIR"
}
trap _job_cleanup EXIT
trap 'exit 130' INT TERM
