# Sourced by .ci/run and the torch legs. pip_install ARGS...: `pip install --quiet ARGS`, resuming an
# interrupted download (the legs' CUDA builds of torch are 0.8-2.5 GB from the registry, and a dropped
# connection there failed a whole run once) and trying the whole install twice more before it gives up.
pip_install() {
    local resume=() attempt
    if python -m pip install --help 2>/dev/null | grep -q -- "--resume-retries"; then
        resume=(--resume-retries 20)
    fi
    for attempt in 1 2 3; do
        python -m pip install --quiet "${resume[@]}" "$@" && return 0
        echo "pip install $*: attempt $attempt of 3 failed" >&2
        [[ $attempt -lt 3 ]] && sleep $((attempt * 15))
    done
    return 1
}
