#!/usr/bin/env bash
# Set up, then run the checks and the whole test suite: ruff (format and lint), mypy (strict on src/ and
# trainer/), then pytest. The slow tests train the real SmolLM2; the store tests also run on PostgreSQL at
# 127.0.0.1:5432 (database `test`; AGL_TEST_POSTGRES=postgresql://... for another one).
# pytest runs the tests in parallel, one worker per core (AGL_TEST_WORKERS=N for another count), then the
# tests marked `timing` (they assert a wall-clock bound) alone.
# With arguments, only pytest runs, with them (e.g. bash scripts/test.sh tests/test_store.py -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
failed=()
echo "== ruff format --check"; .venv/bin/ruff format --check . || failed+=("ruff format")
echo "== ruff check"; .venv/bin/ruff check . || failed+=("ruff check")
echo "== mypy"; .venv/bin/mypy || failed+=("mypy")
echo "== pytest"
status=0
.venv/bin/python -m pytest -n "${AGL_TEST_WORKERS:-auto}" --dist worksteal -m "not timing" || status=$?
echo "== pytest, the timing-bound tests alone"
.venv/bin/python -m pytest -p no:xdist -m timing || status=$?
if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed checks: ${failed[*]}" >&2
  [ "$status" -ne 0 ] || status=1
fi
exit "$status"
