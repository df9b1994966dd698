# Sourced by bench/setup_*_env.sh. `pins_of PYTHON DIST...` fills the array `pins` with DIST==VERSION for
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
