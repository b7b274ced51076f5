#!/bin/bash
# Profile the worker and the gateway of a one-worker `nitsum up` with py-spy (sampling, --nonblocking) under
# steady load: phase "tokens" (CONC streams of 64 tokens, closed loop, DUR s) and phase "requests" (CONC
# 1-token requests in flight). Writes $OUT/LABEL/{tokens,requests}-{worker,gateway}.txt (py-spy raw) and
# load.jsonl; then: python categorize.py FILE 200 UNITS (UNITS = tokens or requests of that phase).
# PYTHONPATH selects the code (a checkout of another commit for a before/after).
# usage: load/profile_live/profile.sh LABEL
PY=${PY:-python}; SPY=${SPY:-py-spy}; L=$1; D=${OUT:-/tmp/nitsum-profile}/$L; rm -rf $D; mkdir -p $D
PORT=$($PY -c "from nitsum.natsserver import free_port; print(free_port())")
export NITSUM_HOME=$D/home
$PY -m nitsum.cli up --devices 1 --no-node-world --port $PORT --run-dir $D/run ${UPARGS} > $D/up.log 2>&1 &
UP=$!
for i in $(seq 300); do grep -q "ready in" $D/up.log && break; sleep 0.5; done
W=$(python3 -c "import json;print(json.load(open('$D/run/processes.json'))['worker-0'])"); G=$(python3 -c "import json;print(json.load(open('$D/run/processes.json'))['gateway'])")
$PY "$(dirname "$0")"/steady_load.py http://127.0.0.1:$PORT tokens 4 3 8 > /dev/null  # warm-up
for phase in tokens requests; do
  $SPY record --nonblocking -r 200 -f raw -o $D/$phase-worker.txt -p $W > /dev/null 2>&1 & S1=$!
  $SPY record --nonblocking -r 200 -f raw -o $D/$phase-gateway.txt -p $G > /dev/null 2>&1 & S2=$!
  sleep 0.5
  $PY "$(dirname "$0")"/steady_load.py http://127.0.0.1:$PORT $phase ${CONC:-16} ${DUR:-15} 64 | tee -a $D/load.jsonl
  kill -INT $S1 $S2; wait $S1 $S2
done
kill -INT $UP; wait $UP
