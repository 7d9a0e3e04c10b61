//! `cargo xtask fuzz`: the coverage-guided fuzz targets of `fuzz/` (libFuzzer, through
//! libfuzzer-sys) on the stable toolchain, and the short run of each that `cargo xtask test`
//! makes.
//!
//! cargo-fuzz would pass `-Zsanitizer=address`, which needs a nightly compiler. The coverage
//! instrumentation itself is stable: the LLVM `sancov-module` pass and its options, given as
//! `RUSTFLAGS` ([`RUSTFLAGS`]). They go to the fuzz crate and its dependencies only (`--target`
//! keeps them off build scripts, which have no libFuzzer to link). The targets are safe Rust,
//! so AddressSanitizer would add little; debug assertions and overflow checks are on.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::bail;
use crate::util::{self, Context, Result};

/// The sanitizer-coverage flags cargo-fuzz passes (less `-Zsanitizer`), and `--cfg fuzzing`.
pub const RUSTFLAGS: &[&str] = &[
    "-Cpasses=sancov-module",
    "-Cllvm-args=-sanitizer-coverage-level=4",
    "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
    "-Cllvm-args=-sanitizer-coverage-pc-table",
    "-Cllvm-args=-sanitizer-coverage-trace-compares",
    "-Cllvm-args=-sanitizer-coverage-stack-depth",
    "--cfg",
    "fuzzing",
];

/// One fuzz target: a binary of `fuzz/`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    /// The binary's name (`fuzz/fuzz_targets/NAME.rs`).
    pub name: &'static str,
    /// Longest input libFuzzer generates.
    pub max_len: usize,
    /// Runs of the short run in `cargo xtask test`.
    pub bounded_runs: u64,
}

/// Every target, in the order they run.
pub const TARGETS: &[Target] = &[
    Target { name: "connect_info", max_len: 512, bounded_runs: 300_000 },
    Target { name: "state_machines", max_len: 4096, bounded_runs: 300_000 },
    Target { name: "flow", max_len: 2048, bounded_runs: 100_000 },
];

/// A run's limits: it stops at whichever comes first.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// Inputs to run.
    pub runs: Option<u64>,
    /// Seconds to run.
    pub secs: Option<u64>,
    /// libFuzzer's seed (random when `None`).
    pub seed: Option<u64>,
}

/// What one run of a target did, from libFuzzer's final lines.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// libFuzzer exited 0: no crash, no failed oracle, no timeout.
    pub ok: bool,
    /// Its exit status (None: killed by a signal).
    pub status: Option<i32>,
    /// Inputs executed.
    pub runs: Option<u64>,
    /// Average executions per second.
    pub exec_per_sec: Option<u64>,
    /// Coverage counters hit (`cov:`) and features (`ft:`).
    pub cov: Option<u64>,
    /// Features: coverage counters with their hit-count buckets, comparisons, stack depth.
    pub ft: Option<u64>,
    /// Inputs in the corpus at the end.
    pub corpus: Option<u64>,
    /// Where libFuzzer wrote the input that failed.
    pub crash: Option<String>,
    /// Wall time.
    pub secs: f64,
}

impl Outcome {
    /// Executions per second: libFuzzer's figure, or (when a run took less than the second
    /// libFuzzer counts in, and it says 0) runs over the wall time.
    pub fn rate(&self) -> Option<u64> {
        match (self.exec_per_sec, self.runs) {
            (Some(0), Some(runs)) if self.secs > 0.0 => Some((runs as f64 / self.secs) as u64),
            (rate, _) => rate,
        }
    }

    /// One line for a table: runs, exec/s, coverage, corpus.
    pub fn summary(&self) -> String {
        let n = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
        let mut s = format!(
            "{} runs, {} exec/s, cov {}, ft {}, corpus {}",
            n(self.runs),
            n(self.rate()),
            n(self.cov),
            n(self.ft),
            n(self.corpus)
        );
        if let Some(c) = &self.crash {
            s.push_str(&format!("; failing input: {c}"));
        }
        s
    }
}

/// Reads one of libFuzzer's lines into `o`.
fn parse_line(line: &str, o: &mut Outcome) {
    let field = |name: &str| -> Option<u64> {
        let at = line.find(name)? + name.len();
        line[at..].split_whitespace().next()?.split('/').next()?.parse().ok()
    };
    if line.starts_with('#') && (line.contains("DONE ") || line.contains("INITED ")) {
        o.cov = field("cov: ").or(o.cov);
        o.ft = field("ft: ").or(o.ft);
        o.corpus = field("corp: ").or(o.corpus);
    } else if let Some(v) = line.strip_prefix("stat::number_of_executed_units:") {
        o.runs = v.trim().parse().ok();
    } else if let Some(v) = line.strip_prefix("stat::average_exec_per_sec:") {
        o.exec_per_sec = v.trim().parse().ok();
    } else if let Some(rest) = line.split_once("Test unit written to ").map(|(_, r)| r) {
        o.crash = Some(rest.trim().to_string());
    }
}

fn fuzz_dir() -> PathBuf {
    util::workspace_root().join("fuzz")
}

/// The fuzz crate's target directory: `target/fuzz`, apart from the other builds (other flags).
fn build_dir() -> PathBuf {
    util::target_dir().join("fuzz")
}

/// The host's target triple, from `rustc -vV`.
fn host_triple() -> Result<String> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = util::output(Command::new(rustc).arg("-vV"))?;
    match out.lines().find_map(|l| l.strip_prefix("host: ")) {
        Some(h) => Ok(h.trim().to_string()),
        None => bail!("`rustc -vV` names no host triple:\n{out}"),
    }
}

/// Builds every target with coverage instrumentation; returns the directory of the binaries.
pub fn build() -> Result<PathBuf> {
    let triple = host_triple()?;
    let mut cmd = util::cargo();
    cmd.args(["build", "--release", "--bins", "--target", &triple, "--manifest-path"])
        .arg(fuzz_dir().join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", build_dir())
        .env("CARGO_ENCODED_RUSTFLAGS", RUSTFLAGS.join("\x1f"))
        .env_remove("RUSTFLAGS")
        .current_dir(fuzz_dir());
    // libfuzzer-sys compiles libFuzzer (C++) with the `cc` crate, which calls `c++`.
    if std::env::var_os("CXX").is_none() && util::which("c++").is_none() && util::which("clang++").is_some() {
        cmd.env("CXX", "clang++");
    }
    eprintln!("xtask: building the fuzz targets (coverage-instrumented, stable toolchain)");
    util::run(&mut cmd)?;
    Ok(build_dir().join(triple).join("release"))
}

/// Removes the instrumented build of [`build`] (its binaries and their dependencies), keeping
/// `target/fuzz/artifacts/`: used by CI, whose disk can be small, once the runs are done.
pub fn remove_build() {
    let Ok(entries) = std::fs::read_dir(build_dir()) else { return };
    for e in entries.flatten() {
        if e.file_name() != "artifacts" {
            let path = e.path();
            let gone = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            if let Err(err) = gone {
                eprintln!("xtask: could not remove {}: {err}", path.display());
            }
        }
    }
}

/// Runs `target` under `limits`: its corpus is `corpus` (written) plus the seeds in
/// `fuzz/corpus/NAME` (read); a failing input goes to `target/fuzz/artifacts/NAME/`.
/// `verbose` shows libFuzzer's whole output, otherwise only its start, its progress at every
/// power of two runs, its end and any failure.
pub fn run(bin_dir: &Path, target: &Target, limits: Limits, corpus: &Path, verbose: bool) -> Result<Outcome> {
    let artifacts = build_dir().join("artifacts").join(target.name);
    util::create_dir_all(corpus)?;
    util::create_dir_all(&artifacts)?;
    let mut cmd = Command::new(bin_dir.join(target.name));
    cmd.arg(corpus);
    let seeds = fuzz_dir().join("corpus").join(target.name);
    if seeds.is_dir() {
        cmd.arg(&seeds);
    }
    cmd.arg(format!("-max_len={}", target.max_len))
        .arg("-timeout=10")
        .arg("-rss_limit_mb=2048")
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()));
    if let Some(r) = limits.runs {
        cmd.arg(format!("-runs={r}"));
    }
    if let Some(s) = limits.secs {
        cmd.arg(format!("-max_total_time={s}"));
    }
    if let Some(s) = limits.seed {
        cmd.arg(format!("-seed={s}"));
    }
    eprintln!("xtask: fuzz {}: {}", target.name, util::describe(&cmd));
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context(|| format!("cannot run `{}`", util::describe(&cmd)))?;
    let mut o = Outcome::default();
    let mut failing = false;
    let reader = BufReader::new(child.stderr.take().expect("piped stderr"));
    for line in reader.split(b'\n') {
        let line = String::from_utf8_lossy(&line.context(|| format!("reading {}'s output", target.name))?).into_owned();
        parse_line(&line, &mut o);
        failing |= line.contains("panicked at") || line.contains("==ERROR") || line.contains("deadly signal");
        // libFuzzer's `pulse` lines come at every power of two runs: progress for long runs.
        let milestone = line.contains("INITED ")
            || line.contains("DONE ")
            || line.starts_with("Done ")
            || (line.starts_with('#') && line.contains("pulse "));
        if verbose || failing || milestone || line.contains("Test unit written") {
            eprintln!("  {line}");
        }
    }
    let status = child.wait().context(|| format!("waiting for {}", target.name))?;
    o.status = status.code();
    o.ok = status.success() && !failing;
    o.secs = start.elapsed().as_secs_f64();
    Ok(o)
}

/// The corpus a long run keeps growing between runs (`target/fuzz/corpus/NAME`).
pub fn work_corpus(target: &Target) -> PathBuf {
    build_dir().join("corpus").join(target.name)
}

/// Runs of each target in a long run, unless `--runs` or `--time` says otherwise.
pub const DEFAULT_RUNS: u64 = 10_000_000;

/// Seconds each target of the short run in `cargo xtask test` runs at most (on a busy machine
/// it stops here with fewer runs, and still passes).
pub const BOUNDED_SECS: u64 = 20;

/// A fresh, empty corpus for a short run: the seeds alone, the same every time.
pub fn scratch_corpus(target: &Target) -> Result<PathBuf> {
    let dir = build_dir().join("corpus-test").join(target.name);
    let _ = std::fs::remove_dir_all(&dir);
    util::create_dir_all(&dir)?;
    Ok(dir)
}

/// Looks up targets by name; every target when `names` is empty.
pub fn select(names: &[String]) -> Result<Vec<Target>> {
    if names.is_empty() {
        return Ok(TARGETS.to_vec());
    }
    names
        .iter()
        .map(|n| match TARGETS.iter().find(|t| t.name == n) {
            Some(t) => Ok(*t),
            None => {
                let all: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
                bail!("fuzz: no target {n:?} (targets: {})", all.join(", "))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzers_final_lines() {
        let mut o = Outcome::default();
        for l in [
            "#2\tINITED cov: 11 ft: 12 corp: 4/16b exec/s: 0 rss: 27Mb",
            "#100000\tDONE   cov: 822 ft: 2915 corp: 646/15821b lim: 128 exec/s: 50000 rss: 29Mb",
            "Done 100000 runs in 2 second(s)",
            "stat::number_of_executed_units: 100000",
            "stat::average_exec_per_sec:     50000",
        ] {
            parse_line(l, &mut o);
        }
        assert_eq!(
            (o.cov, o.ft, o.corpus, o.runs, o.exec_per_sec),
            (Some(822), Some(2915), Some(646), Some(100000), Some(50000))
        );
        assert_eq!(o.summary(), "100000 runs, 50000 exec/s, cov 822, ft 2915, corpus 646");
        o.exec_per_sec = Some(0);
        o.secs = 0.5;
        assert_eq!(o.rate(), Some(200000), "under a second: runs over the wall time");
        parse_line("artifact_prefix='x/'; Test unit written to x/crash-ba91", &mut o);
        assert_eq!(o.crash.as_deref(), Some("x/crash-ba91"));
    }

    /// A stand-in for a target binary that fails the way a libfuzzer-sys target does.
    #[test]
    fn a_failing_target_is_a_failure_with_its_input() {
        let dir = std::env::temp_dir().join(format!("xtask-fuzz-test-{}", std::process::id()));
        util::create_dir_all(&dir).unwrap();
        let target = Target { name: "xtask-test-failing-target", max_len: 8, bounded_runs: 1 };
        let script = "#!/bin/sh\n\
            echo '#2\tINITED cov: 5 ft: 6 corp: 1/1b exec/s: 0 rss: 27Mb' >&2\n\
            echo \"thread '<unnamed>' panicked at src/proto/fuzz.rs:1:1:\" >&2\n\
            echo '==1== ERROR: libFuzzer: deadly signal' >&2\n\
            echo \"artifact_prefix='a/'; Test unit written to a/crash-0123\" >&2\n\
            exit 77\n";
        let bin = dir.join(target.name);
        std::fs::write(&bin, script).unwrap();
        std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let o = run(&dir, &target, Limits { runs: Some(1), ..Limits::default() }, &dir.join("corpus"), false).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(build_dir().join("artifacts").join(target.name));
        assert!(!o.ok);
        assert_eq!(o.status, Some(77));
        assert_eq!((o.cov, o.crash.as_deref()), (Some(5), Some("a/crash-0123")));
    }

    #[test]
    fn selects_targets_by_name() {
        assert_eq!(select(&[]).unwrap().len(), TARGETS.len());
        assert_eq!(select(&["flow".to_string()]).unwrap()[0].name, "flow");
        assert!(select(&["nope".to_string()]).is_err());
    }
}
