#!/usr/bin/env bash
# Creates .venv-trl at the repository root: TRL (the comparison in bench/train_step.py) in an environment
# of its own, so agl's environment never gets TRL or its dependencies. torch is pinned by the constraints
# file (a bare torch resolves to the CUDA build); transformers, peft and accelerate are pinned to the
# versions agl's environment has, so both sides of the benchmark run the same model code.
#
#   bash bench/setup_trl_env.sh [PYTHON]
#
# PYTHON: agl's interpreter (default: .venv/bin/python, as scripts/setup.sh makes it). The constraints file
# is the one scripts/setup.sh writes beside it (AGL_CONSTRAINTS overrides); TRL_VERSION overrides the TRL pin.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/_pins.sh
source "$root/bench/_pins.sh"
agl_interpreter "${1:-}"
constraints="${AGL_CONSTRAINTS:-$(dirname "$agl_python")/../agl-constraints.txt}"
trl_version="${TRL_VERSION:-1.16.0}"

if [[ ! -f "$constraints" ]]; then
    echo "constraints file $constraints not found; set AGL_CONSTRAINTS to a file that pins torch (torch==2.13.0)" >&2
    exit 2
fi

# The versions agl's environment runs, so that TRL's side loads and trains the same code.
pins_of "$agl_python" torch transformers peft accelerate safetensors tokenizers

python3 -m venv "$root/.venv-trl"
"$root/.venv-trl/bin/pip" install --quiet -c "$constraints" "${pins[@]}" "trl==$trl_version"
"$root/.venv-trl/bin/python" -c "import torch, transformers, peft, trl; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| trl', trl.__version__)"
