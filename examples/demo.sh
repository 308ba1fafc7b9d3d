#!/usr/bin/env bash
# `make demo`: the whole path on one machine, no servers to install. Starts `batchapi serve`
# (API + embedded worker, SQLite and a local storage dir in a temp data dir), submits
# examples/batch.jsonl, follows it to the end, prints a few results and the cost, stops.
set -euo pipefail
cd "$(dirname "$0")/.."
BATCHAPI="${BATCHAPI:-.venv/bin/batchapi}"
DATA_DIR="$(mktemp -d -t batchapi-demo.XXXXXX)"
PORT="${BATCHAPI_PORT:-8765}"
export BATCHAPI_DATA_DIR="$DATA_DIR" BATCHAPI_PORT="$PORT" BATCHAPI_BROKER_URL="" BATCHAPI_DATABASE_URL=""
export BATCHAPI_STORAGE_URL="" BATCHAPI_SHARD_SIZE="${BATCHAPI_SHARD_SIZE:-8}"

SERVER_PID=""
cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$DATA_DIR"
}
trap cleanup EXIT

"$BATCHAPI" db upgrade >/dev/null 2>&1
OPENAI_API_KEY="$("$BATCHAPI" keys create --project demo 2>/dev/null | tail -n 1)"
export OPENAI_API_KEY

echo "starting batchapi serve on port $PORT (data in $DATA_DIR)"
"$BATCHAPI" serve >"$DATA_DIR/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 180); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "the server exited:"; tail -n 30 "$DATA_DIR/server.log"; exit 1
  fi
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server not healthy"; tail -n 30 "$DATA_DIR/server.log"; exit 1; }

"$BATCHAPI" submit examples/batch.jsonl --wait --show 5
