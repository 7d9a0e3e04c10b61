//! `cargo xtask bench`: the criterion benchmarks in the VM; `--compare`: our examples against
//! perftest and cmtime in ONE VM boot, interleaved over rounds, as one table of ratios.
//!
//! THE PLACE TO EDIT what is compared: [`ROWS`] (what each row means and its target) and the
//! guest script in [`compare_script`] (how each figure is measured). The guest prints one line
//! per measurement, `@@ row=ID round=N ours=X theirs=Y cpu=Z`, which [`parse`] reads.

use std::fmt::Write as _;

/// Counts per measurement: bounded, the VM is emulated.
pub const N_LAT: u32 = 2000;
/// Messages of the 64 B rate rows.
pub const N_RATE: u32 = 20000;
/// Messages of the 64 KiB throughput rows.
pub const N_BW: u32 = 2000;
/// 64 KiB units of the copy rows: 256 MiB (issue 46).
pub const N_COPY: u32 = 4096;
/// Connections of the setup row.
pub const N_CONN: u32 = 1000;
/// The most inline data siw accepts on a queue pair (`SIW_MAX_INLINE`: 5 SGEs of 16 bytes); a
/// perftest line's `-I` above it is clamped on siw (see `PT_INLINE` in [`compare_script`]).
pub const SIW_MAX_INLINE: u32 = 80;

/// Which way is better for a row's ratio (ours / theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Better {
    /// A time: at most `target` times theirs.
    Lower,
    /// A rate: at least `target` times theirs.
    Higher,
    /// No comparison: ours alone, at most `target` (a CPU share).
    Absolute,
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub id: &'static str,
    pub what: &'static str,
    pub unit: &'static str,
    pub better: Better,
    pub target: f64,
}

/// The rows, in table order.
pub const ROWS: &[Row] = &[
    Row {
        id: "echo64_spin",
        what: "64 B round trip, spin (echo p50 vs 2 x busy `ib_send_lat` typical)",
        unit: "us",
        better: Better::Lower,
        target: 1.1,
    },
    Row {
        id: "echo64_event",
        what: "64 B round trip, event mode (echo p50 vs 2 x `ib_send_lat -e` typical)",
        unit: "us",
        better: Better::Lower,
        target: 1.0,
    },
    Row {
        id: "echo4k_event",
        what: "4 KiB round trip, event mode (vs 2 x `ib_send_lat -e -s 4096`)",
        unit: "us",
        better: Better::Lower,
        target: 1.0,
    },
    Row {
        id: "blast64_rate",
        what: "64 B message rate (blast vs `ib_send_bw -s 64`)",
        unit: "msg/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "blast64_event",
        what: "64 B message rate, event mode (blast --spin-us 0 on both sides vs `ib_send_bw -s 64`)",
        unit: "msg/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "blast64_c8",
        what: "64 B message rate, 8 connections on one reactor (blast --clients 8 vs `ib_send_bw -q 8 -s 64`)",
        unit: "msg/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "blast64_c64",
        what: "64 B message rate, 64 connections on one reactor (blast --clients 64 vs `ib_send_bw -q 64 -s 64`)",
        unit: "msg/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "blast64_c8_t2",
        what: "64 B message rate, 8 connections, server --threads 2 (vs `ib_send_bw -q 8 -s 64`)",
        unit: "msg/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "blast64k_send",
        what: "64 KiB SEND throughput (blast vs `ib_send_bw -s 65536`)",
        unit: "MB/s",
        better: Better::Higher,
        target: 0.95,
    },
    Row {
        id: "blast64k_write",
        what: "64 KiB RDMA WRITE throughput (blast --op write vs `ib_write_bw -s 65536`)",
        unit: "MB/s",
        better: Better::Higher,
        target: 0.95,
    },
    Row {
        id: "conn1000",
        what: "1000 connections set up, one round trip each, closed (echo vs `cmtime -c 1000`)",
        unit: "s",
        better: Better::Lower,
        target: 1.2,
    },
    Row {
        id: "aecho64_spin",
        what: "async face: 64 B round trip, spin (aecho p50 vs the callback echo's, both --spin-us 1000)",
        unit: "us",
        better: Better::Lower,
        target: 1.1,
    },
    Row {
        id: "aecho64_event",
        what: "async face: 64 B round trip, event mode (aecho p50 vs the callback echo's)",
        unit: "us",
        better: Better::Lower,
        target: 1.1,
    },
    Row {
        id: "aecho64_rate16",
        what: "async face: 64 B message rate, 16 connections ping-ponging on one reactor (aecho vs the callback echo)",
        unit: "msg/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "stream64_event",
        what: "byte stream: 64 B round trip, event mode (stream_bench --echo p50 vs aecho's, both against an aecho server)",
        unit: "us",
        better: Better::Lower,
        target: 1.2,
    },
    Row {
        id: "stream64k_bw",
        what: "byte stream: 64 KiB writes one way (stream_bench client into its sink vs blast 64 KiB SENDs)",
        unit: "MB/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "stream_copy8k",
        what: "byte stream: tokio::io::copy of 256 MiB (8 KiB writes) vs copy_buf from a 64 KiB BufReader (64 KiB writes)",
        unit: "MB/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "stream_copy8k_blast",
        what: "byte stream: tokio::io::copy of 256 MiB (8 KiB writes) vs blast's 64 KiB SENDs of as many bytes",
        unit: "MB/s",
        better: Better::Higher,
        target: 0.9,
    },
    Row {
        id: "idle100_event",
        what: "idle echo server holding 100 connections, event mode (share of a core)",
        unit: "%",
        better: Better::Absolute,
        target: 1.0,
    },
    Row {
        id: "idle100_spin",
        what: "idle echo server holding 100 connections, --spin-us 1000, after the spin (share)",
        unit: "%",
        better: Better::Absolute,
        target: 1.0,
    },
];

/// The guest script of `--compare`: `rounds` rounds, each measuring every row, ours then
/// theirs, on the device `$RDMA_DEVICE`/`$RDMA_DEV` name (`cargo xtask bench --device`).
///
/// perftest gets `$PT_OPTS`: `-d $RDMA_DEV` always (both rxe0 and siw0 are up in the VM; without
/// `-d` perftest takes the first device it finds), and on siw `-R` too: iWARP queue pairs are
/// connected through rdma_cm, not perftest's default exchange over a TCP socket. cmtime is
/// rdma_cm only and needs nothing. No perftest line passes `-I` (inline data) today; one that
/// does must write it as `-I $(PT_INLINE N)`, which caps N at [`SIW_MAX_INLINE`] on siw.
pub fn compare_script(rounds: u32, rows: &[String]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"# cargo xtask bench --compare (xtask/src/bench.rs)
A=$RDMA_ADDR
# perftest on the chosen device; on siw (iWARP) connected through rdma_cm (-R).
PT_OPTS="-d $RDMA_DEV"
[ "$RDMA_DEVICE" = siw ] && PT_OPTS="-R $PT_OPTS"
# PT_INLINE N: N bytes of inline data, at most siw's {SIW_MAX_INLINE} on siw.
PT_INLINE() {{ if [ "$RDMA_DEVICE" = siw ] && [ "$1" -gt {SIW_MAX_INLINE} ]; then echo {SIW_MAX_INLINE}; else echo "$1"; fi; }}
echo "== perftest options: $PT_OPTS"
port=7500
# Every program runs under a watchdog: a hung measurement fails its row, never the run.
T="timeout 300"
echo "@@ machine nproc=$(nproc) kernel=$(uname -r) device=$RDMA_DEV"
cpu_ticks() {{ awk '{{print $14 + $15}}' /proc/$1/stat; }}
# `time -p` output of a command on fd 2 -> "user+sys" seconds.
cpu_of() {{ awk '/^user/{{u=$2}} /^sys/{{s=$2}} END{{print u + s}}'; }}
real_of() {{ awk '/^real/{{print $2}}'; }}
ptyp() {{ awk '/#bytes/{{getline; print $5; exit}}'; }}   # ib_*_lat: t_typical
pbw() {{ awk '/#bytes/{{getline; print $4; exit}}'; }}    # ib_*_bw: BW average[MB/sec]
prate() {{ awk '/#bytes/{{getline; printf "%.0f", $5 * 1000000; exit}}'; }}  # MsgRate[Mpps]
server() {{ # NAME ARGS...: starts our server on a fresh port
    port=$((port + 1)); name=$1; shift
    $T "$BIN"/$name server --bind $A:$port --quiet "$@" >/dev/null 2>&1 &
    srv=$!; sleep 1
}}
stop() {{ kill $srv 2>/dev/null; wait $srv 2>/dev/null; }}
echo_lat() {{ # ROW ROUND SIZE SPIN PERFTEST-ARGS
    server echo --spin-us $4
    out=$( ( time -p $T "$BIN"/echo client --connect $A:$port --size $3 --count {N_LAT} --spin-us $4 ) 2>&1 )
    stop
    ours=$(echo "$out" | sed -n 's/.*p50 \([0-9.]*\) us.*/\1/p')
    cpu=$(echo "$out" | cpu_of | awk '{{printf "%.1f", $1 * 1000000 / {N_LAT}}}')
    for try in 1 2; do   # a perftest pair that fails to meet is run once more
        $T ib_send_lat $PT_OPTS $5 -s $3 -n {N_LAT} >/dev/null 2>&1 & p=$!; sleep 1
        pout=$( ( time -p $T ib_send_lat $PT_OPTS $5 -s $3 -n {N_LAT} $A ) 2>&1 )
        half=$(echo "$pout" | ptyp)
        kill $p 2>/dev/null; wait $p 2>/dev/null
        [ -n "$half" ] && break
    done
    theirs=$([ -n "$half" ] && awk "BEGIN{{print 2 * $half}}")
    tcpu=$(echo "$pout" | cpu_of | awk '{{printf "%.1f", $1 * 1000000 / {N_LAT}}}')
    echo "@@ row=$1 round=$2 ours=$ours theirs=$theirs cpu=$cpu tcpu=$tcpu"
}}
blast_bw() {{ # ROW ROUND SIZE COUNT OP PERFTEST FIELD(rate|bw) [CLIENTS [SERVER-THREADS [SPIN-US]]]
    # Every program at its defaults: blast's window and credit depth, perftest's depths.
    # COUNT messages in all, spread over CLIENTS connections (perftest: -q CLIENTS QPs).
    q=${{8:-1}}; th=${{9:-1}}; per=$(($4 / q)); sp=""; [ -n "${{10}}" ] && sp="--spin-us ${{10}}"
    port=$((port + 1))
    # (time is a program here, not a shell keyword: a 2> inside the subshell would take its
    # report too. Only the time lines start with user/sys, which is all cpu_of reads.)
    ( time -p $T "$BIN"/blast server --bind $A:$port --quiet --exit-after $q --threads $th $sp >/dev/null ) 2>/tmp/srv.time &
    srv=$!; sleep 1
    out=$( ( time -p $T "$BIN"/blast client --connect $A:$port --size $3 --count $per --clients $q --op $5 $sp ) 2>&1 )
    wait $srv 2>/dev/null
    line=$(echo "$out" | grep 'messages of')
    if [ $7 = rate ]; then ours=$(echo "$line" | sed -n 's/.* \([0-9]*\) messages\/s$/\1/p'); else ours=$(echo "$line" | sed -n 's/.*: \([0-9.]*\) MB\/s, .*/\1/p'); fi
    # CPU per message: client plus server, user plus system (`time -p` of each process).
    cpu=$(awk -v c="$(echo "$out" | cpu_of)" -v s="$(cpu_of </tmp/srv.time)" "BEGIN{{printf \"%.1f\", (c + s) * 1000000 / $4}}")
    qa=""; [ $q -gt 1 ] && qa="-q $q"
    for try in 1 2; do
        ( time -p $T $6 $PT_OPTS -s $3 -n $per $qa >/dev/null ) 2>/tmp/psrv.time & p=$!; sleep 1
        pout=$( ( time -p $T $6 $PT_OPTS -s $3 -n $per $qa $A ) 2>&1 )
        if [ $7 = rate ]; then theirs=$(echo "$pout" | prate); else theirs=$(echo "$pout" | pbw); fi
        # A server whose client failed to meet it would wait for its watchdog: kill it.
        [ -n "$theirs" ] || kill $p 2>/dev/null
        wait $p 2>/dev/null
        [ -n "$theirs" ] && break
    done
    tcpu=$(awk -v c="$(echo "$pout" | cpu_of)" -v s="$(cpu_of </tmp/psrv.time)" "BEGIN{{printf \"%.1f\", (c + s) * 1000000 / $4}}")
    # perftest's MB/sec is 2^20 bytes per second; blast's MB/s is 10^6.
    [ $7 = bw ] && [ -n "$theirs" ] && theirs=$(awk "BEGIN{{printf \"%.1f\", $theirs * 1.048576}}")
    echo "@@ row=$1 round=$2 ours=$ours theirs=$theirs cpu=$cpu tcpu=$tcpu"
}}
aecho_cmp() {{ # ROW ROUND SIZE SPIN CLIENTS FIELD(lat|rate): the async face against the callbacks
    # Ours: an aecho server and client; theirs: an echo server and client, same arguments.
    for prog in aecho echo; do
        server $prog --spin-us $4
        out=$( ( time -p $T "$BIN"/$prog client --connect $A:$port --size $3 --count {N_LAT} --clients $5 --spin-us $4 ) 2>&1 )
        stop
        if [ $6 = lat ]; then v=$(echo "$out" | sed -n 's/.*p50 \([0-9.]*\) us.*/\1/p'); else v=$(echo "$out" | sed -n 's/^rate: \([0-9]*\) messages\/s$/\1/p'); fi
        c=$(echo "$out" | cpu_of | awk -v n=$5 '{{printf "%.1f", $1 * 1000000 / ({N_LAT} * n)}}')
        if [ $prog = aecho ]; then ours=$v; cpu=$c; else theirs=$v; tcpu=$c; fi
    done
    echo "@@ row=$1 round=$2 ours=$ours theirs=$theirs cpu=$cpu tcpu=$tcpu"
}}
stream_cmp() {{ # ROW ROUND SIZE: a byte stream's round trips against aecho's, both to an aecho server
    server aecho
    out=$( ( time -p $T "$BIN"/stream_bench client --connect $A:$port --size $3 --count {N_LAT} --echo ) 2>&1 )
    stop
    ours=$(echo "$out" | sed -n 's/.*p50 \([0-9.]*\) us.*/\1/p')
    cpu=$(echo "$out" | cpu_of | awk '{{printf "%.1f", $1 * 1000000 / {N_LAT}}}')
    server aecho
    out=$( ( time -p $T "$BIN"/aecho client --connect $A:$port --size $3 --count {N_LAT} ) 2>&1 )
    stop
    theirs=$(echo "$out" | sed -n 's/.*p50 \([0-9.]*\) us.*/\1/p')
    tcpu=$(echo "$out" | cpu_of | awk '{{printf "%.1f", $1 * 1000000 / {N_LAT}}}')
    echo "@@ row=$1 round=$2 ours=$ours theirs=$theirs cpu=$cpu tcpu=$tcpu"
}}
stream_bw() {{ # ROW ROUND SIZE COUNT: one-way stream writes into the sink against blast's SENDs
    port=$((port + 1))
    $T "$BIN"/stream_bench server --bind $A:$port --quiet --exit-after 1 >/dev/null 2>&1 & srv=$!; sleep 1
    out=$( $T "$BIN"/stream_bench client --connect $A:$port --size $3 --count $4 2>&1 )
    wait $srv 2>/dev/null
    ours=$(echo "$out" | sed -n 's/^stream_bench client: .*: \([0-9.]*\) MB\/s$/\1/p')
    port=$((port + 1))
    $T "$BIN"/blast server --bind $A:$port --quiet --exit-after 1 >/dev/null 2>&1 & srv=$!; sleep 1
    out=$( $T "$BIN"/blast client --connect $A:$port --size $3 --count $4 2>&1 )
    wait $srv 2>/dev/null
    theirs=$(echo "$out" | grep 'messages of' | sed -n 's/.*: \([0-9.]*\) MB\/s, .*/\1/p')
    echo "@@ row=$1 round=$2 ours=$ours theirs=$theirs cpu=- tcpu=-"
}}
stream_copy() {{ # ROW ROUND THEIRS(copybuf|blast): tokio::io::copy's 8 KiB writes into the sink against
    # copy_buf's 64 KiB writes or blast's 64 KiB SENDs, {N_COPY} x 64 KiB each; CPU per 64 KiB
    # (client plus server, user plus system)
    port=$((port + 1))
    ( time -p $T "$BIN"/stream_bench server --bind $A:$port --quiet --exit-after 1 >/dev/null ) 2>/tmp/srv.time & srv=$!; sleep 1
    out=$( ( time -p $T "$BIN"/stream_bench client --connect $A:$port --size 65536 --count {N_COPY} --copy ) 2>&1 )
    wait $srv 2>/dev/null
    ours=$(echo "$out" | sed -n 's/^stream_bench client: .*: \([0-9.]*\) MB\/s$/\1/p')
    cpu=$(awk -v c="$(echo "$out" | cpu_of)" -v s="$(cpu_of </tmp/srv.time)" "BEGIN{{printf \"%.1f\", (c + s) * 1000000 / {N_COPY}}}")
    port=$((port + 1))
    if [ $3 = copybuf ]; then
        ( time -p $T "$BIN"/stream_bench server --bind $A:$port --quiet --exit-after 1 >/dev/null ) 2>/tmp/srv.time & srv=$!; sleep 1
        out=$( ( time -p $T "$BIN"/stream_bench client --connect $A:$port --size 65536 --count {N_COPY} --copy-buf 65536 ) 2>&1 )
        wait $srv 2>/dev/null
        theirs=$(echo "$out" | sed -n 's/^stream_bench client: .*: \([0-9.]*\) MB\/s$/\1/p')
    else
        ( time -p $T "$BIN"/blast server --bind $A:$port --quiet --exit-after 1 >/dev/null ) 2>/tmp/srv.time & srv=$!; sleep 1
        out=$( ( time -p $T "$BIN"/blast client --connect $A:$port --size 65536 --count {N_COPY} ) 2>&1 )
        wait $srv 2>/dev/null
        theirs=$(echo "$out" | grep 'messages of' | sed -n 's/.*: \([0-9.]*\) MB\/s, .*/\1/p')
    fi
    tcpu=$(awk -v c="$(echo "$out" | cpu_of)" -v s="$(cpu_of </tmp/srv.time)" "BEGIN{{printf \"%.1f\", (c + s) * 1000000 / {N_COPY}}}")
    echo "@@ row=$1 round=$2 ours=$ours theirs=$theirs cpu=$cpu tcpu=$tcpu"
}}
conns() {{ # ROUND
    server echo
    out=$( ( time -p $T "$BIN"/echo client --connect $A:$port --size 64 --count 1 --clients {N_CONN} ) 2>&1 )
    stop
    ours=$(echo "$out" | real_of)
    cpu=$(echo "$out" | cpu_of | awk '{{printf "%.1f", $1 * 1000000 / {N_CONN}}}')
    $T cmtime -b $A -c {N_CONN} >/dev/null 2>&1 & p=$!; sleep 1
    # (time is a program here, not a shell keyword: its report goes to the subshell's stderr.)
    theirs=$( ( time -p $T cmtime -s $A -c {N_CONN} ) 2>&1 >/dev/null | real_of )
    kill $p 2>/dev/null; wait $p 2>/dev/null   # cmtime's server does not exit by itself
    echo "@@ row=conn1000 round=$1 ours=$ours theirs=$theirs cpu=$cpu"
}}
idle() {{ # ROW ROUND SPIN
    server echo --spin-us $3
    $T "$BIN"/echo client --connect $A:$port --size 64 --count 1 --clients 100 --hold-ms 9000 >/dev/null 2>&1 & c=$!
    sleep 5   # connected, one round trip each, now idle (and past any spin time)
    t0=$(cpu_ticks $srv); sleep 3; t1=$(cpu_ticks $srv)
    wait $c; stop
    ours=$(awk "BEGIN{{printf \"%.2f\", ($t1 - $t0) / 3}}")   # ticks of 10 ms over 3 s = percent
    echo "@@ row=$1 round=$2 ours=$ours theirs=- cpu=-"
}}
"#
    );
    for r in 1..=rounds {
        let _ = writeln!(s, "echo \"== round {r} of {rounds}\"");
        let lines = [
            ("echo64_spin", format!("echo_lat echo64_spin {r} 64 1000 \"\"")),
            ("echo64_event", format!("echo_lat echo64_event {r} 64 0 -e")),
            ("echo4k_event", format!("echo_lat echo4k_event {r} 4096 0 -e")),
            ("blast64_rate", format!("blast_bw blast64_rate {r} 64 {N_RATE} send ib_send_bw rate")),
            ("blast64_event", format!("blast_bw blast64_event {r} 64 {N_RATE} send ib_send_bw rate 1 1 0")),
            ("blast64_c8", format!("blast_bw blast64_c8 {r} 64 {N_RATE} send ib_send_bw rate 8")),
            ("blast64_c64", format!("blast_bw blast64_c64 {r} 64 {N_RATE} send ib_send_bw rate 64")),
            ("blast64_c8_t2", format!("blast_bw blast64_c8_t2 {r} 64 {N_RATE} send ib_send_bw rate 8 2")),
            ("blast64k_send", format!("blast_bw blast64k_send {r} 65536 {N_BW} send ib_send_bw bw")),
            ("blast64k_write", format!("blast_bw blast64k_write {r} 65536 {N_BW} write ib_write_bw bw")),
            ("aecho64_spin", format!("aecho_cmp aecho64_spin {r} 64 1000 1 lat")),
            ("aecho64_event", format!("aecho_cmp aecho64_event {r} 64 0 1 lat")),
            ("aecho64_rate16", format!("aecho_cmp aecho64_rate16 {r} 64 0 16 rate")),
            ("stream64_event", format!("stream_cmp stream64_event {r} 64")),
            ("stream64k_bw", format!("stream_bw stream64k_bw {r} 65536 {N_BW}")),
            ("stream_copy8k", format!("stream_copy stream_copy8k {r} copybuf")),
            ("stream_copy8k_blast", format!("stream_copy stream_copy8k_blast {r} blast")),
            ("conn1000", format!("conns {r}")),
            ("idle100_event", format!("idle idle100_event {r} 0")),
            ("idle100_spin", format!("idle idle100_spin {r} 1000")),
        ];
        for (_, line) in lines.iter().filter(|(id, _)| rows.is_empty() || rows.iter().any(|r| r == id)) {
            let _ = writeln!(s, "{line}");
        }
    }
    s.push_str("echo \"== done\"\n");
    s
}

/// One measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub row: String,
    pub round: u32,
    pub ours: Option<f64>,
    pub theirs: Option<f64>,
    pub cpu_us: Option<f64>,
    /// Theirs (perftest's), measured the same way.
    pub their_cpu_us: Option<f64>,
}

/// Reads the `@@ row=...` lines of the guest's output.
pub fn parse(output: &str) -> Vec<Sample> {
    output
        .lines()
        .filter_map(|l| l.trim().strip_prefix("@@ row="))
        .filter_map(|rest| {
            let mut fields = rest.split_whitespace();
            let row = fields.next()?.to_string();
            let mut s = Sample { row, round: 0, ours: None, theirs: None, cpu_us: None, their_cpu_us: None };
            for kv in fields {
                let (k, v) = kv.split_once('=')?;
                let num = v.parse::<f64>().ok().filter(|x| x.is_finite());
                match k {
                    "round" => s.round = v.parse().ok()?,
                    "ours" => s.ours = num,
                    "theirs" => s.theirs = num,
                    "cpu" => s.cpu_us = num,
                    "tcpu" => s.their_cpu_us = num,
                    _ => {}
                }
            }
            Some(s)
        })
        .collect()
}

/// The median of `v` (sorted inside), `None` when empty.
pub fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// The Markdown table, and whether every row has all its rounds.
pub fn table(samples: &[Sample], rounds: u32, rows: &[String]) -> (String, bool) {
    let mut out = String::from(
        "| figure | ours (median) | theirs (median) | ratio median | ratio min-max | CPU per msg, ours / theirs | target | met |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let mut complete = true;
    for row in ROWS.iter().filter(|r| rows.is_empty() || rows.iter().any(|id| id == r.id)) {
        let got: Vec<&Sample> = samples.iter().filter(|s| s.row == row.id).collect();
        let ok: Vec<&&Sample> =
            got.iter().filter(|s| s.ours.is_some() && (row.better == Better::Absolute || s.theirs.is_some())).collect();
        if ok.len() < rounds as usize {
            complete = false;
        }
        let mut ours: Vec<f64> = ok.iter().filter_map(|s| s.ours).collect();
        let mut theirs: Vec<f64> = ok.iter().filter_map(|s| s.theirs).collect();
        let mut ratios: Vec<f64> =
            ok.iter().filter_map(|s| Some(s.ours? / s.theirs?)).filter(|r| r.is_finite()).collect();
        let mut cpu: Vec<f64> = ok.iter().filter_map(|s| s.cpu_us).collect();
        let mut their_cpu: Vec<f64> = ok.iter().filter_map(|s| s.their_cpu_us).collect();
        let fmt = |x: Option<f64>, unit: &str| x.map_or("failed".to_string(), |x| format!("{x:.1} {unit}"));
        let (ratio, spread, met) = match row.better {
            Better::Absolute => {
                let m = median(&mut ours);
                ("-".to_string(), "-".to_string(), m.map(|m| m < row.target))
            }
            _ => {
                let m = median(&mut ratios);
                let lo = ratios.iter().copied().reduce(f64::min);
                let hi = ratios.iter().copied().reduce(f64::max);
                let met = m.map(|m| if row.better == Better::Lower { m <= row.target } else { m >= row.target });
                let spread = match (lo, hi) {
                    (Some(lo), Some(hi)) => format!("{lo:.2}-{hi:.2}x"),
                    _ => "-".into(),
                };
                (m.map_or("failed".into(), |m| format!("{m:.2}x")), spread, met)
            }
        };
        let target = match row.better {
            Better::Lower => format!("<= {:.2}x", row.target),
            Better::Higher => format!(">= {:.2}x", row.target),
            Better::Absolute => format!("< {} {}", row.target, row.unit),
        };
        let theirs = if row.better == Better::Absolute { "-".to_string() } else { fmt(median(&mut theirs), row.unit) };
        let cpu = match (median(&mut cpu), median(&mut their_cpu)) {
            (Some(c), Some(t)) => format!("{c:.1} / {t:.1} us"),
            (Some(c), None) => format!("{c:.1} us / -"),
            _ => "-".to_string(),
        };
        let met = match met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "failed",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            row.what,
            fmt(median(&mut ours), row.unit),
            theirs,
            ratio,
            spread,
            cpu,
            target,
            met
        );
    }
    (out, complete)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sample_lines_and_ignores_the_rest() {
        let out = "xtask noise\n@@ machine nproc=2 kernel=6.1\n\
                   @@ row=echo64_event round=1 ours=361.2 theirs=253.0 cpu=12.5 tcpu=9.5\n\
                   @@ row=idle100_event round=2 ours=0.00 theirs=- cpu=-\n\
                   @@ row=blast64_rate round=1 ours= theirs=24910 cpu=30.6\n";
        let s = parse(out);
        assert_eq!(s.len(), 3);
        assert_eq!(
            s[0],
            Sample {
                row: "echo64_event".into(),
                round: 1,
                ours: Some(361.2),
                theirs: Some(253.0),
                cpu_us: Some(12.5),
                their_cpu_us: Some(9.5)
            }
        );
        assert_eq!((s[1].ours, s[1].theirs, s[1].cpu_us), (Some(0.0), None, None));
        assert_eq!(s[2].ours, None, "an empty figure is a failed measurement");
    }

    #[test]
    fn medians_and_the_table_mark_targets_and_failures() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&mut []), None);
        let mut samples = Vec::new();
        for (round, ours) in [(1, 300.0), (2, 200.0), (3, 250.0)] {
            samples.push(Sample {
                row: "echo64_event".into(),
                round,
                ours: Some(ours),
                theirs: Some(250.0),
                cpu_us: Some(10.0),
                their_cpu_us: Some(8.0),
            });
        }
        samples.push(Sample {
            row: "idle100_event".into(),
            round: 1,
            ours: Some(0.3),
            theirs: None,
            cpu_us: None,
            their_cpu_us: None,
        });
        let (t, complete) = table(&samples, 3, &[]);
        assert!(!complete, "most rows have no samples");
        let echo = t.lines().find(|l| l.contains("event mode (echo")).expect("row");
        assert!(echo.contains("| 1.00x | 0.80-1.20x | 10.0 / 8.0 us |"), "{echo}");
        assert!(echo.ends_with("| <= 1.00x | yes |"), "{echo}");
        let idle = t.lines().find(|l| l.contains("idle echo server holding 100 connections, event")).expect("row");
        assert!(idle.contains("0.3 %") && idle.ends_with("| < 1 % | yes |"), "{idle}");
        let rate = t.lines().find(|l| l.contains("64 B message rate")).expect("row");
        assert!(rate.ends_with("| failed |"), "{rate}");
    }

    #[test]
    fn the_script_parses() {
        use std::io::Write as _;
        let mut sh =
            std::process::Command::new("sh").arg("-n").stdin(std::process::Stdio::piped()).spawn().expect("sh runs");
        sh.stdin.take().expect("piped").write_all(compare_script(2, &[]).as_bytes()).expect("written");
        assert!(sh.wait().expect("sh exits").success(), "sh -n found a syntax error in the compare script");
    }

    #[test]
    fn perftest_gets_the_device_and_rdma_cm_on_siw() {
        let s = compare_script(1, &[]);
        assert!(s.contains("PT_OPTS=\"-d $RDMA_DEV\"\n[ \"$RDMA_DEVICE\" = siw ] && PT_OPTS=\"-R $PT_OPTS\"\n"), "{s}");
        // Every perftest invocation (server and client) carries the options.
        for tool in ["ib_send_lat", "$6"] {
            let calls: Vec<&str> = s.lines().filter(|l| l.contains(&format!("$T {tool} "))).collect();
            assert_eq!(calls.len(), 2, "{tool}: {calls:?}");
            assert!(calls.iter().all(|l| l.contains(&format!("$T {tool} $PT_OPTS "))), "{calls:?}");
        }
        // Inline data within siw's limit: `-I` only through PT_INLINE, or a literal at most 80.
        let words: Vec<&str> = s.split_whitespace().collect();
        for w in words.windows(2).filter(|w| w[0] == "-I") {
            let ok = w[1].starts_with("$(PT_INLINE") || w[1].parse::<u32>().is_ok_and(|n| n <= SIW_MAX_INLINE);
            assert!(ok, "perftest -I {} exceeds siw's {SIW_MAX_INLINE} bytes: write -I $(PT_INLINE N)", w[1]);
        }
    }

    #[test]
    fn pt_inline_caps_only_on_siw() {
        let run = |device: &str, n: u32| {
            let script = format!(
                "{}\nPT_INLINE {n}\n",
                compare_script(1, &[]).lines().find(|l| l.starts_with("PT_INLINE()")).expect("PT_INLINE")
            );
            let out = std::process::Command::new("sh")
                .args(["-c", &script])
                .env("RDMA_DEVICE", device)
                .output()
                .expect("sh runs");
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        assert_eq!(run("siw", 236), "80");
        assert_eq!(run("siw", 64), "64");
        assert_eq!(run("rxe", 236), "236");
    }

    #[test]
    fn the_script_runs_every_row_every_round() {
        let s = compare_script(3, &[]);
        for r in 1..=3 {
            for row in ROWS {
                let call = if row.id == "conn1000" { format!("\nconns {r}\n") } else { format!(" {} {r} ", row.id) };
                assert!(s.contains(&call), "round {r}: {}", row.id);
            }
        }
        assert!(!s.contains(" echo64_event 4 "), "three rounds only");
    }
}
