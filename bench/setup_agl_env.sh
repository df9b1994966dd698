#!/usr/bin/env bash
# Creates .venv-agl at the repository root: Microsoft Agent Lightning 0.3.0 (the peer in
# bench/store_ingest.py) in an environment of its own, so agl's environment never gets it or its
# dependencies. Its store server needs no torch: agentlightning 0.3.0 declares none outside its `verl`
# extra, and this installs no extra (a dry run resolves about 150 packages, litellm[proxy] and agentops
# the largest). The libraries both stores' OTLP path runs on (protobuf, the OpenTelemetry protos and SDK,
# starlette, uvicorn, h11, pydantic) are pinned to the versions agl's environment has, so the two sides
# decode and serve with the same code.
#
#   bash bench/setup_agl_env.sh [PYTHON]
#
# PYTHON: agl's interpreter (default: .venv/bin/python, as scripts/setup.sh makes it).
# AGL_PEER_VERSION overrides the Agent Lightning pin.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/_pins.sh
source "$root/bench/_pins.sh"
agl_interpreter "${1:-}"
peer_version="${AGL_PEER_VERSION:-0.3.0}"

# The versions agl's environment runs, so that the peer's OTLP decode and HTTP serving are the same code.
pins_of "$agl_python" protobuf googleapis-common-protos opentelemetry-proto opentelemetry-api opentelemetry-sdk \
    opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-grpc \
    opentelemetry-exporter-otlp-proto-common opentelemetry-semantic-conventions \
    starlette uvicorn h11 pydantic pydantic-core grpcio

python3 -m venv "$root/.venv-agl"
"$root/.venv-agl/bin/pip" install --quiet "${pins[@]}" "agentlightning==$peer_version"
# Importing the store server imports the whole package (litellm, agentops, ...): this checks it loads.
"$root/.venv-agl/bin/python" -c "import agentlightning, google.protobuf, uvicorn; from agentlightning.store.client_server import LightningStoreServer; print('agentlightning', agentlightning.__version__, '| protobuf', google.protobuf.__version__, '| uvicorn', uvicorn.__version__)"
