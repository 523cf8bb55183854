#!/usr/bin/env bash
# Record docs/dashboard.png from real data: a CPU `kvalloc serve`, a Prometheus scraping it every
# second with deploy/prometheus/alerts.yml, and two `kvalloc loadgen` workers (IPC and REST, the
# first sharing a system prompt through the prefix cache, every cached block copied to a host
# tier) for MINUTES minutes; then draw the Grafana dashboard's queries with
# docs/render_dashboard.py.
#   docs/record_demo.sh [MINUTES]        (needs `prometheus` on PATH: apt-get install prometheus)
# Everything listens on loopback and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:-4}
PY=${PY:-.venv/bin/python}
TMP=$(mktemp -d)
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait; rm -rf "$TMP"; }
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
REST_PORT=$(free_port)
PROM_PORT=$(free_port)
IPC="ipc://$TMP/kvalloc.ipc"

"$PY" -m kvalloc.server.cli serve --port "$REST_PORT" --ipc "$IPC" --num-blocks 2048 --max-draft-len 4 \
    --prefix-caching --host-tier 128MiB >"$TMP/serve.log" 2>&1 &
PIDS+=($!)
cat >"$TMP/prometheus.yml" <<YAML
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: ["$PWD/deploy/prometheus/alerts.yml", "$PWD/deploy/prometheus/step-latency-cpu.yml"]
scrape_configs:
  - job_name: kvalloc
    static_configs: [{targets: ["127.0.0.1:$REST_PORT"]}]
YAML
prometheus --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/data" \
    --web.listen-address="127.0.0.1:$PROM_PORT" >"$TMP/prometheus.log" 2>&1 &
PIDS+=($!)
until curl -sf "http://127.0.0.1:$REST_PORT/readyz" >/dev/null; do sleep 0.5; done

SECONDS_TOTAL=$((MINUTES * 60))
"$PY" -m kvalloc.server.cli loadgen --address "$IPC" --worker-id demo-ipc --no-progress \
    --duration "$SECONDS_TOTAL" --arrival-rate 0.5 --max-live 40 \
    --output-len 64:512 --shared-prefix 128 --seed 1 &
PIDS+=($!)
"$PY" -m kvalloc.server.cli loadgen --address "http://127.0.0.1:$REST_PORT" --worker-id demo-rest \
    --no-progress --duration "$SECONDS_TOTAL" \
    --step-interval 0.05 --arrival-rate 0.2 --acceptance geometric:0.5 --seed 2 &
PIDS+=($!)
wait "${PIDS[2]}" "${PIDS[3]}"
sleep 2
"$PY" docs/render_dashboard.py --prometheus "http://127.0.0.1:$PROM_PORT" \
    --minutes "$MINUTES" --out docs/dashboard.png
echo "wrote docs/dashboard.png"
