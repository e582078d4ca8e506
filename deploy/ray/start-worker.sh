#!/usr/bin/env bash
# Worker node: join the Ray cluster and run this node's agent (one agent per Ray node).
#   NDIF_NATS_URL=... RAY_HEAD=head-host:6379 deploy/ray/start-worker.sh
set -euo pipefail
: "${NDIF_NATS_URL:?set NDIF_NATS_URL to the NATS cluster}"
: "${RAY_HEAD:?set RAY_HEAD to the head's host:6379}"
ray start --address "$RAY_HEAD" ${NDIF_RAY_ARGS:-}
exec ndif agent --nats "$NDIF_NATS_URL" --ray-address auto
