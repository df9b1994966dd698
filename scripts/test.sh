#!/usr/bin/env bash
# Set up, then run the whole test suite: the slow tests train the real SmolLM2, the store tests also run on
# PostgreSQL at 127.0.0.1:5432 (database `test`; AGL_TEST_POSTGRES=postgresql://... for another one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
