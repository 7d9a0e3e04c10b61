//! `cargo xtask bench --instructions`: user-space instructions per message, counted in the VM
//! by valgrind (cachegrind, `--cache-sim=no`), which an emulated CPU cannot blur: ours beside
//! perftest's (or, for the async face, beside the callback echo's), client and server.
//!
//! Each program runs at two message counts, [`N_LO`] and [`N_HI`] (or the `_BLAST` pair), and
//! the row's figure is the difference of the two counts over the extra messages, so set-up and
//! teardown drop out. Every row runs every round, rounds interleaved; the table shows the
//! median and the spread. Event-mode counts move a little with timing (a poll that finds
//! nothing, an arm that catches a completion): the spread says how much.
//!
//! The spin-mode row ([`Row::idle`]) counts only the work of the messages: a spinning
//! program's polls that find nothing are as many as its waits last, time, not work. Our echo
//! prints its idle spinning ticks (`Stats::idle_spins`). Each side is counted at both message
//! counts with its peer run natively (an answer comes at once: few idle ticks), and once more
//! at the high count with the client holding the connection open, idle, for half a second
//! (`--hold-ms`): the same messages, more idle ticks, so the two high counts give what one
//! idle tick costs, which [`spin_per_message`] subtracts.
//!
//! Then callgrind profiles our side of the rows in [`PROFILED`] at the high count; the guest
//! prints each profile (gzip, base64) between markers, and the host annotates it with
//! `callgrind_annotate` (self and inclusive, the top functions with their files), written to
//! `target/xtask/instructions/`.
//!
//! THE PLACE TO EDIT what is counted: [`ROWS`] and the guest functions in [`script`].

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::bench::median;
use crate::util::{Error, Result};

/// Round trips of the round-trip rows, low and high.
pub const N_LO: u32 = 500;
pub const N_HI: u32 = 2500;
/// Messages of the streaming rows, low and high.
pub const N_LO_BLAST: u32 = 5000;
pub const N_HI_BLAST: u32 = 25000;

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub id: &'static str,
    pub what: &'static str,
    /// The most ours may be, as a multiple of theirs (issue 33's targets); `None`: the issue
    /// sets none, the ratio is shown unjudged.
    pub target: Option<f64>,
    /// The sides whose count is time, not work: a program that busy-polls while it waits
    /// counts the polls that found nothing, as many as the wait lasted. Those sides get no
    /// verdict. At the defaults both perftest and our blast (`BLAST_SPIN_US`) busy-poll, but
    /// a sender with one connection seldom waits (its count is the event mode's within a few
    /// percent: judged); a receiver waits for every message, and with 8 connections each side
    /// waits on the others (not judged).
    pub busy: Busy,
    /// Our side spins: its idle ticks are subtracted ([`spin_per_message`]).
    pub idle: bool,
}

/// Which sides of a row busy-poll (see [`Row::busy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Busy {
    /// Neither: both sides' counts are work.
    Neither,
    /// The server side (perftest's `ib_send_bw` server at its defaults).
    Server,
    /// Both sides.
    Both,
}

impl Busy {
    /// Whether the `client` (or server) side's count is time, not work.
    pub fn side(self, client: bool) -> bool {
        match self {
            Busy::Neither => false,
            Busy::Server => !client,
            Busy::Both => true,
        }
    }
}

/// The rows, in table order.
pub const ROWS: &[Row] = &[
    Row {
        id: "echo64_event",
        what: "64 B round trip, event mode (echo vs `ib_send_lat -e`)",
        target: Some(1.3),
        busy: Busy::Neither,
        idle: false,
    },
    Row {
        id: "echo64_spin",
        what: "64 B round trip, spin mode, idle spins subtracted (echo --spin-us 1000000 vs `ib_send_lat -e`'s work)",
        target: None,
        busy: Busy::Neither,
        idle: true,
    },
    Row {
        id: "echo4k_event",
        what: "4 KiB round trip, event mode (echo vs `ib_send_lat -e -s 4096`)",
        target: Some(1.3),
        busy: Busy::Neither,
        idle: false,
    },
    Row {
        id: "aecho64_event",
        what: "64 B round trip, async face, event mode (aecho vs the callback echo)",
        target: Some(1.15),
        busy: Busy::Neither,
        idle: false,
    },
    Row {
        id: "stream64_event",
        what: "64 B round trip, byte stream, event mode (stream_bench --echo vs aecho, both to an aecho server)",
        target: Some(1.2),
        busy: Busy::Neither,
        idle: false,
    },
    Row {
        id: "blast64_event",
        what: "64 B streamed, event mode (blast --spin-us 0 vs `ib_send_bw -e`)",
        target: Some(1.5),
        busy: Busy::Neither,
        idle: false,
    },
    Row {
        id: "blast64",
        what: "64 B streamed, at the defaults (blast vs `ib_send_bw`)",
        target: Some(2.0),
        busy: Busy::Server,
        idle: false,
    },
    Row {
        id: "blast64_c8",
        what: "64 B streamed, 8 connections at the defaults (blast --clients 8 vs `ib_send_bw -q 8`)",
        target: Some(2.0),
        busy: Busy::Both,
        idle: false,
    },
];

/// Rows whose client (and, for the echo, server) side callgrind profiles: `(row, side)`.
pub const PROFILED: &[(&str, &str)] = &[
    ("echo64_event", "client"),
    ("echo64_event", "server"),
    ("aecho64_event", "client"),
    ("stream64_event", "client"),
    ("blast64_event", "client"),
    ("blast64_event", "server"),
];

/// The guest script: `rounds` rounds of every row, then the profiles.
/// True when `row` is among `rows` (`--rows`), or `rows` is empty (every row).
pub fn selected(row: &str, rows: &[String]) -> bool {
    rows.is_empty() || rows.iter().any(|r| r == row)
}

/// The guest script for the rows `rows` (every row when empty).
pub fn script(rounds: u32, rows: &[String]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"# cargo xtask bench --instructions (xtask/src/instructions.rs)
A=$RDMA_ADDR
PT_OPTS="-d $RDMA_DEV"
[ "$RDMA_DEVICE" = siw ] && PT_OPTS="-R $PT_OPTS"
port=7700
T="timeout 600"
CG="valgrind.bin --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null"
CALL="valgrind.bin --tool=callgrind --dump-instr=no --callgrind-out-file=/tmp/cg.out"
echo "@@ machine nproc=$(nproc) kernel=$(uname -r) device=$RDMA_DEV valgrind=$(valgrind.bin --tool=cachegrind --version)"
irefs() {{ sed -n 's/.*I *refs: *\([0-9,]*\).*/\1/p' "$1" | tr -d , | tail -1; }}
idle_of() {{ sed -n 's/.*idle spinning ticks \([0-9]*\).*/\1/p' "$1" | tail -1; }}
# pair ROW ROUND N WHO VG SERVER-CMD -- CLIENT-CMD: one server and one client, each under $VG
# (the client gets $A as its last word where it needs one); prints both sides' counts, and the
# idle spinning ticks our echo printed. A pair that fails to meet (a server slow to start under
# valgrind) is run once more. pair2 ROW ROUND N WHO SERVER-VG CLIENT-VG ...: each side its own
# (an empty one runs natively, uncounted).
pair() {{ a1=$1; a2=$2; a3=$3; a4=$4; a5=$5; shift 5; pair2 "$a1" "$a2" "$a3" "$a4" "$a5" "$a5" "$@"; }}
pair2() {{
    row=$1; round=$2; n=$3; who=$4; svg=$5; cvg=$6; shift 6
    srv_cmd=""; while [ "$1" != "--" ]; do srv_cmd="$srv_cmd $1"; shift; done; shift
    ok=""
    for try in 1 2 3; do
        port=$((port + 1)); f=/tmp/pair-$port
        # exec: $! is the server itself (timeout execs it), so a kill reaches it; each pair
        # has its own files, so nothing left of a failed one can write into the next's.
        eval "exec $T $svg $(echo "$srv_cmd" | sed "s/PORT/$port/g")" >$f.srv.out 2>$f.srv.vg & srv=$!
        # A native client does not wait for valgrind to start: the server gets longer.
        if [ -z "$cvg" ] && [ -n "$svg" ]; then sleep 20; else sleep 4; fi
        eval "$T $cvg $(echo "$*" | sed "s/PORT/$port/g")" >$f.cli.out 2>$f.cli.vg; rc=$?
        # ib_send_bw under valgrind does all its work, then cannot turn its cycle counts into a
        # rate ("Can't produce a report") and exits 1: the instructions are counted all the same.
        [ $rc -eq 1 ] && grep -q "Can't produce a report" $f.cli.vg && rc=0
        [ $rc -ne 0 ] && kill $srv 2>/dev/null
        wait $srv 2>/dev/null; src=$?
        c=$(irefs $f.cli.vg); s=$(irefs $f.srv.vg)
        # A spin run ($SPIN_RUN): the measured server must end well too (valgrind prints a
        # count for a killed one), and each measured side must have printed its idle ticks.
        if [ -n "$SPIN_RUN" ] && [ $rc -eq 0 ]; then
            [ -n "$svg" ] && [ $src -ne 0 ] && rc=$src
            [ -n "$svg" ] && [ -z "$(idle_of $f.srv.out)" ] && rc=98
            [ -n "$cvg" ] && [ -z "$(idle_of $f.cli.out)" ] && rc=99
        fi
        if [ $rc -eq 0 ] && {{ [ -z "$cvg" ] || [ -n "$c" ]; }} && {{ [ -z "$svg" ] || [ -n "$s" ]; }}; then ok=1; break; fi
        echo "== $row $who n=$n try $try failed (rc $rc):"; tail -3 $f.cli.out $f.cli.vg $f.srv.out $f.srv.vg
    done
    # A pair that never met reports no count (valgrind prints one for a failed run too).
    [ -n "$ok" ] || {{ c=""; s=""; }}
    ci=$(idle_of $f.cli.out); si=$(idle_of $f.srv.out)
    [ "$svg" = "$CG" ] || [ "$cvg" = "$CG" ] && \
        echo "@@ irow=$row round=$round n=$n who=$who client=$c server=$s client_idle=$ci server_idle=$si"
    rm -f /tmp/pair-$port.*
}}
echo_row() {{ # ROW ROUND SIZE: echo vs ib_send_lat -e
    for n in {N_LO} {N_HI}; do
        pair $1 $2 $n ours "$CG" "$BIN"/echo server --bind $A:PORT --quiet --exit-after 1 -- \
            "$BIN"/echo client --connect $A:PORT --size $3 --count $n
        pair $1 $2 $n theirs "$CG" ib_send_lat $PT_OPTS -e -s $3 -n $n -p PORT -- \
            ib_send_lat $PT_OPTS -e -s $3 -n $n -p PORT $A
    done
}}
echo_spin_row() {{ # ROW ROUND SIZE: echo spinning (idle ticks subtracted) vs ib_send_lat -e
    spin="--spin-us 1000000"
    for n in {N_LO} {N_HI}; do
        # Each side counted with its peer native: the peer answers at once, few idle ticks.
        SPIN_RUN=1
        pair2 $1 $2 $n ours "" "$CG" "$BIN"/echo server --bind $A:PORT --quiet --exit-after 1 $spin -- \
            "$BIN"/echo client --connect $A:PORT --size $3 --count $n $spin
        pair2 $1 $2 $n ours "$CG" "" "$BIN"/echo server --bind $A:PORT --quiet --exit-after 1 $spin -- \
            "$BIN"/echo client --connect $A:PORT --size $3 --count $n $spin
        SPIN_RUN=
        pair $1 $2 $n theirs "$CG" ib_send_lat $PT_OPTS -e -s $3 -n $n -p PORT -- \
            ib_send_lat $PT_OPTS -e -s $3 -n $n -p PORT $A
    done
    SPIN_RUN=1
    # The high count again, the client holding the connection open and idle for 0.5 s (within
    # the spin time) before it closes: the same messages, more idle ticks on both sides.
    pair2 $1 $2 {N_HI} hold "" "$CG" "$BIN"/echo server --bind $A:PORT --quiet --exit-after 1 $spin -- \
        "$BIN"/echo client --connect $A:PORT --size $3 --count {N_HI} $spin --hold-ms 500
    pair2 $1 $2 {N_HI} hold "$CG" "" "$BIN"/echo server --bind $A:PORT --quiet --exit-after 1 $spin -- \
        "$BIN"/echo client --connect $A:PORT --size $3 --count {N_HI} $spin --hold-ms 500
    SPIN_RUN=
}}
aecho_row() {{ # ROW ROUND SIZE: aecho vs echo, event mode
    for n in {N_LO} {N_HI}; do
        for prog in aecho echo; do
            who=ours; [ $prog = echo ] && who=theirs
            pair $1 $2 $n $who "$CG" "$BIN"/$prog server --bind $A:PORT --quiet --exit-after 1 -- \
                "$BIN"/$prog client --connect $A:PORT --size $3 --count $n
        done
    done
}}
stream_row() {{ # ROW ROUND SIZE: the byte stream's round trips vs aecho's, both to an aecho server
    for n in {N_LO} {N_HI}; do
        pair $1 $2 $n ours "$CG" "$BIN"/aecho server --bind $A:PORT --quiet --exit-after 1 -- \
            "$BIN"/stream_bench client --connect $A:PORT --size $3 --count $n --echo
        pair $1 $2 $n theirs "$CG" "$BIN"/aecho server --bind $A:PORT --quiet --exit-after 1 -- \
            "$BIN"/aecho client --connect $A:PORT --size $3 --count $n
    done
}}
blast_row() {{ # ROW ROUND SIZE CLIENTS PERFTEST-EXTRA OURS-EXTRA...: blast vs ib_send_bw
    row=$1; round=$2; size=$3; q=$4; ptx=$5; shift 5
    qa=""; [ $q -gt 1 ] && qa="-q $q"
    for n in {N_LO_BLAST} {N_HI_BLAST}; do
        per=$((n / q))
        pair $row $round $n ours "$CG" "$BIN"/blast server --bind $A:PORT --quiet --exit-after $q "$@" -- \
            "$BIN"/blast client --connect $A:PORT --size $size --count $per --clients $q "$@"
        pair $row $round $n theirs "$CG" ib_send_bw $PT_OPTS $ptx -s $size -n $per $qa -p PORT -- \
            ib_send_bw $PT_OPTS $ptx -s $size -n $per $qa -p PORT $A
    done
}}
"#
    );
    for r in 1..=rounds {
        let _ = writeln!(s, "echo \"== round {r} of {rounds}\"");
        let calls = [
            ("echo64_event", format!("echo_row echo64_event {r} 64")),
            ("echo64_spin", format!("echo_spin_row echo64_spin {r} 64")),
            ("echo4k_event", format!("echo_row echo4k_event {r} 4096")),
            ("aecho64_event", format!("aecho_row aecho64_event {r} 64")),
            ("stream64_event", format!("stream_row stream64_event {r} 64")),
            ("blast64_event", format!("blast_row blast64_event {r} 64 1 -e --spin-us 0")),
            ("blast64", format!("blast_row blast64 {r} 64 1 \"\"")),
            ("blast64_c8", format!("blast_row blast64_c8 {r} 64 8 \"\"")),
        ];
        for (_, call) in calls.iter().filter(|(row, _)| selected(row, rows)) {
            let _ = writeln!(s, "{call}");
        }
    }
    // callgrind on one side only: the other runs under cachegrind (as slow, so timing alike).
    for (row, side) in PROFILED.iter().filter(|(row, _)| selected(row, rows)) {
        let (srv_vg, cli_vg) = if *side == "client" { ("$CG", "$CALL") } else { ("$CALL", "$CG") };
        let _ = writeln!(
            s,
            "echo \"== profile {row} {side}\"\n{}\n\
             echo \"@@cg-begin {row}-{side}\"; gzip -c /tmp/cg.out | base64; echo \"@@cg-end\"; rm -f /tmp/cg.out",
            profile_call(row, srv_vg, cli_vg)
        );
    }
    s.push_str("echo \"== done\"\n");
    s
}

/// The guest command that runs `row` with `srv_vg` on the server and `cli_vg` on the client.
fn profile_call(row: &str, srv_vg: &str, cli_vg: &str) -> String {
    let (server, client) = match row {
        "echo64_event" => (
            "\"$BIN\"/echo server --bind $A:PORT --quiet --exit-after 1".to_string(),
            format!("\"$BIN\"/echo client --connect $A:PORT --size 64 --count {N_HI}"),
        ),
        "aecho64_event" => (
            "\"$BIN\"/aecho server --bind $A:PORT --quiet --exit-after 1".to_string(),
            format!("\"$BIN\"/aecho client --connect $A:PORT --size 64 --count {N_HI}"),
        ),
        "stream64_event" => (
            "\"$BIN\"/aecho server --bind $A:PORT --quiet --exit-after 1".to_string(),
            format!("\"$BIN\"/stream_bench client --connect $A:PORT --size 64 --count {N_HI} --echo"),
        ),
        _ => (
            "\"$BIN\"/blast server --bind $A:PORT --quiet --exit-after 1 --spin-us 0".to_string(),
            format!("\"$BIN\"/blast client --connect $A:PORT --size 64 --count {N_HI_BLAST} --clients 1 --spin-us 0"),
        ),
    };
    // `pair` runs both under one valgrind command; here each side has its own.
    format!(
        "port=$((port + 1))\n\
         $T {srv_vg} {} >/dev/null 2>/tmp/srv.vg & srv=$!; sleep 4\n\
         $T {cli_vg} {} >/dev/null 2>/tmp/cli.vg || echo \"== profile {row}: the client failed\"\n\
         wait $srv 2>/dev/null",
        server.replace("PORT", "$port"),
        client.replace("PORT", "$port")
    )
}

/// One count: a program side at one message count.
#[derive(Clone, Debug, PartialEq)]
pub struct Count {
    pub row: String,
    pub round: u32,
    pub n: u32,
    /// `ours` or `theirs`; `hold` for the spin row's run with an idle hold.
    pub who: String,
    pub client: Option<u64>,
    pub server: Option<u64>,
    /// Idle spinning ticks our echo printed (`None` when it printed none: not a spinning echo,
    /// or one that did not end well).
    pub client_idle: Option<u64>,
    pub server_idle: Option<u64>,
}

/// Reads the `@@ irow=...` lines of the guest's output.
pub fn parse(output: &str) -> Vec<Count> {
    output
        .lines()
        .filter_map(|l| l.trim().strip_prefix("@@ irow="))
        .filter_map(|rest| {
            let mut fields = rest.split_whitespace();
            let mut c = Count {
                row: fields.next()?.to_string(),
                round: 0,
                n: 0,
                who: String::new(),
                client: None,
                server: None,
                client_idle: None,
                server_idle: None,
            };
            for kv in fields {
                let (k, v) = kv.split_once('=')?;
                match k {
                    "round" => c.round = v.parse().ok()?,
                    "n" => c.n = v.parse().ok()?,
                    "who" => c.who = v.to_string(),
                    "client" => c.client = v.parse().ok(),
                    "server" => c.server = v.parse().ok(),
                    "client_idle" => c.client_idle = v.parse().ok(),
                    "server_idle" => c.server_idle = v.parse().ok(),
                    _ => {}
                }
            }
            Some(c)
        })
        .collect()
}

/// Instructions per message of `who`'s `side` in `row` and `round`: the difference between
/// its two counts over the extra messages.
fn per_message(counts: &[Count], row: &str, round: u32, who: &str, client: bool) -> Option<f64> {
    let mut at: Vec<(u32, u64)> = counts
        .iter()
        .filter(|c| c.row == row && c.round == round && c.who == who)
        .filter_map(|c| Some((c.n, if client { c.client? } else { c.server? })))
        .collect();
    at.sort_unstable();
    let (&(n1, i1), &(n2, i2)) = (at.first()?, at.last()?);
    (n2 > n1).then(|| (i2 as f64 - i1 as f64) / f64::from(n2 - n1))
}

/// Instructions per message of our spinning `side` in `row` and `round`, its idle ticks
/// subtracted, and what one idle tick cost: `(per message, per idle tick)`.
///
/// Three counts of the side, each with its peer run natively (it answers at once): `ours` at
/// the low and high counts, and `hold` at the high count with the client holding the
/// connection open and idle before it closes. Each count is `a n + k e + c` (`n` messages,
/// `e` idle ticks, `c` set-up and teardown): the two high counts differ only in idle ticks
/// (the same messages; one hold timer more), which gives `k`, and `a` is the low-to-high
/// difference less its idle ticks' cost. The assumption, stated: an idle tick costs the same
/// whether it waits for a message or in the hold (both poll the connection's unarmed CQ and
/// find nothing); the native peer keeps the idle ticks between messages few, so `k` is
/// applied to a small difference. `None` without all three counts and idle figures, when
/// the hold added fewer idle ticks than a tenth of the messages (`k` would be noise), when
/// `k` is not positive, or when the idle ticks' cost is more than a tenth of the counts'
/// difference (a round whose messages waited on idle ticks: its figure would be mostly `k`'s).
pub fn spin_per_message(counts: &[Count], row: &str, round: u32, client: bool) -> Option<(f64, f64)> {
    let side = |c: &Count| {
        if client {
            Some((c.client? as f64, c.client_idle? as f64))
        } else {
            Some((c.server? as f64, c.server_idle? as f64))
        }
    };
    let mine = |who: &'static str| counts.iter().filter(move |c| c.row == row && c.round == round && c.who == who);
    let at = |who: &'static str, n: u32| mine(who).filter(|c| c.n == n).find_map(side);
    let mut ns: Vec<u32> = mine("ours").filter(|c| side(c).is_some()).map(|c| c.n).collect();
    ns.sort_unstable();
    let (&lo, &hi) = (ns.first()?, ns.last()?);
    let ((i_lo, e_lo), (i_hi, e_hi), (i_hold, e_hold)) = (at("ours", lo)?, at("ours", hi)?, at("hold", hi)?);
    if hi <= lo || e_hold - e_hi < f64::from(hi) / 10.0 {
        return None;
    }
    let k = (i_hold - i_hi) / (e_hold - e_hi);
    // The subtraction must stay a correction: were it a tenth of the difference, an error of
    // a third in `k` would move the figure by 3 %.
    let correction = k * (e_hi - e_lo);
    (k > 0.0 && correction.abs() <= (i_hi - i_lo).abs() / 10.0)
        .then(|| ((i_hi - i_lo - correction) / f64::from(hi - lo), k))
}

/// The Markdown table (medians over the rounds, ratio spread), and whether every row has every
/// round on both sides.
pub fn table(counts: &[Count], rounds: u32, rows: &[String]) -> (String, bool) {
    let mut out = String::from(
        "| per message, user-space instructions | side | ours (median) | theirs (median) | ratio median | ratio min-max | target | met |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let mut complete = true;
    let mut notes = String::new();
    for row in ROWS.iter().filter(|r| selected(r.id, rows)) {
        for (side, client) in [("client", true), ("server", false)] {
            let mut ours = Vec::new();
            let mut theirs = Vec::new();
            let mut ratios = Vec::new();
            let mut idle_costs = Vec::new();
            for r in 1..=rounds {
                let o = if row.idle {
                    spin_per_message(counts, row.id, r, client).map(|(a, k)| {
                        idle_costs.push(k);
                        a
                    })
                } else {
                    per_message(counts, row.id, r, "ours", client)
                };
                let t = per_message(counts, row.id, r, "theirs", client);
                if let (Some(o), Some(t)) = (o, t) {
                    ours.push(o);
                    theirs.push(t);
                    ratios.push(o / t);
                } else {
                    complete = false;
                }
            }
            let lo = ratios.iter().copied().reduce(f64::min);
            let hi = ratios.iter().copied().reduce(f64::max);
            let m = median(&mut ratios);
            let fmt = |x: Option<f64>| x.map_or("failed".to_string(), |x| format!("{x:.0}"));
            let spread = match (lo, hi) {
                (Some(lo), Some(hi)) => format!("{lo:.2}-{hi:.2}x"),
                _ => "-".into(),
            };
            let met = match (m, row.target) {
                (Some(_), _) if row.busy.side(client) => "time, not work (busy-polls)",
                (Some(_), None) => "no target",
                (Some(m), Some(t)) if m <= t => "yes",
                (Some(_), Some(_)) => "no",
                (None, _) => "failed",
            };
            if let Some(k) = median(&mut idle_costs) {
                let _ =
                    writeln!(notes, "- {}, {side}: one idle spinning tick costs {k:.0} instructions (median).", row.id);
            }
            let _ = writeln!(
                out,
                "| {} | {side} | {} | {} | {} | {spread} | {} | {met} |",
                row.what,
                fmt(median(&mut ours)),
                fmt(median(&mut theirs)),
                m.map_or("failed".into(), |m| format!("{m:.2}x")),
                row.target.map_or("-".into(), |t| format!("<= {t:.2}x")),
            );
        }
    }
    if !notes.is_empty() {
        out.push('\n');
        out.push_str(&notes);
    }
    (out, complete)
}

/// The profiles the guest printed: `(name, base64 of the gzipped callgrind output)`.
pub fn profiles(output: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in output.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("@@cg-begin ") {
            current = Some((name.to_string(), String::new()));
        } else if line == "@@cg-end" {
            found.extend(current.take());
        } else if let Some((_, b64)) = current.as_mut() {
            if !line.is_empty() && line.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b)) {
                b64.push_str(line);
            }
        }
    }
    found
}

/// Decodes one profile into `dir/NAME.callgrind.out` (host `base64` and `gunzip`) and returns
/// `callgrind_annotate`'s self and inclusive tops.
pub fn annotate(dir: &Path, name: &str, b64: &str, top: usize) -> Result<(PathBuf, String)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::new(format!("cannot create {}: {e}", dir.display())))?;
    let path = dir.join(format!("{name}.callgrind.out"));
    let decoded = pipe("sh", &["-c", "base64 -d | gunzip"], b64.as_bytes())?;
    std::fs::write(&path, decoded).map_err(|e| Error::new(format!("cannot write {}: {e}", path.display())))?;
    let mut text = String::new();
    for (how, flag) in [("self", "--inclusive=no"), ("inclusive", "--inclusive=yes")] {
        let out = Command::new("callgrind_annotate")
            .args([flag, "--threshold=100"])
            .arg(&path)
            .output()
            .map_err(|e| Error::new(format!("callgrind_annotate: {e} (cargo xtask setup installs valgrind)")))?;
        let body = String::from_utf8_lossy(&out.stdout);
        let _ = writeln!(text, "-- {name}: {how}, top {top} (Ir, file:function)");
        // The function table: after its `Ir  file:function` header and the dashed line under it
        // (the first `Ir` line heads the program totals).
        let lines = body.lines().skip_while(|l| !l.contains("file:function")).skip(2);
        for l in lines.filter(|l| !l.trim().is_empty()).take(top) {
            let _ = writeln!(text, "{l}");
        }
        if let Some(total) = body.lines().find(|l| l.contains("PROGRAM TOTALS")) {
            let _ = writeln!(text, "{}", total.trim());
        }
    }
    Ok((path, text))
}

/// Runs `cmd args` with `input` on its stdin; its stdout.
fn pipe(cmd: &str, args: &[&str], input: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write as _;
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::new(format!("{cmd}: {e}")))?;
    let mut stdin = child.stdin.take().expect("piped");
    let data = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = child.wait_with_output().map_err(|e| Error::new(format!("{cmd}: {e}")))?;
    let _ = writer.join();
    if !out.status.success() {
        return Err(Error::new(format!("{cmd} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_parses_and_runs_every_row_every_round() {
        use std::io::Write as _;
        let s = script(2, &[]);
        let mut sh = Command::new("sh").arg("-n").stdin(Stdio::piped()).spawn().expect("sh runs");
        sh.stdin.take().expect("piped").write_all(s.as_bytes()).expect("written");
        assert!(sh.wait().expect("sh exits").success(), "sh -n found a syntax error");
        for r in 1..=2 {
            for row in ROWS {
                assert!(s.contains(&format!(" {} {r} ", row.id)), "round {r}: {}", row.id);
            }
        }
        for (row, side) in PROFILED {
            assert!(s.contains(&format!("@@cg-begin {row}-{side}")), "{row} {side}");
        }
    }

    #[test]
    fn per_message_is_the_difference_over_the_extra_messages() {
        let out = "noise\n\
                   @@ irow=echo64_event round=1 n=500 who=ours client=2000000 server=1900000\n\
                   @@ irow=echo64_event round=1 n=2500 who=ours client=4000000 server=3500000\n\
                   @@ irow=echo64_event round=1 n=500 who=theirs client=1000000 server=1000000\n\
                   @@ irow=echo64_event round=1 n=2500 who=theirs client=2000000 server=2000000\n\
                   @@ irow=blast64 round=1 n=5000 who=ours client= server=10\n";
        let c = parse(out);
        assert_eq!(c.len(), 5);
        assert_eq!(c[4].client, None, "an empty count is a failed one");
        assert_eq!(per_message(&c, "echo64_event", 1, "ours", true), Some(1000.0));
        assert_eq!(per_message(&c, "echo64_event", 1, "ours", false), Some(800.0));
        assert_eq!(per_message(&c, "echo64_event", 1, "theirs", true), Some(500.0));
        let (t, complete) = table(&c, 1, &[]);
        assert!(!complete);
        let client = t.lines().find(|l| l.contains("64 B round trip, event") && l.contains("| client |")).unwrap();
        assert!(client.contains("| 1000 | 500 | 2.00x | 2.00-2.00x | <= 1.30x | no |"), "{client}");
        let server = t.lines().find(|l| l.contains("64 B round trip, event") && l.contains("| server |")).unwrap();
        assert!(server.contains("| 800 | 500 | 1.60x |"), "{server}");
    }

    #[test]
    fn a_spinning_side_has_its_idle_ticks_subtracted() {
        // 1000 instructions a message, 50 an idle tick, a million of set-up: the client's
        // counts (then with the hold); the server's hold added too few idle ticks to say what
        // one costs.
        let out = "@@ irow=echo64_spin round=1 n=500 who=ours client=1600000 server= client_idle=2000 server_idle=\n\
                   @@ irow=echo64_spin round=1 n=500 who=ours client= server=1 client_idle=0 server_idle=100\n\
                   @@ irow=echo64_spin round=1 n=2500 who=ours client=3650000 server= client_idle=3000 server_idle=\n\
                   @@ irow=echo64_spin round=1 n=2500 who=ours client= server=2 client_idle=0 server_idle=200\n\
                   @@ irow=echo64_spin round=1 n=2500 who=hold client=4000000 server= client_idle=10000 server_idle=\n\
                   @@ irow=echo64_spin round=1 n=2500 who=hold client= server=3 client_idle=0 server_idle=250\n\
                   @@ irow=echo64_spin round=1 n=500 who=theirs client=1000000 server=1000000 client_idle= server_idle=\n\
                   @@ irow=echo64_spin round=1 n=2500 who=theirs client=2000000 server=2000000 client_idle= server_idle=\n";
        let c = parse(out);
        assert_eq!((c[0].client_idle, c[0].server_idle, c[6].client_idle), (Some(2000), None, None));
        assert_eq!(spin_per_message(&c, "echo64_spin", 1, true), Some((1000.0, 50.0)));
        assert_eq!(spin_per_message(&c, "echo64_spin", 1, false), None, "50 idle ticks apart is noise");
        // A count whose idle figure is missing (an echo that did not end well) is no count.
        let mut gone = c.clone();
        gone[4].client_idle = None;
        assert_eq!(spin_per_message(&gone, "echo64_spin", 1, true), None);
        // Idle ticks between the messages that cost more than a tenth of the difference: no
        // figure (it would be mostly the idle cost's).
        let mut waited = c.clone();
        waited[2].client_idle = Some(9000);
        assert_eq!(spin_per_message(&waited, "echo64_spin", 1, true), None);
        let (t, complete) = table(&c, 1, &["echo64_spin".into()]);
        assert!(!complete);
        let client = t.lines().find(|l| l.contains("spin mode") && l.contains("| client |")).unwrap();
        assert!(client.contains("| 1000 | 500 | 2.00x | 2.00-2.00x | - | no target |"), "{client}");
        assert!(t.contains("echo64_spin, client: one idle spinning tick costs 50 instructions"), "{t}");
    }

    #[test]
    fn a_busy_polling_side_gets_no_verdict() {
        let out = "@@ irow=blast64_c8 round=1 n=5000 who=ours client=1000000 server=1000000\n\
                   @@ irow=blast64_c8 round=1 n=25000 who=ours client=1100000 server=3000000\n\
                   @@ irow=blast64_c8 round=1 n=5000 who=theirs client=1000000 server=1000000\n\
                   @@ irow=blast64_c8 round=1 n=25000 who=theirs client=9000000 server=9000000\n\
                   @@ irow=blast64 round=1 n=5000 who=ours client=1000000 server=1000000\n\
                   @@ irow=blast64 round=1 n=25000 who=ours client=9000000 server=3000000\n\
                   @@ irow=blast64 round=1 n=5000 who=theirs client=1000000 server=1000000\n\
                   @@ irow=blast64 round=1 n=25000 who=theirs client=2000000 server=9000000\n";
        let (t, complete) = table(&parse(out), 1, &["blast64".into(), "blast64_c8".into()]);
        assert!(complete);
        let line = |what: &str, side: &str| {
            t.lines().find(|l| l.contains(what) && l.contains(&format!("| {side} |"))).unwrap().to_string()
        };
        // Our spinning client's 5 instructions a message against perftest's 400 is no "met".
        let c8 = line("8 connections", "client");
        assert!(c8.contains("| 0.01x |") && c8.ends_with("| time, not work (busy-polls) |"), "{c8}");
        assert!(line("8 connections", "server").ends_with("| time, not work (busy-polls) |"));
        // At one connection our client is judged; perftest's busy-polling server is not.
        let client = line("at the defaults (blast vs", "client");
        assert!(client.contains("| 8.00x |") && client.ends_with("| no |"), "{client}");
        assert!(line("at the defaults (blast vs", "server").ends_with("| time, not work (busy-polls) |"));
    }

    #[test]
    fn profiles_are_cut_out_of_the_console() {
        let out = "x\n@@cg-begin echo64_event-client\nH4sI\nAAAA==\n[  12.3] rxe: a kernel line\n@@cg-end\ny\n";
        assert_eq!(profiles(out), vec![("echo64_event-client".to_string(), "H4sIAAAA==".to_string())]);
    }
}
