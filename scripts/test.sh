#!/usr/bin/env bash
# The project's one test command.
#
# Installs the local emulators (kinesalite for Kinesis, dynalite for DynamoDB) into
# .cache/emulators, starts them on free loopback ports, points the AWS SDK at them and runs
# the whole workspace's tests, then the doc tests. The emulators are stopped on exit,
# whatever happens. kinesis-local (kinesis-mock) also runs, for the enhanced fan-out tests
# only (kinesalite has no SubscribeToShard): its endpoint is SHARDFLOW_FANOUT_KINESIS_ENDPOINT.
#
#   scripts/test.sh                      # everything: all targets, then doc tests
#   scripts/test.sh some_test_name       # extra args go to the first `cargo test`
#   scripts/test.sh --test aws_backend   # a target selection (--lib, --test, --bin,
#                                        # --example, --bench, --doc) replaces
#                                        # --all-targets, and the doc-test pass is skipped
#
# Needs only a Rust toolchain, node 20+ with npm, and python3.
set -euo pipefail

KINESALITE_VERSION=3.3.3
DYNALITE_VERSION=4.0.0
KINESIS_LOCAL_VERSION=0.6.2
STARTUP_TIMEOUT_S=15

started_at=$(date +%s)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
emulators="$repo/.cache/emulators"
mkdir -p "$emulators"

log() { printf 'test.sh: %s\n' "$*" >&2; }

installed_version() { # package -> its installed version, or nothing
    local manifest="$emulators/node_modules/$1/package.json"
    [[ -f "$manifest" ]] && node -p "require(process.argv[1]).version" "$manifest" 2>/dev/null || true
}

install_emulators() {
    if [[ "$(installed_version kinesalite)" == "$KINESALITE_VERSION" &&
          "$(installed_version dynalite)" == "$DYNALITE_VERSION" &&
          "$(installed_version kinesis-local)" == "$KINESIS_LOCAL_VERSION" ]]; then
        return
    fi
    log "installing kinesalite@$KINESALITE_VERSION, dynalite@$DYNALITE_VERSION and kinesis-local@$KINESIS_LOCAL_VERSION into .cache/emulators"
    npm install --no-audit --no-fund --save-exact --loglevel=error --prefix "$emulators" \
        "kinesalite@$KINESALITE_VERSION" "dynalite@$DYNALITE_VERSION" \
        "kinesis-local@$KINESIS_LOCAL_VERSION" >&2
}

# Several checkouts' test runs may share this machine: serialise installs when flock exists.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$emulators/.install.lock"
    flock 9
    install_emulators
    flock -u 9
    exec 9>&-
else
    install_emulators
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
    if (( keep_logs == 0 )); then
        rm -f "${logs[@]}"
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
        "$@" "$port" >"$logfile" 2>&1 &
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

export AWS_ENDPOINT_URL_KINESIS="http://127.0.0.1:$kinesis_port"
export AWS_ENDPOINT_URL_DYNAMODB="http://127.0.0.1:$dynamodb_port"
export AWS_REGION=us-east-1
export AWS_ACCESS_KEY_ID=test
export AWS_SECRET_ACCESS_KEY=test
export AWS_EC2_METADATA_DISABLED=true
export SHARDFLOW_EMULATORS=1
export SHARDFLOW_FANOUT_KINESIS_ENDPOINT="http://127.0.0.1:$fanout_kinesis_port"
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

if (( targeted )); then
    cargo test --workspace "$@"
else
    cargo test --workspace --all-targets "$@"
    cargo test --workspace --doc
fi
