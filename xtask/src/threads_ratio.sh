# blast server --threads 1 against --threads 2, interleaved rounds in one boot, 8 clients each:
# prints each round's client rate and the ratio of the means. Not a pass/fail check.
# Run: cargo xtask vm --timeout 900 -- sh -c "$(cat xtask/src/threads_ratio.sh)"
# Optional: ROUNDS (default 3), SIZE (default 65536), COUNT (messages per client, default 2000).
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-65536}
COUNT=${COUNT:-2000}
port=7600
rate() { # THREADS -> prints MB/s of one round
    port=$((port + 1))
    "$BIN"/blast server --bind "$RDMA_ADDR:$port" --quiet --threads "$1" --exit-after 8 >/tmp/server.out 2>&1 &
    srv=$!
    for _ in $(seq 200); do rdma res show cm_id | grep LISTEN | grep -q ":$port " && break; sleep 0.1; done
    out=$("$BIN"/blast client --connect "$RDMA_ADDR:$port" --clients 8 --size "$SIZE" --count "$COUNT" 2>&1)
    wait "$srv"
    echo "$out" | sed -n 's/.* s: \([0-9.]*\) MB\/s.*/\1/p' | tail -1
}
sum1=0; sum2=0
for r in $(seq "$ROUNDS"); do
    a=$(rate 1); b=$(rate 2)
    echo "round $r: --threads 1: $a MB/s, --threads 2: $b MB/s"
    sum1=$(echo "$sum1 + $a" | bc -l); sum2=$(echo "$sum2 + $b" | bc -l)
done
echo "mean --threads 1: $(echo "$sum1 / $ROUNDS" | bc -l | cut -c1-6) MB/s, --threads 2: $(echo "$sum2 / $ROUNDS" | bc -l | cut -c1-6) MB/s, ratio 2/1: $(echo "$sum2 / $sum1" | bc -l | cut -c1-5)"
