#!/usr/bin/env bash
# Set up, then run the whole test suite (PostgreSQL-free so far; uses the real SmolLM2 for the slow tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
