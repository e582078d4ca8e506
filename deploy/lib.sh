# Shared by deploy/head.sh and deploy/worker.sh (sourced, not run): starting each process in a session
# of its own with its pid file under the run directory, waiting for it, and the one documented stop.
# shellcheck shell=bash

PYTHON=${PYTHON:-python3}
NDIF=("$PYTHON" -m dataplane.ops.cli)
# `ray` next to the Python that runs ndif (a virtualenv's), else the one on PATH.
if [[ -z ${RAY:-} ]]; then
  RAY=$(dirname "$(command -v "$PYTHON")")/ray
  [[ -x $RAY ]] || RAY=ray
fi

# The agent drains a node's replicas itself before its Ray stops: Ray's own drain on SIGTERM (for Ray
# Serve's proxies; 30 s by default) would only hold each `stop` that long.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

die() { echo "$SCRIPT: $*" >&2; exit 2; }

# help_text FILE: the script's opening comment (after the #! line, up to its first line of code).
help_text() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$1"; }

# fail MESSAGE: a start that went wrong half way: stop what this run started, then die.
fail() { stop_all >/dev/null 2>&1 || true; die "$@"; }

need() {  # need NAME VALUE: a required option
  [[ -n $2 ]] || die "missing $1 (see $SCRIPT --help)"
}

# start NAME CMD...: run CMD in a new session (its own process group, so a stop ends it and all it
# started), output to RUN/NAME.log, its pid (= its process group) in RUN/NAME.pid.
start() {
  local name=$1; shift
  [[ -e $RUN/$name.pid ]] && kill -0 "$(cat "$RUN/$name.pid")" 2>/dev/null \
    && die "$name already runs (pid $(cat "$RUN/$name.pid"), $RUN/$name.pid): stop it first"
  setsid "$@" >"$RUN/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
}

# wait_line NAME TEXT SECONDS [FAILED]: until RUN/NAME.log holds TEXT; non-zero if the process ended,
# the time ran out, or the log matched the extended regex FAILED (a refusal the process would retry).
wait_line() {
  local name=$1 text=$2 deadline=$((SECONDS + $3)) failed=${4:-} pid
  pid=$(cat "$RUN/$name.pid")
  until grep -q -- "$text" "$RUN/$name.log" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null || ((SECONDS > deadline)); then
      return 1
    fi
    if [[ -n $failed ]] && grep -qE -- "$failed" "$RUN/$name.log" 2>/dev/null; then
      return 1
    fi
    sleep 0.3
  done
}

# ray_refused NAME: did Ray refuse the auth token (its own words: InvalidAuthToken)? RAY_REFUSED, Ray's
# error names alone, also ends a start's wait at once (Ray would retry for about 20 s first).
RAY_REFUSED="InvalidAuthToken|AuthenticationError"
ray_refused() {
  grep -qE "$RAY_REFUSED|Unauthenticated|auth(entication)? token" "$RUN/$1.log" 2>/dev/null
}

# stop_all: SIGTERM the leader of every process group of RUN/*.pid (newest first), wait up to NDIF_STOP_WAIT_S
# (default 30) for each, then SIGKILL what is left of its group; the pid files go.
stop_all() {
  local f pid waited stopped=0
  [[ -d $RUN ]] || die "no run directory $RUN"
  for f in $(ls -t "$RUN"/*.pid 2>/dev/null); do
    stopped=$((stopped + 1))
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true  # the leader stops what it started (`ray start --block` its node)
      waited=0
      while kill -0 "$pid" 2>/dev/null && ((waited < ${NDIF_STOP_WAIT_S:-30} * 10)); do
        sleep 0.1; waited=$((waited + 1))
      done
    fi
    kill -KILL -- "-$pid" 2>/dev/null || true  # what is left of that group (its own group only)
    echo "$SCRIPT: stopped $(basename "$f" .pid) (process group $pid)"
    rm -f "$f"
  done
  ((stopped)) || echo "$SCRIPT: nothing to stop (no process group recorded in $RUN)"
}

# forget_ray_cluster FILE: `ray start --head --block` leaves Ray's cluster file (`ray_current_cluster`
# in Ray's temp dir: RAY_TMPDIR, else TMPDIR, else /tmp, then ray/) behind when stopped by a signal,
# and a later `ray` or `ndif up` on this machine would take it for a running cluster. Removed when
# it names the address in FILE (this head's), never another cluster's.
forget_ray_cluster() {
  local mine cluster=${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster
  [[ -r $1 ]] || return 0
  mine=$(cat "$1")
  if [[ -f $cluster && $(head -n 1 "$cluster") == "$mine" ]]; then
    rm -f "$cluster" && echo "$SCRIPT: removed Ray's cluster file $cluster (it named this head, $mine)"
  fi
  rm -f "$1"
}
