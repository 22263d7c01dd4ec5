#!/bin/bash
# Time from SIGTERM to exit with N streams running, and how each stream ended.
#   bench/drain_time.sh N DRAIN_TIMEOUT_S MAX_TOKENS [PORT]
# Starts `adaserve serve` (default model, B = 24), opens N streaming completions of
# MAX_TOKENS tokens, sends SIGTERM 4 s later, and reports the exit code, the seconds to exit
# and the finish reasons the clients saw.
set -u
n=$1
drain=$2
max_tokens=$3
port=${4:-8031}
out=$(mktemp -d)
adaserve serve --budget 24 --port "$port" --drain-timeout "$drain" --log-level warning \
  >"$out/server.log" 2>&1 &
pid=$!
until curl -s "localhost:$port/health" >/dev/null; do sleep 1; done
for i in $(seq "$n"); do
  curl -sN "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"prompt\": \"Story $i: once upon a time\", \"max_tokens\": $max_tokens, \"ignore_eos\": true, \"stream\": true}" \
    >"$out/s$i.txt" &
done
sleep 4
t0=$(date +%s.%N)
kill -TERM "$pid"
wait "$pid"
rc=$?
t1=$(date +%s.%N)
wait
complete=$(grep -l '\[DONE\]' "$out"/s*.txt | wc -l)
reasons=$(grep -ho '"finish_reason":"[a-z]*"' "$out"/s*.txt | sort | uniq -c | tr -s ' \n' ' ')
echo "streams=$n drain_timeout=$drain max_tokens=$max_tokens exit_code=$rc" \
  "sigterm_to_exit_s=$(python3 -c "print(round($t1 - $t0, 2))") complete_streams=$complete" \
  "finish_reasons:$reasons"
rm -rf "$out"
