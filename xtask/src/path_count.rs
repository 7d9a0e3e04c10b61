//! `cargo xtask path-count`: the host per-message path's instructions a message (issue 47),
//! counted by valgrind on the host (cachegrind, `--cache-sim=no`: exact and deterministic for a
//! given build), and checked against the committed budget ([`BUDGET_FILE`]).
//!
//! `benches/path_count.rs` (built with the cargo profile `perf`, as `bench` builds what it
//! measures, and the hidden feature `bench-internals`) runs one of `bench_internals`' paths N
//! times: `new` (`Path`, the ring design with every rule), `new-raw` (the same structures with
//! the old path's handler: caller memory, no pool) and `old` (`SlabPath`, the reactor's pieces
//! of today). Each runs at [`N_LO`] and [`N_HI`] messages; the difference of the two counts over
//! the extra messages is the figure, so set-up (the pool's first cluster, the process) drops out.
//!
//! `--check` fails (exit 1) when `new` is above the budget plus [`SLACK_PERCENT`] (`.ci/run`
//! runs it, so the gain cannot erode unnoticed); `--profile` also writes a callgrind profile of
//! `new` at the high count to `target/xtask/path-count/` and prints its top functions.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::{self, Error, Result};

/// The committed budget of `new`, in instructions a message (a number on its own line; `#`
/// starts a comment).
pub const BUDGET_FILE: &str = "benches/path_budget.txt";
/// How far above the budget `--check` lets a count go.
pub const SLACK_PERCENT: u64 = 5;
/// Messages of the two runs.
pub const N_LO: u64 = 10_000;
pub const N_HI: u64 = 60_000;
/// The paths counted, in the table's order: `(argument, what)`.
pub const PATHS: [(&str, &str); 3] = [
    ("old", "SlabPath: today's slab, key queues, three forms of a work request (issue 33's Path)"),
    ("new-raw", "Path with SlabPath's handler: the ring structures alone (caller memory, no pool)"),
    ("new", "Path: rings, gate, work requests in place, index pool and owner marks, guarded handler"),
];

/// The instruction total (`I refs`) in a cachegrind or callgrind report on stderr.
pub fn irefs(stderr: &str) -> Option<u64> {
    stderr.lines().rev().find_map(|l| {
        let (before, after) = l.split_once("refs:")?;
        if before.trim_end().rsplit(' ').next() != Some("I") {
            return None;
        }
        after.trim().replace(',', "").parse().ok()
    })
}

/// Instructions a message from the two totals, rounded to the nearest.
pub fn per_message(lo: u64, hi: u64) -> Option<u64> {
    let extra = N_HI - N_LO;
    hi.checked_sub(lo).map(|d| (d + extra / 2) / extra)
}

/// The budget in `text` (the first line that is a number, comments and blanks skipped).
pub fn parse_budget(text: &str) -> Option<u64> {
    text.lines().map(|l| l.split('#').next().unwrap_or("").trim()).find(|l| !l.is_empty())?.parse().ok()
}

/// The most `--check` accepts for `budget`.
pub fn limit(budget: u64) -> u64 {
    budget + (budget * SLACK_PERCENT).div_ceil(100)
}

/// Runs `bin which n` under cachegrind; its instruction total.
fn count(bin: &Path, which: &str, n: u64) -> Result<u64> {
    let mut cmd = Command::new("valgrind");
    cmd.args(["--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]).arg(bin).arg(which);
    cmd.arg(n.to_string());
    let out = cmd.output().map_err(|e| Error::new(format!("valgrind: {e} (cargo xtask setup installs it)")))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(Error::new(format!("`{}` failed: {}", util::describe(&cmd), stderr.trim())));
    }
    irefs(&stderr).ok_or_else(|| Error::new(format!("`{}` printed no instruction total", util::describe(&cmd))))
}

/// `cargo xtask path-count [--check] [--profile]`.
pub fn run(check: bool, profile: bool) -> Result<u8> {
    let bin = crate::project::build_path_count()?;
    println!(
        "host per-message path, instructions a message (cachegrind, ({N_HI} - {N_LO} messages) / {}):",
        N_HI - N_LO
    );
    let mut new = None;
    for (which, what) in PATHS {
        let (lo, hi) = (count(&bin, which, N_LO)?, count(&bin, which, N_HI)?);
        let n = per_message(lo, hi).ok_or_else(|| Error::new(format!("{which}: {hi} instructions < {lo}")))?;
        println!("  {which:<8} {n:>6}   {what}");
        if which == "new" {
            new = Some(n);
        }
    }
    let new = new.expect("PATHS has `new`");
    let path = util::workspace_root().join(BUDGET_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::new(format!("{}: {e}", path.display())))?;
    let budget = parse_budget(&text).ok_or_else(|| Error::new(format!("{}: no budget in it", path.display())))?;
    let over = new > limit(budget);
    println!(
        "budget ({BUDGET_FILE}): {budget}, checked at {} (+{SLACK_PERCENT} %): new {new} {}",
        limit(budget),
        if over { "is OVER it" } else { "is within it" }
    );
    if profile {
        profile_new(&bin)?;
    }
    if check && over {
        eprintln!(
            "xtask: path-count: the host path costs {new} instructions a message, above {BUDGET_FILE}'s {budget} + \
             {SLACK_PERCENT} %: find what grew (`cargo xtask path-count --profile`), or, for a cost a change means to \
             add, raise the budget in the same commit and say why"
        );
        return Ok(1);
    }
    Ok(0)
}

/// Profiles `new` at the high count with callgrind; prints `callgrind_annotate`'s self top.
fn profile_new(bin: &Path) -> Result<()> {
    let dir: PathBuf = util::xtask_dir().join("path-count");
    util::create_dir_all(&dir)?;
    let out = dir.join("new.callgrind.out");
    let mut cmd = Command::new("valgrind");
    cmd.args(["--tool=callgrind", "--dump-instr=yes"]).arg(format!("--callgrind-out-file={}", out.display()));
    cmd.arg(bin).args(["new", &N_HI.to_string()]);
    util::output(&mut cmd)?;
    let mut ann = Command::new("callgrind_annotate");
    ann.args(["--inclusive=no", "--threshold=99"]).arg(&out);
    let text = util::output(&mut ann)?;
    println!("callgrind profile of `new` at {N_HI} messages: {} (self cost, top):", out.display());
    for l in text.lines().skip_while(|l| !l.contains("file:function")).skip(2).take(25) {
        println!("{l}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_is_read_from_valgrinds_summary() {
        let stderr = "==1== Cachegrind, a high-precision tracing profiler\n==1== \n==1== I   refs:      16,483,521\n";
        assert_eq!(irefs(stderr), Some(16_483_521));
        assert_eq!(irefs("==1== I refs: 12\n"), Some(12));
        assert_eq!(irefs("no summary"), None);
        assert_eq!(irefs("==1== D   refs: 5\n"), None, "data references are not instructions");
    }

    #[test]
    fn a_message_costs_the_difference_over_the_extra_messages() {
        assert_eq!(per_message(16_483_521, 89_383_535), Some(1458));
        assert_eq!(per_message(10, 5), None);
    }

    #[test]
    fn the_budget_is_the_first_number_and_the_check_allows_five_percent() {
        assert_eq!(parse_budget("# comment\n\n1460  # the ring path\n"), Some(1460));
        assert_eq!(parse_budget("# nothing\n"), None);
        assert_eq!(parse_budget("abc\n"), None);
        assert_eq!(limit(1460), 1533);
        assert_eq!(limit(600), 630);
        assert_eq!(limit(1), 2, "rounded up");
    }
}
