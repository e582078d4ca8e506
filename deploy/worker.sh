#!/usr/bin/env bash
# A worker machine: a Ray worker node (labelled with its ndif node id) joined to the head's Ray with
# the cluster's auth token, and this node's agent. docs/deploy.md walks through it. Every process
# runs in a session of its own with a pid file under the run directory; `deploy/worker.sh stop` ends them.
#
#   deploy/worker.sh start --address 10.0.0.2 --node-id gpu-b --head 10.0.0.1:6379 \
#       --nats nats://10.0.0.1:4222 --creds /etc/ndif/agent-gpu-b.creds --ray-token /etc/ndif/ray_auth_token \
#       --gpus 8 --gpu-memory-gib 80 [--cpu-cache-gib C] [--pool-size K] [--run-dir DIR]
#   deploy/worker.sh stop [--run-dir DIR]
#
# The files come from the head (deploy/head.sh prints them). Environment: PYTHON, RAY, NDIF_RAY_ARGS as
# for deploy/head.sh.
set -euo pipefail
SCRIPT=deploy/worker.sh
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { help_text "${BASH_SOURCE[0]}"; exit "${1:-0}"; }

cmd=${1:-}; [[ $cmd == -h || $cmd == --help ]] && usage 0
[[ $cmd == start || $cmd == stop ]] || usage 2; shift
ADDRESS= NODE_ID= HEAD= NATS_URL= CREDS= TOKEN= GPUS= GPU_GIB=80 CACHE_GIB= POOL= RUN=${NDIF_HOME:-$HOME/.ndif}/run
while (($#)); do
  case $1 in
    --address) ADDRESS=$2; shift 2 ;;
    --node-id) NODE_ID=$2; shift 2 ;;
    --head) HEAD=$2; shift 2 ;;
    --nats) NATS_URL=$2; shift 2 ;;
    --creds) CREDS=$2; shift 2 ;;
    --ray-token) TOKEN=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --gpu-memory-gib) GPU_GIB=$2; shift 2 ;;
    --cpu-cache-gib) CACHE_GIB=$2; shift 2 ;;
    --pool-size) POOL=$2; shift 2 ;;
    --run-dir) RUN=$2; shift 2 ;;
    -h|--help) usage ;;
    *) die "unknown option $1 (see $SCRIPT --help)" ;;
  esac
done
if [[ $cmd == stop ]]; then stop_all; exit 0; fi

need --address "$ADDRESS"; need --node-id "$NODE_ID"; need --head "$HEAD"; need --nats "$NATS_URL"
need --gpus "$GPUS"
[[ -n $TOKEN ]] || die "no Ray auth token: the head's cluster refuses a node without it (InvalidAuthToken); copy the head's token file (deploy/head.sh prints it) and pass --ray-token FILE"
[[ -s $TOKEN ]] || die "--ray-token $TOKEN: no such file or empty: copy the head's token file here"
[[ -z $CREDS || -r $CREDS ]] || die "--creds $CREDS: not a readable file"
mkdir -p "$RUN"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN RAY_USAGE_STATS_ENABLED=0

# shellcheck disable=SC2086  # NDIF_RAY_ARGS is a list of flags
start ray "$RAY" start --block --address "$HEAD" --node-ip-address "$ADDRESS" --num-gpus 0 \
  --labels "ndif.node_id=$NODE_ID" --disable-usage-stats ${NDIF_RAY_ARGS:-}
if ! wait_line ray "Ray runtime started" 120 "$RAY_REFUSED"; then
  refused=0; ray_refused ray && refused=1
  stop_all >/dev/null
  ((refused)) && { echo "$SCRIPT: the Ray cluster at $HEAD refused the auth token in $TOKEN (InvalidAuthToken): copy the head's token file again" >&2; exit 3; }
  tail -30 "$RUN/ray.log" >&2 || true
  die "the Ray worker did not join $HEAD (log $RUN/ray.log)"
fi

agent=(agent --nats "$NATS_URL" --ray-address "$HEAD" --node-id "$NODE_ID" --gpus "$GPUS" --gpu-memory-gib "$GPU_GIB")
[[ -n $CACHE_GIB ]] && agent+=(--cpu-cache-gib "$CACHE_GIB")
[[ -n $POOL ]] && agent+=(--pool-size "$POOL")
NDIF_CREDS=$CREDS start agent "${NDIF[@]}" "${agent[@]}"
echo "$SCRIPT: worker $NODE_ID up: Ray node on $ADDRESS joined $HEAD, agent on $NATS_URL; pids and logs in $RUN"
echo "  stop it all:   $SCRIPT stop --run-dir $RUN"
