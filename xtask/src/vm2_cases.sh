#!/bin/sh
# The two-VM cases: `cargo xtask vm2 --cases [NAME...]` runs `sh /xtask/cases.sh [NAME...]` in
# both VMs of a linked pair, and so does `cargo xtask test` as its two-VM stage.
#
# One script for both sides: $VM_NAME (A or B) picks each case's half. The halves meet at
# peer-sync barriers and peer-signal/peer-wait points, every wait bounded, every program under
# a bound, so a broken case fails instead of hanging. Each side reports its part with
# `xtask-mark case NAME pass|fail DETAIL`; a case passes when every report is a pass (and there
# is at least one). `xtask-mark case-begin NAME` (from A) starts a case's clock.
#
# The data comes from the examples: `blast client --verify` fills every message with a pattern
# that `blast server --verify` checks byte by byte.
. /xtask/iproute2.sh

ALL="blast-loss blast-delay dreq-lost link-down-up close-after-send peer-link-down reconnect-link reconnect-restart peer-killed"
# Blast cases: messages of SIZE (each 64 packets at rxe's 1024-byte MTU).
SIZE=64K

now() { read -r u _ < /proc/uptime; echo "$u"; }              # seconds since boot, 10 ms
secs_now() { read -r u _ < /proc/uptime; echo "${u%%.*}"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
say() { echo "== $VM_NAME: $*"; }

report() { # NAME pass|fail DETAIL
    xtask-mark "case $1 $2 $VM_NAME: $3"
    say "case $1: $2: $3"
    if [ "$2" = fail ]; then diagnose "$1"; fi
}

# diagnose NAME: after a failed case, what this VM's kernel RDMA stack says, bounded in lines
# and, each command, in time (a wedged stack can block a netlink dump): the kernel log's last
# lines, the device's nonzero hardware counters and ib_cm's message counters (RoCE; iWARP has
# neither), the neighbour entries and the QPs still there; then where received packets could
# stop short of the device: the link's packet and drop counts, the qdiscs, the kernel's UDP
# counters and RoCE's UDP socket (port 4791, 0x12B7: its drops), and the device's GID table
# (a packet to an address not in it is dropped before rxe counts it). A case that fails
# because the stack is wedged (CI saw every rdma_cm connect between the VMs time out while the
# peer signals, IP on the same link, went on: twice, the second time in a local CI run after
# A's link went down and up in reconnect-link, with A's rxe counting no packet received from
# then on while it still sent) then says so, which case left it so, and where the packets stopped.
diagnose() {
    say "diagnostics after $1 failed:"
    timeout -s KILL 5 dmesg 2>/dev/null | grep -v 'speed is unknown' | tail -n 20 | sed 's/^/  dmesg: /'
    nonzero() { # DIR: NAME=VALUE of each nonzero counter file in DIR
        for _df in "$1"/*; do
            _dv=$(timeout -s KILL 5 cat "$_df" 2>/dev/null) || continue
            [ -n "$_dv" ] && [ "$_dv" != 0 ] && printf '%s=%s ' "${_df##*/}" "$_dv"
        done
    }
    # Names of its own (`_d...`): the case that called report() may use `port`, `line` and the like.
    _dport=/sys/class/infiniband/$RDMA_DEV/ports/1
    for _dd in hw_counters cm_tx_msgs cm_rx_msgs cm_tx_retries cm_rx_duplicates; do
        [ -d "$_dport/$_dd" ] && echo "  $RDMA_DEV $_dd: $(nonzero "$_dport/$_dd")"
    done
    timeout -s KILL 5 ip neigh show dev "$RDMA_NETDEV" 2>/dev/null | sed 's/^/  neigh: /'
    timeout -s KILL 5 rdma resource show qp 2>/dev/null | head -n 12 | sed 's/^/  qp: /'
    _dst=/sys/class/net/$RDMA_NETDEV/statistics
    _dline=
    for _dc in rx_packets rx_dropped rx_errors rx_missed_errors tx_packets tx_dropped tx_errors; do
        read -r _dv 2>/dev/null < "$_dst/$_dc" && _dline="$_dline$_dc=$_dv "
    done
    echo "  link $RDMA_NETDEV: $_dline"
    # Without -s: under busybox's `timeout`, `tc` runs as busybox's applet, which has none.
    timeout -s KILL 5 tc qdisc show dev "$RDMA_NETDEV" 2>&1 | head -n 6 | sed "s/^/  qdisc: /"
    grep '^Udp:' /proc/net/snmp 2>/dev/null | sed 's/^/  snmp: /'
    grep -i ':12B7 ' /proc/net/udp /proc/net/udp6 2>/dev/null | head -n 4 | sed 's/^/  udp 4791: /'
    # The table's first entries (it fills from the start; rxe's has 1024), read without a fork.
    for _di in 0 1 2 3 4 5 6 7; do
        read -r _dv 2>/dev/null < "$_dport/gids/$_di" || continue
        [ "$_dv" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
        _dt= _dn=
        read -r _dt 2>/dev/null < "$_dport/gid_attrs/types/$_di"
        read -r _dn 2>/dev/null < "$_dport/gid_attrs/ndevs/$_di"
        echo "  gid $_di: $_dv $_dt $_dn"
    done
    return 0
}

# alive PID: true while PID runs (a zombie, ended but not yet waited for, counts as ended).
alive() {
    [ -r "/proc/$1/stat" ] || return 1
    read -r _ _ st _ < "/proc/$1/stat" 2>/dev/null || return 1
    [ "$st" != Z ]
}

# wait_pid PID SECS: waits for PID to end, at most SECS seconds, then kills it; returns its
# exit status (124 when it had to be killed).
wait_pid() {
    _end=$(( $(secs_now) + $2 ))
    while alive "$1"; do
        if [ "$(secs_now)" -ge "$_end" ]; then
            kill -9 "$1" 2>/dev/null
            wait "$1" 2>/dev/null
            return 124
        fi
        usleep 100000
    done
    wait "$1"
}

# wait_log FILE REGEX SECS: waits until FILE has a line matching REGEX (at most SECS seconds).
wait_log() {
    _end=$(( $(secs_now) + $3 ))
    until grep -q -- "$2" "$1" 2>/dev/null; do
        [ "$(secs_now)" -ge "$_end" ] && return 1
        usleep 100000
    done
}

# server LOG PORT [ARGS...]: starts a blast server on $RDMA_ADDR:PORT, logging to LOG; sets
# $server; fails unless it is listening within 20 s.
server() {
    _log=$1 _port=$2
    shift 2
    "$BIN"/blast server --bind "$RDMA_ADDR:$_port" --verify "$@" > "$_log" 2>&1 &
    server=$!
    wait_log "$_log" "listening on" 20
}

# show LOG WHO: the log, each line prefixed with WHO.
show() { sed "s/^/[$2] /" "$1"; }

# The client's summary: "4194304 bytes in 1.078 s: 3.9 MB/s".
client_rate() {
    sed -n 's/^blast client: [0-9]* messages of [0-9]* bytes (\([0-9]*\) bytes) .* in \([0-9.]* s\): \([0-9.]* MB\/s\).*/\1 bytes in \2: \3/p' "$1"
}

# Why a client's connection ended: its failure line.
client_failure() {
    { grep 'FAILED' "$1" || grep -i -E 'error|failed' "$1"; } | head -n 1 | sed 's/^blast client: //'
}

# The server's line for a closed connection that matches REGEX.
server_conn() {
    grep -E "^blast server: Token.* client [0-9]+: .*$2" "$1" | head -1 | sed 's/^blast server: //'
}

cleanup() { # kills what a case left running, takes the link up, removes netem
    for p in $server $client; do
        kill -9 "$p" 2>/dev/null && wait "$p" 2>/dev/null
    done
    server= client=
    ip link set dev "$RDMA_NETDEV" up 2>/dev/null
    tc qdisc del dev "$RDMA_NETDEV" root 2>/dev/null
    tc qdisc del dev "$RDMA_NETDEV" clsact 2>/dev/null
}

# ---- 1. blast under netem loss or delay, every byte verified ----------------------------
# blast_netem NAME PORT COUNT NETEM-ARGS...: netem on both VMs' NICs (both directions), A
# serves, B sends COUNT messages of SIZE; both must finish and every byte must check out.
blast_netem() {
    name=$1 port=$2 count=$3
    shift 3
    # The case is the data path under loss, not ARP under loss: the neighbour entries are made
    # before netem. On siw the RDMA link carries nothing before this case (the peer signals
    # travel on the rxe link), and once in CI its client's address resolution timed out (5 s)
    # with netem already on.
    ping -c 1 -W 5 "$PEER_ADDR" > /dev/null 2>&1 || say "ping $PEER_ADDR before netem failed"
    peer-sync "$name.neigh" 60 || { report "$name" fail "the peer did not reach netem's setup"; return; }
    if ! tc qdisc add dev "$RDMA_NETDEV" root netem "$@"; then
        report "$name" fail "tc qdisc add dev $RDMA_NETDEV root netem $* failed"
        return
    fi
    say "$(tc qdisc show dev "$RDMA_NETDEV")"
    peer-sync "$name.netem" 60 || { report "$name" fail "the peer did not set up netem"; return; }
    log=/tmp/$name.log
    if [ "$VM_NAME" = A ]; then
        if ! server "$log" "$port" --exit-after 1; then
            show "$log" server
            report "$name" fail "the blast server did not start"
            return
        fi
        peer-signal "$name.listening"
        wait_pid "$server" 90
        rc=$?
        server=
        show "$log" server
        line=$(server_conn "$log" "every byte verified")
        if [ $rc -eq 0 ] && [ -n "$line" ] && ! grep -q FAILED "$log"; then
            report "$name" pass "server: $(echo "$line" | sed 's/^Token([^)]*) client [0-9]*: //')"
        else
            report "$name" fail "server exit status $rc: $(tail -n 1 "$log")"
        fi
    else
        if ! peer-wait "$name.listening" 60 > /dev/null; then
            report "$name" fail "A's server did not come up"
            return
        fi
        timeout -s KILL 90 "$BIN"/blast client --connect "$PEER_ADDR:$port" --size $SIZE --count "$count" \
            --verify > "$log" 2>&1
        rc=$?
        show "$log" client
        if [ $rc -eq 0 ]; then
            report "$name" pass "client ($*): $(client_rate "$log")"
        else
            report "$name" fail "client exit status $rc: $(client_failure "$log")"
        fi
    fi
}

# ---- 1b. the client's disconnect lost twice (RoCE) ----------------------------------------
# B's kernel CM retransmits a DREQ that got no DREP (every 6.1 s by its timeouts on Debian's
# Linux 6.1, 6.2-6.4 s measured), but
# only while B's id lives: a client that gives up waiting for DISCONNECTED before a
# retransmission gets through destroys its id, and A never hears the disconnect. (blast-loss
# once failed so: B's client waited its 5 s disconnect timeout and exited; A, with no
# keepalive, held the connection until the case's limit.) Here A's ingress drops the CM's
# DREQs, as the wire would lose them (a u32 match on RoCEv2's UDP port, the GSI queue pair and
# the MAD's attribute, DREQ 0x0015; dropped on B's egress instead, rxe hears of the drop and
# sends again at once), until DREQ_DROPS of them were dropped; then the filter goes. A's
# server must see its client disconnect (`--exit-after 1`: it exits 0 with the connection's
# line) and B's client must exit 0 with no disconnect unanswered. On iWARP a disconnect is a
# TCP close, retransmitted by TCP even after the process exits: nothing of the CM's to drop.
DREQ_DROPS=2
# dreq_dropped: how many packets the DREQ filter dropped so far.
dreq_dropped() {
    tc -s filter show dev "$RDMA_NETDEV" ingress 2>/dev/null | sed -n 's/.*(dropped \([0-9]*\).*/\1/p' | head -n 1
}
dreq_lost() {
    name=$1 port=$2
    log=/tmp/$name.log
    if [ "$RDMA_DEVICE" != rxe ]; then
        report "$name" pass "n/a on $RDMA_DEVICE: an iWARP disconnect is a TCP close, which TCP retransmits (no CM DREQ to lose)"
        return
    fi
    if [ "$VM_NAME" = B ]; then
        peer-wait "$name.listening" 60 > /dev/null || { report "$name" fail "A's server did not come up"; return; }
        t0=$(now)
        timeout -s KILL 90 "$BIN"/blast client --connect "$PEER_ADDR:$port" --size 4K --count 16 --verify > "$log" 2>&1
        rc=$?
        show "$log" client
        unanswered=$(grep -c "disconnect(s) unanswered" "$log")
        if [ $rc -eq 0 ] && [ "$unanswered" -eq 0 ]; then
            report "$name" pass "client: exited 0 after $(since "$t0") s, its disconnect answered"
        else
            report "$name" fail "client exit status $rc after $(since "$t0") s: $(grep -m1 'unanswered\|FAILED' "$log")"
        fi
        return
    fi
    # RoCEv2 over IPv4 (no options): UDP port 4791, the BTH's destination queue pair 1 (GSI),
    # the MAD's management class 7 (CM) and attribute 0x0015 (DREQ) 48 bytes in (IP 20, UDP 8,
    # BTH 12, DETH 8).
    if ! { tc qdisc add dev "$RDMA_NETDEV" clsact &&
        tc filter add dev "$RDMA_NETDEV" ingress protocol ip u32 match ip protocol 17 0xff match ip dport 4791 0xffff \
            match u32 0x00000001 0x00ffffff at 32 match u8 0x07 0xff at 49 match u16 0x0015 0xffff at 64 action drop; }; then
        report "$name" fail "cannot install the DREQ filter on $RDMA_NETDEV"
        return
    fi
    if ! server "$log" "$port" --exit-after 1; then
        show "$log" server
        report "$name" fail "the blast server did not start"
        return
    fi
    peer-signal "$name.listening"
    t0= drops=0 times=
    end=$(( $(secs_now) + 60 ))
    while [ "$drops" -lt "$DREQ_DROPS" ] && alive "$server" && [ "$(secs_now)" -lt "$end" ]; do
        n=$(dreq_dropped)
        if [ "${n:-0}" -gt "$drops" ]; then
            drops=$n
            if [ -z "$t0" ]; then t0=$(now); times=0.0; else times="$times, $(since "$t0")"; fi
        fi
        usleep 50000
    done
    tc -s filter show dev "$RDMA_NETDEV" ingress | grep -E 'rule hit|dropped' | sed 's/^/[tc] /'
    tc qdisc del dev "$RDMA_NETDEV" clsact
    [ -z "$t0" ] && t0=$(now)
    held=0
    alive "$server" && [ "$drops" -lt "$DREQ_DROPS" ] && held=1
    if [ $held -eq 1 ]; then
        kill -9 "$server" 2>/dev/null
        wait "$server" 2>/dev/null
        rc=124
    else
        wait_pid "$server" 30
        rc=$?
    fi
    server=
    show "$log" server
    # Closed by the peer's disconnect (a DREQ that got through), not by anything of its own.
    line=$(server_conn "$log" "every byte verified \\(peer disconnected\\)")
    if [ $held -eq 1 ] && [ "$drops" -ge 1 ]; then
        report "$name" fail "the server never heard the disconnect: $drops DREQ(s) came (at $times s) and no more within 60 s of the server's start (B's CM stopped retransmitting: its id destroyed?)"
    elif [ "$drops" -lt "$DREQ_DROPS" ]; then
        report "$name" fail "only ${drops} DREQ(s) dropped (server exit status $rc): the filter did not match?"
    elif [ $rc -eq 0 ] && [ -n "$line" ]; then
        report "$name" pass "server: $drops DREQs dropped (at $times s), the disconnect heard $(since "$t0") s after the first: $(echo "$line" | sed 's/^Token([^)]*) client [0-9]*: //')"
    else
        report "$name" fail "server exit status $rc, $drops DREQs dropped (at $times s), $(since "$t0") s after the first (it never heard the disconnect?): $(tail -n 1 "$log")"
    fi
}

# ---- 2-4. link down, link down and up, peer killed (catalogue cases 13 and 20) ----------
# These need a connection whose retries end: tests/two_vm.rs streams with retry_count 6
# (rxe retries for ever at 7, the library's default, and the examples have no flag for it).
# Both VMs run the same test at once; its halves meet through peer-signal/peer-wait, and
# print `RESULT ...` lines, quoted in the report.
# two_vm NAME TEST: runs TEST of tests/two_vm.rs here; reports its RESULT lines.
two_vm() {
    name=$1 test=$2
    log=/tmp/$name.log
    timeout -s KILL 180 "$BIN"/two_vm --include-ignored --exact "$test" --nocapture --test-threads=1 > "$log" 2>&1
    rc=$?
    show "$log" two_vm
    results=$(sed -n 's/^RESULT //p' "$log" | tr '\n' ';' | sed 's/;$//; s/;/; /g')
    na=$(sed -n 's/.*xtask-not-applicable: [^:]*: //p' "$log" | head -n 1)
    if [ $rc -eq 0 ] && [ -n "$na" ]; then
        # Not applicable on this device's transport (util::not_on_iwarp): said, not passed.
        report "$name" pass "n/a on $RDMA_DEVICE: $na"
    elif [ $rc -eq 0 ] && grep -q "^test result: ok\. 1 passed" "$log"; then
        report "$name" pass "$results"
    else
        why=$(grep -m1 -A1 "panicked at" "$log" | tail -n 1)
        [ $rc -eq 137 ] && why="killed after 180 s"
        report "$name" fail "exit status $rc: ${why:-see the log}${results:+; $results}"
    fi
}

# ---- 5-6. a reconnecting client (issue 21): link down and up, server killed and restarted --
# B streams COUNT numbered messages with `blast client --reconnect`: after a failure it connects
# again and sends every message it could not confirm. A's fault: its link down for 12 s
# (`link`), or its server killed with SIGKILL and started again on the same port 1 s later
# (`restart`). Both sides pass when B's client finishes its count after at least one
# reconnection and A's (last) server reports every message from the first it saw to the last
# arrived with every byte verified (`blast server: ... all messages F..L arrived over ...`).
RC_COUNT=2000
# Both sides notice a dead link within about 2 s (7 tries of a 250 ms ACK timeout; an idle
# receiver through its keepalive probes), as tests/two_vm.rs does: with the kernel's ACK
# timeout a 12 s outage is ridden out by RC retries alone, and nothing reconnects.
RC_LIVENESS="--ack-timeout-ms 250 --keepalive-ms 500"
reconnect_case() { # NAME PORT link|restart
    name=$1 port=$2 fault=$3
    log=/tmp/$name.log
    if [ "$VM_NAME" = A ]; then
        if ! server "$log" "$port" --spin-us 0 $RC_LIVENESS; then
            show "$log" server
            report "$name" fail "the blast server did not start"
            return
        fi
        peer-signal "$name.listening"
        if ! peer-wait "$name.flowing" 90 > /dev/null; then
            show "$log" server
            report "$name" fail "B's client did not start sending"
            return
        fi
        t0=$(now)
        if [ "$fault" = link ]; then
            # Long enough for B's retries to run out (link-down-up: B's first send fails
            # about 2 s in), so it must reconnect. Its connection closes, and it redials,
            # once its disconnect is answered after the link is back (or
            # `Timeouts::disconnect` passes).
            ip link set dev "$RDMA_NETDEV" down
            sleep 12
            ip link set dev "$RDMA_NETDEV" up
            what="link down for $(since "$t0") s"
        else
            kill -9 "$server" 2>/dev/null
            wait "$server" 2>/dev/null
            show "$log" "first server"
            sleep 1
            if ! server "$log" "$port" --spin-us 0 $RC_LIVENESS; then
                show "$log" server
                report "$name" fail "the second blast server did not start"
                return
            fi
            what="server killed and started again in $(since "$t0") s"
        fi
        peer-signal "$name.fault-over"
        peer-wait "$name.done" 150 > /dev/null
        # B's client has exited; the server prints its summary once it has handled the
        # client's disconnect, which can come a moment later (on siw, the TCP close): wait for
        # it before killing the server (killed at once, one CI run lost the line).
        t1=$(now)
        wait_log "$log" "all messages" 20 || true
        say "waited $(since "$t1") s for the server's summary after B's client ended"
        kill -9 "$server" 2>/dev/null
        wait "$server" 2>/dev/null
        server=
        show "$log" server
        all=$(sed -n 's/.*; \(client [0-9]*: all messages .*\)/\1/p' "$log" | head -n 1)
        if [ -n "$all" ] && ! grep -q FAILED "$log"; then
            report "$name" pass "$what; $all"
        else
            report "$name" fail "$what; server: $( { grep FAILED "$log" || tail -n 1 "$log"; } | head -n 1)"
        fi
    else
        if ! peer-wait "$name.listening" 60 > /dev/null; then
            report "$name" fail "A's server did not come up"
            return
        fi
        "$BIN"/blast client --connect "$PEER_ADDR:$port" --size 16K --count $RC_COUNT --window 16 --verify \
            --reconnect 30 --spin-us 0 $RC_LIVENESS > "$log" 2>&1 &
        client=$!
        if wait_log "$log" "MB/s" 60; then
            peer-signal "$name.flowing"
        fi
        wait_pid "$client" 150
        rc=$?
        client=
        peer-signal "$name.done"
        show "$log" client
        again=$(grep -c ": reconnected$" "$log")
        resent=$(sed -n 's/^blast client: \([0-9]* reconnections, [0-9]* messages sent again\)/\1/p' "$log")
        if [ $rc -eq 0 ] && [ "$again" -ge 1 ]; then
            report "$name" pass "client: $RC_COUNT messages of 16K, every byte verified; $resent"
        elif [ $rc -eq 0 ]; then
            report "$name" fail "the client finished without reconnecting (the fault came too late?)"
        else
            report "$name" fail "client exit status $rc: $(client_failure "$log")"
        fi
    fi
}

run_case() {
    [ "$VM_NAME" = A ] && xtask-mark "case-begin $1"
    say "---- case $1"
    if ! peer-sync "$1.start" 120; then
        report "$1" fail "the peer did not reach the case's start"
        return
    fi
    case $1 in
    blast-loss) blast_netem blast-loss 7471 32 loss 1% ;;
    blast-delay) blast_netem blast-delay 7472 64 delay 5ms ;;
    dreq-lost) dreq_lost dreq-lost 7475 ;;
    link-down-up) two_vm link-down-up link_down_up_busy_fails_new_works ;;
    close-after-send) two_vm close-after-send close_right_after_the_last_send ;;
    peer-link-down) two_vm peer-link-down peer_link_down_sender_gives_up ;;
    reconnect-link) reconnect_case reconnect-link 7473 link ;;
    reconnect-restart) reconnect_case reconnect-restart 7474 restart ;;
    peer-killed) two_vm peer-killed peer_killed_sender_notices ;;
    esac
    cleanup
}

selected=${*:-$ALL}
for c in $ALL; do
    case " $selected " in
    *" $c "*) run_case "$c" ;;
    esac
done
# The end, together (unless B is gone): a VM powers off as soon as its command ends, so stay a
# moment after the barrier for the peer to see our signal.
case " $selected " in
*" peer-killed "*) ;;
*) peer-sync end 60 && sleep 2 ;;
esac
exit 0
