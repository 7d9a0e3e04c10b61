# blast server --threads 1 against --threads 2, interleaved rounds in one boot, 8 clients each:
# prints each round's client rate and the ratio of the means. Not a pass/fail check.
# Run: cargo xtask vm --timeout 900 -- sh -c "$(cat xtask/src/threads_ratio.sh)"
# Optional: ROUNDS (default 3), SIZE (default 65536), COUNT (messages per client, default 2000),
# VERIFY=1 (the client fills and the server checks every byte: user-space work on the server).
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-65536}
COUNT=${COUNT:-2000}
V=""; [ "${VERIFY:-0}" = 1 ] && V="--verify"
port=7600
rate() { # THREADS -> prints MB/s of one round
    port=$((port + 1))
    "$BIN"/blast server --bind "$RDMA_ADDR:$port" --quiet --threads "$1" --exit-after 9 $V >/tmp/server.out 2>&1 &
    srv=$!
    for _ in $(seq 200); do rdma res show cm_id | grep LISTEN | grep -q ":$port " && break; sleep 0.1; done
    t0=$(cut -d' ' -f22 /proc/self/stat)
    out=$("$BIN"/blast client --connect "$RDMA_ADDR:$port" --clients 8 --size "$SIZE" --count "$COUNT" $V 2>&1)
    # The server's CPU time (user, system; clock ticks) over the round, then a ninth, tiny
    # client ends it.
    t1=$(cut -d' ' -f22 /proc/self/stat)
    cpu=$(cut -d' ' -f14,15 "/proc/$srv/stat")
    echo "  T=$1: server CPU ticks (user system) $cpu over $((t1 - t0)) ticks of wall time" >&2
    "$BIN"/blast client --connect "$RDMA_ADDR:$port" --size 64 --count 1 >/dev/null 2>&1
    wait "$srv"
    echo "$out" | grep "CPU time" | sed "s/^/  T=$1: /" >&2
    echo "$out" | sed -n 's/.* s: \([0-9.]*\) MB\/s.*/\1/p' | tail -1
}
sum1=0; sum2=0
for r in $(seq "$ROUNDS"); do
    a=$(rate 1); b=$(rate 2)
    echo "round $r: --threads 1: $a MB/s, --threads 2: $b MB/s"
    sum1=$(echo "$sum1 + $a" | bc -l); sum2=$(echo "$sum2 + $b" | bc -l)
done
echo "mean --threads 1: $(echo "$sum1 / $ROUNDS" | bc -l | cut -c1-6) MB/s, --threads 2: $(echo "$sum2 / $ROUNDS" | bc -l | cut -c1-6) MB/s, ratio 2/1: $(echo "$sum2 / $sum1" | bc -l | cut -c1-5)"
