#!/usr/bin/env bash
# The main job: set up, then train the AutoGen calculator agent on CPU with SmolLM2-135M + LoRA,
# with the embedded SQLite store. Extra arguments go to `agl train` (e.g. --set train.steps=2, or
# --resume to continue an interrupted run); without --resume a previous run in the output folder is
# replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
case " $* " in
  *" --resume "*) again=() ;;
  *) again=(--overwrite) ;;
esac
exec .venv/bin/agl train examples/calc_autogen/config.yaml "${again[@]}" "$@"
