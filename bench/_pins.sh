# Sourced by bench/setup_*_env.sh and bench/gpu_pack.sh, with `root` set to the repository root.
#
# `agl_interpreter [PYTHON]` sets `agl_python` to PYTHON or, when empty, to .venv/bin/python (as
# scripts/setup.sh makes it); it exits 2 when that is not an executable.
agl_interpreter() {
    agl_python="${1:-$root/.venv/bin/python}"
    if [[ ! -x "$agl_python" ]]; then
        echo "agl's interpreter $agl_python not found; run scripts/setup.sh or pass agl's python as the argument" >&2
        exit 2
    fi
}

# `pins_of PYTHON DIST...` fills the array `pins` with DIST==VERSION for
# each distribution as agl's interpreter PYTHON has it (a local version suffix such as +cpu dropped), so a
# peer's environment runs the same library code; it exits 2 naming the first one PYTHON lacks.
pins_of() {
    local python="$1" dist version
    shift
    pins=()
    for dist in "$@"; do
        version="$("$python" -c "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null || true)"
        if [[ -z "$version" ]]; then
            echo "$python has no $dist installed; pass agl's interpreter (with the trainer extra) as the argument" >&2
            exit 2
        fi
        pins+=("$dist==${version%%+*}")
    done
}
