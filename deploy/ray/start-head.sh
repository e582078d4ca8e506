#!/usr/bin/env bash
# Head node: Ray head, the controller, and this node's agent.
#   NDIF_NATS_URL=nats://ndif-n1:4222,nats://ndif-n2:4222 deploy/ray/start-head.sh
set -euo pipefail
: "${NDIF_NATS_URL:?set NDIF_NATS_URL to the NATS cluster}"
ray start --head --port 6379 ${NDIF_RAY_ARGS:-}
ndif controller --nats "$NDIF_NATS_URL" &
exec ndif agent --nats "$NDIF_NATS_URL" --ray-address auto
