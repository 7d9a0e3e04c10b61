//! `cargo xtask test`: the host's unit tests and a short run of each fuzz target, then the root
//! crate's tests that need RDMA (the library's ignored unit tests and every integration-test
//! binary) in one VM boot per soft RDMA device, Soft-RoCE (`rxe0`) then Soft-iWARP (`siw0`) (or
//! on this host when it has an active RDMA device), then the two-VM cases in one linked pair of
//! VMs per device (`cargo xtask vm2 --cases`; not on a host with RDMA hardware).
//!
//! A test that does not apply to iWARP says so by name (`util::not_on_iwarp` in
//! `tests/util/mod.rs`): it prints [`libtest::NOT_APPLICABLE`] and returns early; the runner
//! counts it as `n/a` in its row and lists it after the table. The report ends with what
//! failed, each test with why (`libtest.rs` reads libtest's output).

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::fuzz;
use crate::guest::{self, Device, Guest};
use crate::host;
use crate::project::{self, Binary};
use crate::setup;
use crate::util::{self, shell_quote, Error, Result};
use crate::vm::{self, Boot, Event, Outcome};
use crate::vm2;

mod libtest;
use libtest::{last_result, parse_failures, parse_not_applicable, parse_result_line, Counts, Failure};

/// Options of `cargo xtask test`.
pub struct Options {
    /// Watchdog per integration-test binary.
    pub per_binary: Duration,
    /// Kill the whole VM after this long (default: boot allowance + the watchdogs' sum).
    pub vm_timeout: Option<Duration>,
    /// Show the VM's whole console.
    pub verbose: bool,
    /// `--device`: run the VM stages on this soft RDMA device only (default: rxe, then siw).
    pub device: Option<Device>,
}

impl Options {
    /// The devices the VM stages run on, in order.
    fn devices(&self) -> Vec<Device> {
        match self.device {
            Some(d) => vec![d],
            None => vec![Device::Rxe, Device::Siw],
        }
    }
}

/// The first line of `console` that says the guest kernel failed (an oops or a BUG; not a
/// warning), without its timestamp.
fn kernel_failure(console: &str) -> Option<String> {
    const SIGNS: [&str; 5] =
        ["kernel BUG at", "BUG: unable to handle", "general protection fault", "Kernel panic - not syncing", "Oops: "];
    console.lines().find(|l| SIGNS.iter().any(|s| l.contains(s))).map(|l| {
        let l = l.trim();
        // "[   21.083221] kernel BUG at ...": the part after the timestamp.
        match l.strip_prefix('[').and_then(|r| r.split_once("] ")) {
            Some((_, rest)) => rest.trim().to_string(),
            None => l.to_string(),
        }
    })
}

/// One line of the final report.
#[cfg_attr(test, derive(Clone))]
struct Row {
    place: &'static str,
    name: String,
    counts: Option<Counts>,
    status: Option<i32>,
    killed: bool,
    note: Option<String>,
    secs: Option<f64>,
    /// The tests that reported themselves not applicable (`(test, reason)`); libtest counts
    /// them among the passed.
    not_applicable: Vec<(String, String)>,
    /// The tests libtest listed as failed (its `failures:` list).
    failed_tests: Vec<Failure>,
    /// A binary on siw that failed and passed in a second boot, or a two-VM case that failed
    /// and passed in a second pair: what failed in the first (reported after the table, never
    /// hidden).
    second_boot: Vec<String>,
}

impl Row {
    /// A binary of a boot that ended before the binary started.
    fn never_ran(&self) -> bool {
        self.counts.is_none() && self.note.as_deref() == Some(NEVER_RAN)
    }

    /// Failures, counting a crash, a kill or a non-zero exit without failed tests as one.
    fn failed(&self) -> u64 {
        let reported = self.counts.map_or(0, |c| c.failed);
        let bad_exit = self.killed || self.status != Some(0);
        if bad_exit && reported == 0 {
            1
        } else {
            reported
        }
    }

    fn render(&self) -> String {
        let mut s = format!("  {:<7} {:<28}", self.place, self.name);
        match self.counts {
            Some(c) => {
                let _ = write!(s, " {} passed, {} failed, {} ignored", c.passed, c.failed, c.ignored);
            }
            None => s.push_str(" no test result"),
        }
        if !self.not_applicable.is_empty() {
            let _ = write!(s, ", {} n/a", self.not_applicable.len());
        }
        if self.killed {
            s.push_str("; KILLED by the watchdog");
        } else {
            match self.status {
                Some(0) => {}
                Some(code) => {
                    let _ = write!(s, "; {}", exit_status(code));
                }
                None => s.push_str("; did not run to the end"),
            }
        }
        if let Some(t) = self.secs {
            let _ = write!(s, " [{t:.1} s]");
        }
        if let Some(n) = &self.note {
            let _ = write!(s, " ({n})");
        }
        if self.failed() > 0 {
            s.push_str("  <-- FAILED");
        }
        s
    }
}

/// `cargo test --profile vm --workspace` on the host, streamed; one row with the summed counts.
fn host_unit_tests() -> Result<Row> {
    let mut cmd = project::host_test_command();
    eprintln!("xtask: host tests: cargo test --profile {} --workspace --no-fail-fast", project::PROFILE);
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Error::new(format!("cannot run `{}`: {e}", util::describe(&cmd))))?;
    let mut total = Counts::default();
    let mut any = false;
    let out = std::io::stdout();
    let mut reader = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut line = Vec::new();
    // All of it, for the failed tests' names and panics (a few hundred KiB).
    let mut output = Vec::new();
    while reader.read_until(b'\n', &mut line).map(|n| n > 0).unwrap_or(false) {
        {
            let mut o = out.lock();
            let _ = o.write_all(&line);
            let _ = o.flush();
        }
        if let Some(c) = parse_result_line(&String::from_utf8_lossy(&line)) {
            total += c;
            any = true;
        }
        output.extend_from_slice(&line);
        line.clear();
    }
    let status = child.wait().map_err(|e| Error::new(format!("waiting for cargo test: {e}")))?;
    if !status.success() && total.failed == 0 {
        return Err(Error::new(format!(
            "`{}` failed ({status}) without a failing test: a build error? (see above)",
            util::describe(&cmd)
        )));
    }
    Ok(Row {
        place: "host",
        name: "cargo test --workspace".into(),
        counts: any.then_some(total),
        status: status.code(),
        killed: false,
        note: None,
        secs: Some(start.elapsed().as_secs_f64()),
        not_applicable: Vec::new(),
        failed_tests: parse_failures(&output),
        second_boot: Vec::new(),
    })
}

/// A short, seeded run of each fuzz target (coverage-guided, `fuzz::TARGETS`' bounded runs from
/// the seed corpus): one row each, one test passed or failed.
fn fuzz_rows() -> Vec<Row> {
    let row = |name: String, ok: bool, status: Option<i32>, note: String, secs: Option<f64>| Row {
        place: "host",
        name,
        counts: Some(Counts { passed: u64::from(ok), failed: u64::from(!ok), ignored: 0 }),
        status,
        killed: false,
        note: Some(note),
        secs,
        not_applicable: Vec::new(),
        failed_tests: Vec::new(),
        second_boot: Vec::new(),
    };
    let bins = match fuzz::build() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            return vec![row("fuzz targets".into(), false, None, "the fuzz crate did not build".into(), None)];
        }
    };
    let rows = fuzz::TARGETS
        .iter()
        .map(|t| {
            let limits = fuzz::Limits { runs: Some(t.bounded_runs), secs: Some(fuzz::BOUNDED_SECS), seed: Some(1) };
            let name = format!("fuzz {}", t.name);
            match fuzz::scratch_corpus(t).and_then(|c| fuzz::run(&bins, t, limits, &c, false)) {
                Ok(o) => row(name, o.ok, o.status, o.summary(), Some(o.secs)),
                Err(e) => row(name, false, None, e.to_string(), None),
            }
        })
        .collect();
    // A CI machine's disk can be small (one run died of ENOSPC while building the VM's tests):
    // the instrumented build (~400 MiB) is not needed again there. Failing inputs stay.
    if std::env::var_os("CI").is_some() {
        fuzz::remove_build();
    }
    rows
}

/// Test binaries that get more than the per-binary watchdog, and how many times it: `stream`
/// moves 1 GiB each way through a TCP proxy and an RDMA stream (issue 31), 110-200 s alone
/// under TCG, beside its other tests (about 50 s).
const LONG_BINARIES: &[(&str, u32)] = &[("stream", 3)];

/// The watchdog of the binary `name`: `per_binary`, or a multiple of it ([`LONG_BINARIES`]).
fn watchdog(name: &str, per_binary: Duration) -> Duration {
    let times = LONG_BINARIES.iter().find(|(n, _)| *n == name).map_or(1, |(_, k)| *k);
    per_binary.saturating_mul(times)
}

/// The in-VM runner: each binary, with its filter, under busybox `timeout` (its
/// [`watchdog`]), between begin/end markers.
fn runner_script(nonce: &str, tests: &[(&Binary, &str)], per_binary: Duration) -> String {
    let begin = guest::echo_marker(nonce, "begin $name");
    let end = guest::echo_marker(nonce, "end $name rc=$rc killed=$killed secs=$secs");
    let mut s = format!(
        r#"# cargo xtask test: every test binary, one at a time, with a watchdog of T seconds.
run_test() {{
    name=$1
    T=$2
    filter=$3
    {begin}
    cd /tmp
    start=$(date +%s)
    # glibc's MALLOC_PERTURB_ overwrites freed memory: a use after free fails loudly.
    MALLOC_PERTURB_=165 timeout -s KILL $T "$BIN/$name" $filter --test-threads=1 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    killed=0
    if [ $rc -eq 137 ] && [ $secs -ge $T ]; then killed=1; fi
    {end}
}}
"#
    );
    for (b, filter) in tests {
        let t = watchdog(&b.name, per_binary).as_secs().max(1);
        let _ = writeln!(s, "run_test {} {t} {filter}", shell_quote(&b.name));
    }
    s.push_str("exit 0\n");
    s
}

/// Parses `end NAME rc=N killed=0|1 secs=N`.
fn parse_end(marker: &str) -> Option<(String, i32, bool, f64)> {
    let rest = marker.strip_prefix("end ")?;
    let mut it = rest.split_whitespace();
    let name = it.next()?.to_string();
    let (mut rc, mut killed, mut secs) = (None, false, 0.0);
    for kv in it {
        match kv.split_once('=')? {
            ("rc", v) => rc = v.parse().ok(),
            ("killed", v) => killed = v == "1",
            ("secs", v) => secs = v.parse().unwrap_or(0.0),
            _ => {}
        }
    }
    Some((name, rc?, killed, secs))
}

/// The place of the single-VM stage's rows on `device`.
fn vm_place(device: Device) -> &'static str {
    match device {
        Device::Rxe => "vm rxe",
        Device::Siw => "vm siw",
    }
}

/// The place of the two-VM stage's rows on `device`.
fn vm2_place(device: Device) -> &'static str {
    match device {
        Device::Rxe => "vm2 rxe",
        Device::Siw => "vm2 siw",
    }
}

/// The single-VM stage on `device`: every RDMA test binary in one boot whose `$RDMA_DEV`,
/// `$RDMA_ADDR`... name `device`; a row per binary.
fn vm_tests(kernel: &setup::Kernel, bins: &project::Binaries, opts: &Options, device: Device) -> Result<Vec<Row>> {
    let tests = bins.rdma_tests();
    if device != Device::Siw {
        let rows = vm_tests_in_one_boot(kernel, bins, opts, device, &tests)?;
        if !rows.iter().all(Row::never_ran) {
            return Ok(rows);
        }
        // No test ran: the boot failed before its runner started (a boot that hung: the
        // error above says). Nothing was tried, so one more boot hides no test's failure;
        // each row says it came from that second boot.
        eprintln!("xtask: [{}] the boot ran no test; once more in a fresh boot", vm_place(device));
        let mut rows = vm_tests_in_one_boot(kernel, bins, opts, device, &tests)?;
        for r in &mut rows {
            r.note.get_or_insert_with(|| "second boot; the first ran no test (see its error above)".into());
        }
        return Ok(rows);
    }
    // On siw a boot of its own per binary: Soft-iWARP's kernel defects (FAULTS.md, "iWARP":
    // a listener closed under rdma_cm, soft lockups in its workers after device removal and
    // connection churn) can outlive the test that provoked them and fail the next binary.
    eprintln!("xtask: on siw each test binary gets a VM boot of its own (FAULTS.md, \"iWARP\")");
    // A binary that fails gets one more boot (at most SIW_SECOND_BOOTS in a run): some of those
    // defects are races no test can steer clear of. A pass in the second boot is listed after
    // the table with what failed in the first; a second failure fails the run.
    let mut rows = Vec::new();
    let mut second_boots = 0;
    for t in &tests {
        let mut got = vm_tests_in_one_boot(kernel, bins, opts, device, std::slice::from_ref(t))?;
        let failed: Vec<String> = got.iter().filter(|r| r.failed() > 0).flat_map(row_failures).collect();
        if !failed.is_empty() && second_boots < SIW_SECOND_BOOTS {
            second_boots += 1;
            eprintln!(
                "xtask: [{}] {} failed ({}); once more in a fresh boot (Soft-iWARP's kernel defects, FAULTS.md)",
                vm_place(device),
                t.0.name,
                failed.join(", ")
            );
            got = vm_tests_in_one_boot(kernel, bins, opts, device, std::slice::from_ref(t))?;
            for r in &mut got {
                r.note = Some(format!("second boot; the first failed: {}", failed.join(", ")));
                r.second_boot = failed.clone();
            }
        }
        rows.extend(got);
    }
    Ok(rows)
}

/// The note of a row whose binary did not start ([`Row::never_ran`]).
const NEVER_RAN: &str = "never ran";

/// How many binaries may get a second boot on siw in one run (`vm_tests`).
const SIW_SECOND_BOOTS: usize = 3;

/// `exit status CODE`, with the signal when CODE is one's (128 + N).
fn exit_status(code: i32) -> String {
    if code > 128 {
        format!("exit status {code} (signal {})", code - 128)
    } else {
        format!("exit status {code}")
    }
}

/// What a failed row says of itself when libtest named none of its failures: its note (a
/// binary that never ran, a second boot), a kill, its unnamed failures, or its exit.
fn row_description(r: &Row) -> String {
    match (&r.note, r.counts) {
        (Some(note), _) => note.clone(),
        _ if r.killed => "killed by the watchdog".into(),
        (None, Some(c)) if c.failed > 0 => format!("{} failed, not named in its output", c.failed),
        (None, _) => match r.status {
            Some(0) => "no test result".into(),
            Some(code) => exit_status(code),
            None => "did not run to the end".into(),
        },
    }
}

/// What failed in a row, for a note: the names in libtest's list, or the row's name and
/// [`row_description`] when it has none (a crash, a kill, a binary that never ran).
fn row_failures(r: &Row) -> Vec<String> {
    if r.failed_tests.is_empty() {
        vec![format!("{} ({})", r.name, row_description(r))]
    } else {
        r.failed_tests.iter().map(|f| f.name.clone()).collect()
    }
}

/// The list after the results table of the binaries that passed on siw only in a second
/// boot and the two-VM cases that passed only in a second pair, with what failed in the first,
/// or `None` when there are none.
fn second_boot_section(rows: &[Row]) -> Option<String> {
    let mut s = String::new();
    for r in rows.iter().filter(|r| !r.second_boot.is_empty() && r.failed() == 0) {
        let _ = writeln!(s, "  {} {}: failed in the first: {}", r.place, r.name, r.second_boot.join(", "));
    }
    (!s.is_empty())
        .then(|| format!("xtask: passed in a second boot or pair of VMs (see the first one's output above)\n{s}"))
}

/// The list closing the results of what failed: each failed row's tests with why
/// ([`Failure::describe`]) or its own description ([`row_description`]), or `None` when
/// nothing failed. Printed last, so
/// that the end of a long log (all a CI page may show) says which test failed and why.
fn failed_section(rows: &[Row]) -> Option<String> {
    let mut s = String::new();
    for r in rows.iter().filter(|r| r.failed() > 0) {
        if r.failed_tests.is_empty() {
            let _ = writeln!(s, "  {} {}: {}", r.place, r.name, row_description(r));
            continue;
        }
        for f in &r.failed_tests {
            let _ = writeln!(s, "  {} {}: {}", r.place, r.name, f.describe());
        }
        // A crashed binary lists nothing (on the host, cargo says so on stderr): its failures
        // are not among the names.
        let unnamed = r.failed().saturating_sub(r.failed_tests.len() as u64);
        if unnamed > 0 {
            let _ = writeln!(s, "  {} {}: and {unnamed} more, not named in its output", r.place, r.name);
        }
    }
    (!s.is_empty()).then(|| format!("xtask: FAILED (see each one's output above)\n{s}"))
}

/// Runs `tests` one after the other in one VM boot on `device`, a row each.
fn vm_tests_in_one_boot(
    kernel: &setup::Kernel,
    bins: &project::Binaries,
    opts: &Options,
    device: Device,
    tests: &[(&project::Binary, &'static str)],
) -> Result<Vec<Row>> {
    let place = vm_place(device);
    let nonce = vm::nonce();
    let script = runner_script(&nonce, tests, opts.per_binary);
    let initrd = guest::pack(
        kernel,
        bins,
        &Guest { nonce: &nonce, script, env: &[], link: None, profiling: false, valgrind: false, device },
    )?;
    let accel = vm::choose_accel(kernel)?;
    let timeout = opts.vm_timeout.unwrap_or(tests.iter().fold(Duration::from_secs(180), |t, (b, _)| {
        t.saturating_add(watchdog(&b.name, opts.per_binary)).saturating_add(Duration::from_secs(5))
    }));
    eprintln!(
        "xtask: running {} test binar{} in the VM on {} (watchdog {} s each{}, VM timeout {} s)",
        tests.len(),
        if tests.len() == 1 { "y" } else { "ies" },
        device.name(),
        opts.per_binary.as_secs(),
        tests
            .iter()
            .filter(|(b, _)| watchdog(&b.name, opts.per_binary) != opts.per_binary)
            .map(|(b, _)| format!(", {} {} s", b.name, watchdog(&b.name, opts.per_binary).as_secs()))
            .collect::<String>(),
        timeout.as_secs()
    );
    // A guest kernel that fails (an oops, a BUG) takes the test bed with it: the VM is stopped
    // at once, not left to the watchdog, and the failure named (Soft-iWARP's listener defect
    // once hung a boot for the whole 300 s: FAULTS.md, "a signal while connecting").
    let kernel_failed = AtomicBool::new(false);
    let boot = Boot {
        kernel: &kernel.image,
        initrd: initrd.path(),
        nonce: &nonce,
        timeout,
        verbose: opts.verbose,
        accel,
        report_boot: true,
        label: "",
        nics: Vec::new(),
        stop: Some(&kernel_failed),
    };
    let mut rows: Vec<Row> = Vec::new();
    let mut current: Option<(String, Vec<u8>, Instant)> = None;
    let mut failure: Option<String> = None;
    let mut recent: Vec<u8> = Vec::new();
    let stdout = std::io::stdout();
    let result = vm::run(&boot, &mut |ev| match ev {
        Event::Console(t) => {
            let mut o = stdout.lock();
            let _ = o.write_all(t);
            let _ = o.flush();
        }
        Event::Output(t) => {
            let mut o = stdout.lock();
            let _ = o.write_all(t);
            let _ = o.flush();
            if let Some((_, buf, _)) = current.as_mut() {
                buf.extend_from_slice(t);
            }
            if failure.is_none() {
                // The last few lines, so a message split between two reads is still seen.
                recent.extend_from_slice(t);
                let older = recent.len().saturating_sub(4096);
                recent.drain(..older);
                if let Some(line) = kernel_failure(&String::from_utf8_lossy(&recent)) {
                    eprintln!("\nxtask: the guest kernel failed ({line}): stopping the VM");
                    failure = Some(line);
                    kernel_failed.store(true, Ordering::Relaxed);
                }
            }
        }
        Event::Marker(m) => {
            if let Some(name) = m.strip_prefix("begin ") {
                let filter = tests.iter().find(|(b, _)| b.name == name).map_or("", |(_, f)| *f);
                eprintln!("xtask: [{place}] {name} {filter} --test-threads=1");
                current = Some((name.to_string(), Vec::new(), Instant::now()));
            } else if let Some((name, rc, killed, vm_secs)) = parse_end(m) {
                let (output, secs) = current
                    .take()
                    .filter(|(n, _, _)| *n == name)
                    .map(|(_, b, t)| (b, t.elapsed().as_secs_f64()))
                    .unwrap_or((Vec::new(), vm_secs));
                if killed {
                    eprintln!(
                        "xtask: [{place}] {name}: killed by the {} s watchdog",
                        watchdog(&name, opts.per_binary).as_secs()
                    );
                }
                rows.push(Row {
                    place,
                    name,
                    counts: last_result(&output),
                    status: Some(rc),
                    killed,
                    note: None,
                    secs: Some(secs),
                    not_applicable: parse_not_applicable(&output),
                    failed_tests: parse_failures(&output),
                    second_boot: Vec::new(),
                });
            }
        }
    });
    let problem = match result {
        Ok(Outcome::Exited(0)) => None,
        Ok(Outcome::Exited(code)) => Some(format!("the in-VM runner exited with status {code}")),
        Ok(Outcome::TimedOut) => Some(format!("the VM was killed at the {} s VM timeout", timeout.as_secs())),
        Ok(Outcome::Stopped) => Some(match &failure {
            Some(line) => format!("the guest kernel failed ({line}); the VM was stopped"),
            None => "the VM was stopped".into(),
        }),
        Err(e) => Some(e.to_string()),
    };
    if let Some(p) = &problem {
        eprintln!("xtask: error: {p}");
    }
    // A binary that never reported counts as failed.
    for (b, _) in tests {
        if !rows.iter().any(|r| r.name == b.name) {
            let running = current.as_ref().is_some_and(|(n, _, _)| *n == b.name);
            rows.push(Row {
                place,
                name: b.name.clone(),
                counts: None,
                status: None,
                killed: false,
                note: Some(match (&failure, running) {
                    (Some(line), true) => format!("the guest kernel failed while it ran: {line}"),
                    (None, true) => "the VM stopped while it ran".into(),
                    (_, false) => NEVER_RAN.into(),
                }),
                secs: None,
                not_applicable: Vec::new(),
                failed_tests: Vec::new(),
                second_boot: Vec::new(),
            });
        }
    }
    Ok(rows)
}

/// The two-VM stage on `device`: every case of [`vm2::CASES`] in one linked pair, a row per
/// case. Every case that fails gets one more run ([`vm2_stage`]): the first alone in a fresh
/// pair, the others together in another. A kernel RDMA stack that one case left wedged fails
/// the cases after it too (CI saw every rdma_cm connect between the VMs time out after
/// `reconnect-restart`, and a local run after `reconnect-link`, while their IP traffic went
/// on), and the first that failed, run apart, cannot fail the others again. A pass there is
/// listed after the table with what failed in the first pair (never hidden); a second failure
/// fails the run.
fn vm2_cases(kernel: &setup::Kernel, bins: &project::Binaries, opts: &Options, device: Device) -> Vec<Row> {
    let place = vm2_place(device);
    eprintln!(
        "xtask: the two-VM stage on {}: {} cases in one pair of linked VMs (alone: cargo xtask vm2 --cases --device {})",
        device.name(),
        vm2::CASES.len(),
        device.name()
    );
    let o = vm2::PairOptions { timeout: vm2::CASES_TIMEOUT, verbose: opts.verbose, env: &[], device };
    vm2_stage(place, device.name(), |cases| vm2::run_cases(kernel, bins, cases, &o))
}

/// [`vm2_cases`]' rows from `run`, which runs the cases it is given in one fresh pair.
fn vm2_stage(
    place: &'static str,
    device: &str,
    mut run: impl FnMut(&[&'static str]) -> Result<Vec<vm2::CaseResult>>,
) -> Vec<Row> {
    let start = Instant::now();
    let results = match run(vm2::CASES) {
        Ok(results) => results,
        Err(e) => {
            eprintln!("xtask: error: the two-VM stage on {device}: {e}");
            return vec![Row {
                place,
                name: "two-VM cases".into(),
                counts: None,
                status: None,
                killed: false,
                note: Some(e.to_string()),
                secs: Some(start.elapsed().as_secs_f64()),
                not_applicable: Vec::new(),
                failed_tests: Vec::new(),
                second_boot: Vec::new(),
            }];
        }
    };
    let mut rows: Vec<Row> = results.into_iter().map(|r| vm2_row(place, r)).collect();
    // Every failed case runs once more, and a second failure fails the run. The first that
    // failed goes alone; the others go together, in a second fresh pair. A pair's stack that
    // one case wedges fails the cases after it too (a local CI run saw reconnect-link,
    // reconnect-restart and peer-killed fail so: every connect from B to A timed out once A's
    // link had gone down and up in reconnect-link), and the first that failed is the likeliest
    // to have wedged it: run apart, it cannot fail the others again.
    let failed: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].failed() > 0).collect();
    let groups: Vec<&[usize]> = match failed.split_first() {
        None => Vec::new(),
        Some((first, [])) => vec![std::slice::from_ref(first)],
        Some((first, rest)) => vec![std::slice::from_ref(first), rest],
    };
    for (n, group) in groups.into_iter().enumerate() {
        let cases: Vec<&'static str> =
            group.iter().filter_map(|&i| vm2::CASES.iter().copied().find(|c| *c == rows[i].name)).collect();
        let (pair, with) =
            if n == 0 { ("a fresh pair of its own", "") } else { ("one fresh pair", ", with the other failed cases") };
        for &i in group {
            let first = rows[i].note.as_deref().unwrap_or("no result");
            eprintln!(
                "xtask: [{place}] {} failed ({first}); once more in {pair} (alone: cargo xtask vm2 --device {device} --cases {})",
                rows[i].name, rows[i].name
            );
        }
        match run(&cases) {
            Ok(results) => {
                for r in results {
                    let Some(i) = group.iter().copied().find(|&i| rows[i].name == r.name) else { continue };
                    let first = rows[i].note.clone().unwrap_or_else(|| "no result".into());
                    let mut row = vm2_row(place, r);
                    let note = row.note.take().unwrap_or_default();
                    row.note = Some(format!("second pair{with}; the first failed: {first}; {note}"));
                    row.second_boot = vec![first];
                    rows[i] = row;
                }
            }
            Err(e) => eprintln!("xtask: error: [{place}] {} in a second pair: {e}", cases.join(", ")),
        }
    }
    rows
}

/// A two-VM case's row.
fn vm2_row(place: &'static str, r: vm2::CaseResult) -> Row {
    // A case whose test does not apply on this transport reports `n/a on DEV: REASON`
    // (vm2_cases.sh): listed with the single VM's.
    let not_applicable = r
        .detail
        .split("n/a on ")
        .nth(1)
        .and_then(|rest| rest.split_once(": "))
        .map(|(_, why)| vec![(r.name.clone(), why.split("; ").next().unwrap_or(why).to_string())])
        .unwrap_or_default();
    Row {
        place,
        name: r.name,
        counts: Some(Counts { passed: u64::from(r.passed), failed: u64::from(!r.passed), ignored: 0 }),
        status: Some(if r.passed { 0 } else { 1 }),
        killed: false,
        note: Some(r.detail),
        secs: r.secs,
        not_applicable,
        failed_tests: Vec::new(),
        second_boot: Vec::new(),
    }
}

fn host_rdma_tests(bins: &project::Binaries, opts: &Options) -> Result<Vec<Row>> {
    let addr = host::rdma_addr()?;
    let bin = host::bin_dir(bins)?;
    let tmp = util::xtask_dir().join("host-tmp");
    util::create_dir_all(&tmp)?;
    eprintln!("xtask: using this host's RDMA device: running the RDMA tests here (RDMA_ADDR={addr})");
    let mut rows = Vec::new();
    for (b, filter) in bins.rdma_tests() {
        eprintln!("xtask: [host] {} {filter} --test-threads=1", b.name);
        let mut cmd = std::process::Command::new(&b.path);
        cmd.args([filter, "--test-threads=1"]).current_dir(&tmp);
        host::env(&mut cmd, &bin, &addr);
        let mut counts = None;
        let mut output = String::new();
        let w = host::run_watched(&mut cmd, watchdog(&b.name, opts.per_binary), &mut |l| {
            if let Some(c) = parse_result_line(l) {
                counts = Some(c);
            }
            output.push_str(l);
            output.push('\n');
        })?;
        let status = w.status.map(|s| s.code().unwrap_or_else(|| 128 + signal_of(s)));
        rows.push(Row {
            place: "host",
            name: b.name.clone(),
            counts,
            status,
            killed: w.killed,
            note: None,
            secs: Some(w.elapsed.as_secs_f64()),
            not_applicable: Vec::new(),
            failed_tests: parse_failures(output.as_bytes()),
            second_boot: Vec::new(),
        });
    }
    Ok(rows)
}

fn signal_of(s: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.signal().unwrap_or(0)
}

/// The list after the results table of the tests that did not apply (`binary: test: reason`),
/// or `None` when there are none. Only siw's rows can have any (`util::not_on_iwarp`).
fn not_applicable_section(rows: &[Row]) -> Option<String> {
    let mut s = String::new();
    for r in rows {
        for (test, reason) in &r.not_applicable {
            let _ = writeln!(s, "  {}: {test}: {reason}", r.name);
        }
    }
    (!s.is_empty()).then(|| format!("xtask: not applicable on siw (iWARP)\n{s}"))
}

/// Runs the suite; returns the process exit status (0 only when nothing failed).
pub fn run(opts: &Options) -> Result<i32> {
    let on_host = host::use_host_rdma()?;
    let kernel = if on_host { None } else { Some(setup::ensure(false)?) };
    if on_host {
        // Fail early, before the long build, when RDMA_ADDR is missing.
        host::rdma_addr()?;
    }
    let mut rows = vec![host_unit_tests()?];
    rows.extend(fuzz_rows());
    let bins = project::build()?;
    if bins.rdma_tests().is_empty() {
        eprintln!("xtask: the root crate has no tests that need RDMA: nothing to run with RDMA");
    } else if let Some(kernel) = &kernel {
        for device in opts.devices() {
            rows.extend(vm_tests(kernel, &bins, opts, device)?);
        }
        for device in opts.devices() {
            rows.extend(vm2_cases(kernel, &bins, opts, device));
        }
    } else {
        if opts.device.is_some() {
            eprintln!("xtask: --device chooses the VM's device; the RDMA tests run on this host's own device");
        }
        rows.extend(host_rdma_tests(&bins, opts)?);
        eprintln!("xtask: the two-VM stage (cargo xtask vm2 --cases) boots VMs: not run on an RDMA host");
    }
    let passed: u64 = rows.iter().map(|r| r.counts.map_or(0, |c| c.passed)).sum();
    let failed: u64 = rows.iter().map(Row::failed).sum();
    println!();
    println!("xtask: test results");
    for r in &rows {
        println!("{}", r.render());
    }
    let na: usize = rows.iter().map(|r| r.not_applicable.len()).sum();
    if na == 0 {
        println!("{passed} passed, {failed} failed");
    } else {
        println!("{passed} passed ({na} of them n/a), {failed} failed");
    }
    if let Some(section) = not_applicable_section(&rows) {
        println!();
        print!("{section}");
    }
    if let Some(section) = second_boot_section(&rows) {
        println!();
        print!("{section}");
    }
    if let Some(section) = failed_section(&rows) {
        println!();
        print!("{section}");
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

#[cfg(test)]
mod tests;
