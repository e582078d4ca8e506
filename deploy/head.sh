#!/usr/bin/env bash
# The head machine: Ray head, a NATS server (single, or one server of a cluster config), the
# controller, the dispatcher, and (with --gpus) this machine's own node agent. docs/deploy.md walks
# through it. Every process runs in a session of its own with a pid file under the run directory;
# `deploy/head.sh stop` ends them all.
#
#   deploy/head.sh start --address 10.0.0.1 --node-id gpu-a --inventory /etc/ndif/inventory.json \
#       [--home /etc/ndif] [--run-dir DIR] [--ray-port 6379] [--ray-token FILE] [--nats-port 4222]
#       [--nats-config deploy/nats/n1.conf --nats nats://n1:4222,nats://n2:4222,nats://n3:4222]
#       [--client NAME]... [--gpus N --gpu-memory-gib G [--cpu-cache-gib C] [--pool-size K]]
#   deploy/head.sh stop [--home DIR | --run-dir DIR]
#
# Environment: PYTHON (the Python with ndif installed; default python3), RAY (default: the `ray` next to
# it), NDIF_RAY_ARGS (more `ray start` flags, e.g. --num-cpus 8), NDIF_STREAM_REPLICAS=3 on a NATS cluster.
set -euo pipefail
SCRIPT=deploy/head.sh
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { help_text "${BASH_SOURCE[0]}"; exit "${1:-0}"; }

cmd=${1:-}; [[ $cmd == -h || $cmd == --help ]] && usage 0
[[ $cmd == start || $cmd == stop ]] || usage 2; shift
ADDRESS= NODE_ID= INVENTORY= HOME_DIR=${NDIF_HOME:-$HOME/.ndif} RUN= RAY_PORT=6379 TOKEN= NATS_PORT=4222
NATS_CONFIG= NATS_URL= GPUS= GPU_GIB=80 CACHE_GIB= POOL= CLIENTS=()
while (($#)); do
  case $1 in
    --address) ADDRESS=$2; shift 2 ;;
    --node-id) NODE_ID=$2; shift 2 ;;
    --inventory) INVENTORY=$2; shift 2 ;;
    --home) HOME_DIR=$2; shift 2 ;;
    --run-dir) RUN=$2; shift 2 ;;
    --ray-port) RAY_PORT=$2; shift 2 ;;
    --ray-token) TOKEN=$2; shift 2 ;;
    --nats-port) NATS_PORT=$2; shift 2 ;;
    --nats-config) NATS_CONFIG=$2; shift 2 ;;
    --nats) NATS_URL=$2; shift 2 ;;
    --client) CLIENTS+=("$2"); shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --gpu-memory-gib) GPU_GIB=$2; shift 2 ;;
    --cpu-cache-gib) CACHE_GIB=$2; shift 2 ;;
    --pool-size) POOL=$2; shift 2 ;;
    -h|--help) usage ;;
    *) die "unknown option $1 (see $SCRIPT --help)" ;;
  esac
done
RUN=${RUN:-$HOME_DIR/run}
if [[ $cmd == stop ]]; then stop_all; forget_ray_cluster "$RUN/ray.address"; exit 0; fi

need --address "$ADDRESS"; need --node-id "$NODE_ID"; need --inventory "$INVENTORY"
[[ -r $INVENTORY ]] || die "--inventory $INVENTORY: not a readable file"
mkdir -p "$RUN" "$HOME_DIR"; chmod 700 "$HOME_DIR"
AUTH=$HOME_DIR/auth
TOKEN=${TOKEN:-$AUTH/ray_auth_token}
NATS_URL=${NATS_URL:-nats://$ADDRESS:$NATS_PORT}

# The inventory's nodes (checked as the controller reads it) and a NATS user per role and node.
nodes=$("$PYTHON" -c '
import sys
from schemas.inventory import decode_inventory
print("\n".join(decode_inventory(open(sys.argv[1], "rb").read()).nodes))' "$INVENTORY" 2>/dev/null) \
  || die "--inventory $INVENTORY: not an inventory (schemas/inventory.py has its format)"
mapfile -t NODES <<<"$nodes"
node_args=(); for n in "${NODES[@]}"; do node_args+=(--node "$n"); done
client_args=(); for c in "${CLIENTS[@]}"; do client_args+=(--client "$c"); done
"$PYTHON" -m controlplane.ops.auth --home "$HOME_DIR" "${node_args[@]}" "${client_args[@]}" >/dev/null
creds() { "$PYTHON" -c 'import sys; from pathlib import Path; from controlplane.store.credentials import creds_file
print(creds_file(sys.argv[1], node_id=sys.argv[2], home=Path(sys.argv[3])))' "$1" "${2:-}" "$HOME_DIR"; }

# The Ray cluster's auth token: read, or made once (0600); a worker and every Ray client need it.
if [[ ! -s $TOKEN ]]; then
  [[ -e $TOKEN ]] && die "--ray-token $TOKEN is empty"
  (umask 077; mkdir -p "$(dirname "$TOKEN")"; "$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN")
fi
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN RAY_USAGE_STATS_ENABLED=0

# NATS: one server of the operator's cluster config (it includes ./ndif-auth.conf), else a single
# JetStream server on ADDRESS:NATS_PORT with the users.
if [[ -n $NATS_CONFIG ]]; then
  install -m 600 "$AUTH/nats-auth.conf" "$(dirname "$NATS_CONFIG")/ndif-auth.conf"
  start nats "$("$PYTHON" -c 'from controlplane.ops.nats_server import find_nats_server; print(find_nats_server())')" \
    -c "$NATS_CONFIG"
else
  (umask 077; { echo "max_payload: 2097152"; cat "$AUTH/nats-auth.conf"; } >"$RUN/nats.conf")
  start nats "$("$PYTHON" -c 'from controlplane.ops.nats_server import find_nats_server; print(find_nats_server())')" \
    -c "$RUN/nats.conf" -js -sd "$HOME_DIR/nats" -a "$ADDRESS" -p "$NATS_PORT" -n "ndif-$NODE_ID"
fi
wait_line nats "Server is ready" 30 || { tail -20 "$RUN/nats.log" >&2; fail "nats-server did not start (log $RUN/nats.log)"; }
# The streams and buckets, made by the admin (the services only check that they exist); on a NATS
# cluster every server must be up first.
NDIF_CREDS=$(creds admin) "${NDIF[@]}" init --nats "$NATS_URL" --timeout 60 >/dev/null \
  || fail "could not create the streams on $NATS_URL (\`ndif init\` above says why)"

# shellcheck disable=SC2086  # NDIF_RAY_ARGS is a list of flags
start ray "$RAY" start --head --block --port "$RAY_PORT" --node-ip-address "$ADDRESS" --num-gpus 0 \
  --labels "ndif.node_id=$NODE_ID" --include-dashboard false --disable-usage-stats ${NDIF_RAY_ARGS:-}
wait_line ray "Ray runtime started" 120 || { tail -30 "$RUN/ray.log" >&2; fail "the Ray head did not start (log $RUN/ray.log)"; }
RAY_ADDRESS=$ADDRESS:$RAY_PORT
echo "$RAY_ADDRESS" >"$RUN/ray.address"  # `stop` removes Ray's cluster file only when it names this head

NDIF_CREDS=$(creds controller) start controller "${NDIF[@]}" controller --nats "$NATS_URL" --inventory "$INVENTORY"
NDIF_CREDS=$(creds dispatcher) start dispatcher "${NDIF[@]}" dispatcher --nats "$NATS_URL" --ray-address "$RAY_ADDRESS"
if [[ -n $GPUS ]]; then
  agent=(agent --nats "$NATS_URL" --ray-address "$RAY_ADDRESS" --node-id "$NODE_ID" --gpus "$GPUS"
         --gpu-memory-gib "$GPU_GIB")
  [[ -n $CACHE_GIB ]] && agent+=(--cpu-cache-gib "$CACHE_GIB")
  [[ -n $POOL ]] && agent+=(--pool-size "$POOL")
  NDIF_CREDS=$(creds agent "$NODE_ID") start agent "${NDIF[@]}" "${agent[@]}"
fi

echo "$SCRIPT: head $NODE_ID up: Ray $RAY_ADDRESS, NATS $NATS_URL; pids and logs in $RUN"
echo "  stop it all:   $SCRIPT stop --run-dir $RUN"
echo "  admin:         NDIF_NATS_URL=$NATS_URL NDIF_CREDS=$(creds admin) ndif status"
echo "Copy to each worker (private: 0600, over ssh/scp): the Ray token $TOKEN and that node's NATS"
echo "credentials, then run there:"
for n in "${NODES[@]}"; do
  [[ $n == "$NODE_ID" ]] && continue
  echo "  $n: $(creds agent "$n")"
  echo "    deploy/worker.sh start --address <its address> --node-id $n --head $RAY_ADDRESS --nats $NATS_URL \\"
  echo "      --creds <copied $(basename "$(creds agent "$n")")> --ray-token <copied $(basename "$TOKEN")> --gpus N --gpu-memory-gib G"
done
