#!/usr/bin/env bash
# The project's one test command.
#
# Installs the local emulators (kinesalite for Kinesis, dynalite for DynamoDB) into
# .cache/emulators with `npm ci` from scripts/emulators/package-lock.json (every
# transitive version pinned; re-installed when that lockfile changes), starts them on free
# loopback ports, points the AWS SDK at them and runs the whole workspace's tests, then the
# doc tests. The emulators are stopped on exit, whatever happens; their logs
# (.cache/emulators/NAME.PID.log) are deleted after a passing run and kept, with their
# paths printed, after a failing one. kinesis-local (kinesis-mock) also runs, for the
# enhanced fan-out tests only (kinesalite has no SubscribeToShard): its endpoint is
# SHARDFLOW_FANOUT_KINESIS_ENDPOINT.
#
# awslabs' aws-kinesis-agg (Python, PyPI), an independent KPL aggregation reader and
# writer for tests/kpl_interop.rs, is installed into .cache/kpl-venv from
# scripts/kpl-requirements.txt (every version pinned; re-installed when it changes);
# SHARDFLOW_KPL_PYTHON names its interpreter.
#
# moto's server (PyPI `moto[server]`), the emulator of DynamoDB with DynamoDB Streams
# (dynalite has no streams), is installed into .cache/moto-venv from
# scripts/moto-requirements.txt (every version pinned; re-installed when it changes) and
# started too: its endpoint is SHARDFLOW_TABLE_STREAMS_ENDPOINT, and SHARDFLOW_GLUE_ENDPOINT
# for the Glue Schema Registry calls it serves as well.
#
#   scripts/test.sh                      # everything: all targets, then doc tests
#   scripts/test.sh some_test_name       # extra args go to the first `cargo test`
#   scripts/test.sh --test backend_aws   # a target selection (--lib, --test, --bin,
#                                        # --example, --bench, --doc) replaces
#                                        # --all-targets, and the doc-test pass is skipped
#
# `cargo test` runs with --no-fail-fast, so one run reports every failing test binary.
# The benches (harness = false) run there as quick smoke runs; `cargo bench` measures.
#
# Needs only a Rust toolchain, node 20+ with npm, and python3.
set -euo pipefail

STARTUP_TIMEOUT_S=60

started_at=$(date +%s)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
emulators="$repo/.cache/emulators"
# package.json pins kinesalite 3.3.3, dynalite 4.0.0 and kinesis-local 0.6.2 exactly; the
# lockfile pins (with integrity hashes) everything they pull in.
manifest="$repo/scripts/emulators"
mkdir -p "$emulators"

log() { printf 'test.sh: %s\n' "$*" >&2; }

manifest_hash() { # of the committed manifest + lockfile
    cat "$manifest/package.json" "$manifest/package-lock.json" | sha256sum | cut -d' ' -f1
}

installed() { # the emulators in .cache/emulators are those of the committed lockfile
    [[ -f "$emulators/.installed-lock-hash" && -d "$emulators/node_modules" &&
       "$(cat "$emulators/.installed-lock-hash")" == "$(manifest_hash)" ]]
}

install_emulators() {
    log "installing the emulators from scripts/emulators/package-lock.json into .cache/emulators (npm ci)"
    rm -f "$emulators/.installed-lock-hash"
    # npm ci installs exactly what the lockfile says (it replaces node_modules), and needs
    # both files in its prefix.
    cp "$manifest/package.json" "$manifest/package-lock.json" "$emulators/"
    npm ci --no-audit --no-fund --loglevel=error --prefix "$emulators" >&2
    manifest_hash >"$emulators/.installed-lock-hash"
}

# Several test runs of this checkout may overlap. Each holds a shared lock for as long as
# its emulators run; an install (npm ci deletes node_modules first) takes it exclusively,
# so it waits for the runs using the old install to end. Without flock: no locking.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$emulators/.install.lock"
    flock -s 9
    if ! installed; then
        # Converting releases the shared lock first, so two upgrading runs cannot deadlock.
        if ! flock -x -n 9; then
            log "waiting for other test runs of this checkout to end before installing the emulators"
            flock -x 9
        fi
        installed || install_emulators
        flock -s 9
    fi
elif ! installed; then
    install_emulators
fi

kpl_venv="$repo/.cache/kpl-venv"
kpl_requirements="$repo/scripts/kpl-requirements.txt"
kpl_installed() { # the venv holds what the committed requirements pin
    [[ -x "$kpl_venv/bin/python" && -f "$kpl_venv/.installed-requirements-hash" &&
       "$(cat "$kpl_venv/.installed-requirements-hash")" == "$(sha256sum <"$kpl_requirements" | cut -d' ' -f1)" ]]
}
install_kpl() {
    log "installing aws-kinesis-agg and kcl-rs from scripts/kpl-requirements.txt into .cache/kpl-venv"
    python3 -m venv --clear "$kpl_venv" >&2
    "$kpl_venv/bin/pip" install --quiet --disable-pip-version-check -r "$kpl_requirements" >&2
    sha256sum <"$kpl_requirements" | cut -d' ' -f1 >"$kpl_venv/.installed-requirements-hash"
}
# One install at a time; a run that finds the venv current does not wait.
if ! kpl_installed; then
    if command -v flock >/dev/null 2>&1; then
        (
            flock -x 8
            kpl_installed || install_kpl
        ) 8>"$repo/.cache/kpl-venv.lock"
    else
        install_kpl
    fi
fi

moto_venv="$repo/.cache/moto-venv"
moto_requirements="$repo/scripts/moto-requirements.txt"
moto_installed() { # the venv holds what the committed requirements pin
    [[ -x "$moto_venv/bin/moto_server" && -f "$moto_venv/.installed-requirements-hash" &&
       "$(cat "$moto_venv/.installed-requirements-hash")" == "$(sha256sum <"$moto_requirements" | cut -d' ' -f1)" ]]
}
install_moto() {
    log "installing moto's server from scripts/moto-requirements.txt into .cache/moto-venv"
    python3 -m venv --clear "$moto_venv" >&2
    "$moto_venv/bin/pip" install --quiet --disable-pip-version-check -r "$moto_requirements" >&2
    sha256sum <"$moto_requirements" | cut -d' ' -f1 >"$moto_venv/.installed-requirements-hash"
}
if ! moto_installed; then
    if command -v flock >/dev/null 2>&1; then
        (
            flock -x 8
            moto_installed || install_moto
        ) 8>"$repo/.cache/moto-venv.lock"
    else
        install_moto
    fi
fi

free_port() { # a port the kernel just handed out on 127.0.0.1
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

answers_http() { # url -> success once anything answers HTTP there (any status code)
    python3 - "$1" <<'PY'
import sys, urllib.request, urllib.error
try:
    # No proxy: the emulators are on loopback.
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(sys.argv[1], timeout=1)
except urllib.error.HTTPError:
    pass                      # an HTTP error status is still an HTTP answer
except Exception:
    sys.exit(1)
PY
}

pids=()
logs=()
keep_logs=0
cleanup() {
    local status=$?
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    # A failed run (a test, or an emulator that would not start) keeps the emulators'
    # logs: what they said is often the first clue to a failing emulator test.
    if (( status != 0 )); then
        keep_logs=1
    fi
    if (( keep_logs == 0 )); then
        rm -f "${logs[@]}"
    elif (( ${#logs[@]} > 0 )); then
        log "emulator logs kept:"
        for logfile in "${logs[@]}"; do
            if [[ -f "$logfile" ]]; then log "  $logfile"; fi
        done
    fi
    log "finished in $(( $(date +%s) - started_at )) s (exit status $status)"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start NAME CMD... : runs an emulator whose command line ends with its port (filled in
# here), waits until it answers HTTP, and sets $port. Retries on a fresh port if the one
# picked was taken meanwhile.
start() {
    local name=$1 attempt pid logfile deadline
    shift
    for attempt in 1 2 3; do
        port=$(free_port)
        logfile="$emulators/$name.$$.log"
        logs+=("$logfile")
        # fd 9 (the install lock) closed here and for cargo: only this script holds it.
        "$@" "$port" >"$logfile" 2>&1 9>&- &
        pid=$!
        pids+=("$pid")
        deadline=$(( $(date +%s) + STARTUP_TIMEOUT_S ))
        while (( $(date +%s) < deadline )); do
            if answers_http "http://127.0.0.1:$port/"; then
                log "$name listening on 127.0.0.1:$port (pid $pid)"
                return 0
            fi
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        log "$name did not start on port $port (attempt $attempt); its output:"
        cat "$logfile" >&2 || true
    done
    keep_logs=1
    log "giving up on $name; logs are in .cache/emulators/"
    return 1
}

start kinesalite node "$emulators/node_modules/kinesalite/cli.js" --shardLimit 200 --port
kinesis_port=$port
start dynalite node "$emulators/node_modules/dynalite/cli.js" --host 127.0.0.1 --port
dynamodb_port=$port

kinesis_local() { # port: kinesis-local takes its settings from the environment only; it
    # exits without KINESIS_MOCK_CERT_PATH, and always opens a TLS port too (unused here).
    KINESIS_MOCK_PLAIN_PORT=$1 KINESIS_MOCK_TLS_PORT=$(free_port) \
    KINESIS_MOCK_CERT_PATH="$emulators/node_modules/kinesis-local/server.json" \
    LOG_LEVEL=WARN SHARD_LIMIT=200 exec node "$emulators/node_modules/kinesis-local/main.js"
}
start kinesis-local kinesis_local
fanout_kinesis_port=$port

start moto "$moto_venv/bin/moto_server" -H 127.0.0.1 -p
table_streams_port=$port

export AWS_ENDPOINT_URL_KINESIS="http://127.0.0.1:$kinesis_port"
export AWS_ENDPOINT_URL_DYNAMODB="http://127.0.0.1:$dynamodb_port"
export AWS_REGION=us-east-1
export AWS_ACCESS_KEY_ID=test
export AWS_SECRET_ACCESS_KEY=test
export AWS_EC2_METADATA_DISABLED=true
export SHARDFLOW_EMULATORS=1
export SHARDFLOW_FANOUT_KINESIS_ENDPOINT="http://127.0.0.1:$fanout_kinesis_port"
export SHARDFLOW_KPL_PYTHON="$kpl_venv/bin/python"
export SHARDFLOW_TABLE_STREAMS_ENDPOINT="http://127.0.0.1:$table_streams_port"
# moto's server also serves the Glue Schema Registry calls (middleware/tests/glue_registry.rs).
export SHARDFLOW_GLUE_ENDPOINT="$SHARDFLOW_TABLE_STREAMS_ENDPOINT"
# Keep any configured HTTP proxy away from the loopback emulators.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"

targeted=0
for arg in "$@"; do
    [[ "$arg" == "--" ]] && break
    case "$arg" in
        --lib | --bin | --bin=* | --bins | --test | --test=* | --tests | --example | --example=* | \
        --examples | --bench | --bench=* | --benches | --all-targets | --doc)
            targeted=1 ;;
    esac
done

# --all-features: the optional features' code and tests (trace context) are built and run
# too, in the same single build (each feature only adds to what the default build has).
if (( targeted )); then
    cargo test --workspace --all-features --no-fail-fast "$@" 9>&-
else
    cargo test --workspace --all-features --all-targets --no-fail-fast "$@" 9>&-
    cargo test --workspace --all-features --doc 9>&-
fi
