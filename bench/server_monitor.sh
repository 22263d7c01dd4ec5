#!/bin/bash
# Sample a running adaserve server every 2 s until it goes away: its RSS (KiB) and the engine
# gauges and counters from /metrics, one line per sample.
#   bench/server_monitor.sh PORT OUT.txt
set -u
port=$1
out=$2
pid=$(pgrep -f -- "--port $port" | head -1)
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
while curl -s -m 5 "localhost:$port/metrics" >"$tmp"; do
  rss=$(ps -o rss= -p "$pid" 2>/dev/null | tr -d ' ')
  gauges=$(grep -E '^adaserve_(num_requests_running|num_requests_waiting|kv_blocks_used|preemptions_total) ' "$tmp" |
    awk '{printf "%s=%s ", $1, $2}')
  echo "$(date +%s.%N) rss=$rss $gauges" >>"$out"
  sleep 2
done
