# Sourced by the benchmark scripts: turns on the kernel's FUSE over io_uring (the fuse module
# parameter enable_uring) for a run that asks for it, and puts the parameter back afterwards.
#   uring_param_on        remember the current value and turn it on
#   uring_param_restore   put the remembered value back (call from the script's cleanup)
URING_PARAM=/sys/module/fuse/parameters/enable_uring
URING_BEFORE=
uring_param_on() {
    if [ ! -w "$URING_PARAM" ]; then
        echo "$URING_PARAM is missing: FUSE over io_uring needs Linux >= 6.14" >&2
        exit 1
    fi
    URING_BEFORE=$(cat "$URING_PARAM")
    echo Y >"$URING_PARAM"
}
uring_param_restore() {
    if [ -n "$URING_BEFORE" ]; then echo "$URING_BEFORE" >"$URING_PARAM"; fi
}
