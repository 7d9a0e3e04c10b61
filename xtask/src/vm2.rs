//! `cargo xtask vm2`: two VMs joined by a virtual Ethernet link, each running its own command,
//! and the two-VM cases (`cargo xtask vm2 --cases`, also a stage of `cargo xtask test`).
//!
//! The link: each qemu has a virtio NIC whose frames it sends as UDP datagrams to the other
//! qemu's port on 127.0.0.1 ([`vm::LINK_HOST`], qemu's `dgram` netdev); the VMs' own traffic
//! (198.18.0.0/24) exists only inside these datagrams. Both VMs boot in parallel; their
//! consoles stream to the terminal line by line, prefixed `A| ` and `B| `.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::guest::{self, Guest, Link};
use crate::project::Binaries;
use crate::setup::Kernel;
use crate::util::{Error, Result};
use crate::vm::{self, Boot, Event, Nic, Outcome};

/// The NICs, and links, of each VM of the pair: rxe0's and siw0's.
const LINKS: usize = guest::LINK_NICS;

/// The script of the two-VM cases; it runs in both VMs as `/xtask/cases.sh [NAME...]`.
pub const CASES_SCRIPT: &str = include_str!("vm2_cases.sh");

/// The cases of [`CASES_SCRIPT`], in the order it runs them (`peer-killed` powers VM B off, so
/// it is last).
pub const CASES: &[&str] = &[
    "blast-loss",
    "blast-delay",
    "dreq-lost",
    "link-down-up",
    "close-after-send",
    "peer-link-down",
    "reconnect-link",
    "reconnect-restart",
    "peer-killed",
];

/// The VM limit of a `--cases` run (each case bounds its own waits well below this).
pub const CASES_TIMEOUT: Duration = Duration::from_secs(600);

/// How long the other VM may go on after one VM's command failed, before it is stopped.
const GRACE: Duration = Duration::from_secs(20);

/// Splits the words after `vm2`'s `--` into VM A's command and VM B's at the first `--`.
/// Each is a command line (one word) or a command and its arguments (several), as for `vm`;
/// A's command cannot contain a `--` word (write it as one command line), B's can.
pub fn split_commands(rest: &[String]) -> Result<(Vec<String>, Vec<String>)> {
    let usage = "vm2: expected two commands: cargo xtask vm2 [options] -- CMD_A [ARGS...] -- CMD_B [ARGS...]";
    let Some(i) = rest.iter().position(|w| w == "--") else {
        return Err(Error::new(format!("{usage} (no `--` between them)")));
    };
    let (a, b) = (rest[..i].to_vec(), rest[i + 1..].to_vec());
    if a.is_empty() || b.is_empty() {
        return Err(Error::new(format!("{usage} (one of them is empty)")));
    }
    Ok((a, b))
}

/// Writes a stream's complete lines with a prefix; a partial line waits for its end.
pub struct LinePrefixer {
    prefix: String,
    partial: Vec<u8>,
}

impl LinePrefixer {
    /// A prefixer that starts each line with `prefix`.
    pub fn new(prefix: &str) -> Self {
        LinePrefixer { prefix: prefix.to_string(), partial: Vec::new() }
    }

    /// Appends `data`; returns the complete lines, prefixed.
    pub fn push(&mut self, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for &b in data {
            self.partial.push(b);
            if b == b'\n' {
                out.extend_from_slice(self.prefix.as_bytes());
                out.append(&mut self.partial);
            }
        }
        out
    }

    /// What is left of a last line without its newline, prefixed and ended.
    pub fn finish(&mut self) -> Vec<u8> {
        if self.partial.is_empty() {
            return Vec::new();
        }
        let mut out = self.prefix.as_bytes().to_vec();
        out.append(&mut self.partial);
        out.push(b'\n');
        out
    }
}

/// How one VM of the pair ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Its command exited with this status (`vm-poweroff` counts as 0).
    Exited(i32),
    /// It ran into the timeout and was killed.
    TimedOut,
    /// It was stopped because the other VM's command had failed [`GRACE`] earlier.
    Stopped,
    /// It did not get to run its command to the end (boot failure, qemu error, ...).
    Failed(String),
}

impl End {
    /// True when its command exited with status 0.
    pub fn ok(&self) -> bool {
        *self == End::Exited(0)
    }

    /// A short description for messages.
    pub fn describe(&self) -> String {
        match self {
            End::Exited(c) => format!("exit status {c}"),
            End::TimedOut => "killed at the timeout (124)".into(),
            End::Stopped => "stopped after the other VM failed".into(),
            End::Failed(e) => format!("failed: {}", e.lines().next().unwrap_or("")),
        }
    }
}

/// The exit status of `vm2` for how the two VMs ended: 0 when both commands exited 0, else
/// that of the first failure (A before B): the command's status, 124 for a timeout, 125 when
/// the VM could not run it. A VM stopped because of the other's failure does not count.
pub fn exit_status(ends: &[End; 2]) -> u8 {
    for e in ends {
        match e {
            End::Exited(0) | End::Stopped => {}
            End::Exited(c) => return u8::try_from(*c).ok().filter(|&c| c != 0).unwrap_or(1),
            End::TimedOut => return 124,
            End::Failed(_) => return 125,
        }
    }
    if ends.iter().all(End::ok) {
        0
    } else {
        125
    }
}

/// Options of one pair run.
pub struct PairOptions<'a> {
    /// Each VM's limit, from its qemu's start.
    pub timeout: Duration,
    /// Show both consoles from the kernel's first message.
    pub verbose: bool,
    /// Extra environment for both commands.
    pub env: &'a [(String, String)],
    /// The device the commands' variables name.
    pub device: crate::guest::Device,
}

/// A pair run's result: how each VM ended and the markers they printed (`(vm index, text)`,
/// with the time they arrived), other than xtask's own.
pub struct PairRun {
    /// A's and B's ends.
    pub ends: [End; 2],
    /// The markers, in arrival order.
    pub markers: Vec<(usize, String, Instant)>,
}

/// Boots VM A and VM B, linked, running `scripts[0]` and `scripts[1]` as their `cmd.sh`.
pub fn run_pair(kernel: &Kernel, bins: &Binaries, scripts: [String; 2], o: &PairOptions) -> Result<PairRun> {
    let accel = vm::choose_accel(kernel)?;
    // Two links: the first carries rxe0 (and the signals), the second siw0. They cannot share
    // a NIC: RoCE's GID table takes the addresses of a NIC's upper devices too (a macvlan's),
    // so rdma_cm would bind siw0's address to rxe0.
    let p = vm::free_udp_ports(2 * LINKS)?;
    let ports = |vm: usize, link: usize| {
        let (a, b) = (p[2 * link], p[2 * link + 1]);
        if vm == 0 {
            (a, b)
        } else {
            (b, a)
        }
    };
    let stop = [AtomicBool::new(false), AtomicBool::new(false)];
    let done = [AtomicBool::new(false), AtomicBool::new(false)];
    let markers = Mutex::new(Vec::new());
    let base = vm::nonce();
    eprintln!(
        "xtask: vm2: booting VM A ({}) and VM B ({}), linked through UDP {h}:{} <-> {h}:{} (rxe) and {h}:{} <-> {h}:{} (siw)",
        guest::LINK_VMS[0].1,
        guest::LINK_VMS[1].1,
        p[0],
        p[1],
        p[2],
        p[3],
        h = vm::LINK_HOST,
    );
    let ends: Vec<End> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let (script, stop, done, markers, base) = (&scripts[i], &stop, &done, &markers, &base);
                s.spawn(move || {
                    let (name, addr) = guest::LINK_VMS[i];
                    let link = Link { name, addr, peer: guest::LINK_VMS[1 - i].1 };
                    let nonce = format!("{base}{}", name.to_ascii_lowercase());
                    let nics = (0..LINKS)
                        .map(|l| {
                            let (local_port, remote_port) = ports(i, l);
                            Nic { index: l, local_port, remote_port, mac: guest::link_mac(l, i) }
                        })
                        .collect();
                    let end = boot_one(kernel, bins, &nonce, script, link, nics, accel, &stop[i], markers, i, o);
                    done[i].store(true, Ordering::SeqCst);
                    if !end.ok() && end != End::Stopped {
                        eprintln!("xtask: {name}: {}", end.describe());
                        // The other VM is probably waiting for this one: give it a moment, then stop it.
                        let t = Instant::now();
                        while !done[1 - i].load(Ordering::SeqCst) {
                            if t.elapsed() >= GRACE {
                                eprintln!(
                                    "xtask: {}: stopping it, {} s after VM {name} failed",
                                    guest::LINK_VMS[1 - i].0,
                                    GRACE.as_secs()
                                );
                                stop[1 - i].store(true, Ordering::SeqCst);
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                    end
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| End::Failed("xtask thread panicked".into()))).collect()
    });
    let ends: [End; 2] = [ends[0].clone(), ends[1].clone()];
    let markers = markers.into_inner().unwrap_or_else(|e| e.into_inner());
    Ok(PairRun { ends, markers })
}

/// Packs and boots one VM of the pair; its console goes to stdout, prefixed.
#[allow(clippy::too_many_arguments)]
fn boot_one(
    kernel: &Kernel,
    bins: &Binaries,
    nonce: &str,
    script: &str,
    link: Link,
    nics: Vec<Nic>,
    accel: vm::Accel,
    stop: &AtomicBool,
    markers: &Mutex<Vec<(usize, String, Instant)>>,
    index: usize,
    o: &PairOptions,
) -> End {
    let guest = Guest {
        nonce,
        script: script.to_string(),
        env: o.env,
        link: Some(link),
        profiling: false,
        valgrind: false,
        device: o.device,
    };
    let initrd = match guest::pack(kernel, bins, &guest) {
        Ok(i) => i,
        Err(e) => return End::Failed(e.to_string()),
    };
    let boot = Boot {
        kernel: &kernel.image,
        initrd: initrd.path(),
        nonce,
        timeout: o.timeout,
        verbose: o.verbose,
        accel,
        report_boot: true,
        label: link.name,
        nics,
        stop: Some(stop),
    };
    let mut lines = LinePrefixer::new(&format!("{}| ", link.name));
    let write = |bytes: Vec<u8>| {
        if !bytes.is_empty() {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(&bytes);
            let _ = out.flush();
        }
    };
    let result = vm::run(&boot, &mut |ev| match ev {
        Event::Output(t) | Event::Console(t) => write(lines.push(t)),
        Event::Marker(m) => {
            markers.lock().unwrap_or_else(|e| e.into_inner()).push((index, m.to_string(), Instant::now()))
        }
    });
    write(lines.finish());
    match result {
        Ok(Outcome::Exited(c)) => End::Exited(c),
        Ok(Outcome::TimedOut) => End::TimedOut,
        Ok(Outcome::Stopped) => End::Stopped,
        Err(e) => End::Failed(e.to_string()),
    }
}

/// Prints how each VM ended; returns `vm2`'s exit status.
pub fn summarize(ends: &[End; 2]) -> u8 {
    let code = exit_status(ends);
    let each: Vec<String> =
        ends.iter().zip(guest::LINK_VMS).map(|(e, (name, _))| format!("{name}: {}", e.describe())).collect();
    if code == 0 {
        eprintln!("xtask: vm2: both commands succeeded ({})", each.join("; "));
    } else {
        let failed: Vec<&str> = ends
            .iter()
            .zip(guest::LINK_VMS)
            .filter(|(e, _)| !e.ok() && **e != End::Stopped)
            .map(|(_, (n, _))| n)
            .collect();
        eprintln!("xtask: vm2: FAILED in VM {} ({}); exit status {code}", failed.join(" and "), each.join("; "));
    }
    code
}

/// One case's outcome from a `--cases` run.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseResult {
    /// Its name (one of [`CASES`]).
    pub name: String,
    /// Every side that reported passed, and at least one did.
    pub passed: bool,
    /// The sides' reports (`A: ...`, `B: ...`), or why there is none.
    pub detail: String,
    /// From its start (VM A's `case-begin`) to its last report.
    pub secs: Option<f64>,
}

/// Turns a `--cases` run's markers into one result per case in `names`: `case-begin NAME`
/// starts a case, `case NAME pass|fail DETAIL` is one side's report.
pub fn collect_cases(names: &[&str], markers: &[(usize, String, Instant)], ends: &[End; 2]) -> Vec<CaseResult> {
    names
        .iter()
        .map(|&name| {
            let begin =
                markers.iter().find(|(_, m, _)| m.strip_prefix("case-begin ") == Some(name)).map(|(_, _, t)| *t);
            let mut reports = Vec::new();
            let mut last = None;
            for (_, m, t) in markers {
                let Some(rest) = m.strip_prefix("case ") else { continue };
                let mut it = rest.splitn(3, ' ');
                if it.next() != Some(name) {
                    continue;
                }
                let verdict = it.next().unwrap_or("");
                reports.push((verdict == "pass", it.next().unwrap_or("").to_string()));
                last = Some(*t);
            }
            let passed = !reports.is_empty() && reports.iter().all(|(p, _)| *p);
            let detail = if reports.is_empty() {
                let why: Vec<String> = ends
                    .iter()
                    .zip(guest::LINK_VMS)
                    .filter(|(e, _)| !e.ok())
                    .map(|(e, (n, _))| format!("{n}: {}", e.describe()))
                    .collect();
                format!("no result{}", if why.is_empty() { String::new() } else { format!(" ({})", why.join("; ")) })
            } else {
                reports.into_iter().map(|(_, d)| d).collect::<Vec<_>>().join("; ")
            };
            let secs = begin.zip(last).map(|(b, l)| l.saturating_duration_since(b).as_secs_f64());
            CaseResult { name: name.to_string(), passed, detail, secs }
        })
        .collect()
}

/// Checks that every name is a case; returns the selection in [`CASES`] order (all when
/// `names` is empty).
pub fn select_cases(names: &[String]) -> Result<Vec<&'static str>> {
    if let Some(bad) = names.iter().find(|n| !CASES.contains(&n.as_str())) {
        return Err(Error::new(format!("vm2 --cases: no case {bad:?} (the cases: {})", CASES.join(", "))));
    }
    Ok(CASES.iter().copied().filter(|c| names.is_empty() || names.iter().any(|n| n == c)).collect())
}

/// Runs the cases `names` (see [`select_cases`]) in one linked pair; one result per case.
pub fn run_cases(kernel: &Kernel, bins: &Binaries, names: &[&str], o: &PairOptions) -> Result<Vec<CaseResult>> {
    let line = format!("sh /xtask/cases.sh {}", names.join(" "));
    let script = guest::link_command_script(&[line]);
    let run = run_pair(kernel, bins, [script.clone(), script], o)?;
    for (e, (n, _)) in run.ends.iter().zip(guest::LINK_VMS) {
        if !e.ok() {
            eprintln!("xtask: vm2 cases: VM {n}: {}", e.describe());
        }
    }
    Ok(collect_cases(names, &run.markers, &run.ends))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn two_commands_split_at_the_first_double_dash() {
        let (a, b) = split_commands(&v(&["echo a", "--", "sh", "-c", "x", "--", "y"])).unwrap();
        assert_eq!(a, v(&["echo a"]));
        assert_eq!(b, v(&["sh", "-c", "x", "--", "y"]));
        let (a, b) = split_commands(&v(&["ibv_devinfo", "-v", "--", "true"])).unwrap();
        assert_eq!((a, b), (v(&["ibv_devinfo", "-v"]), v(&["true"])));
        for bad in [&["only-a"][..], &["--", "b"], &["a", "--"], &[]] {
            assert!(split_commands(&v(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lines_get_their_prefix_whole() {
        let mut p = LinePrefixer::new("A| ");
        assert_eq!(p.push(b"one\ntw"), b"A| one\n");
        assert_eq!(p.push(b"o\n\nthr"), b"A| two\nA| \n");
        assert_eq!(p.finish(), b"A| thr\n");
        assert_eq!(p.finish(), b"");
    }

    #[test]
    fn exit_status_names_the_first_failure() {
        use End::*;
        assert_eq!(exit_status(&[Exited(0), Exited(0)]), 0);
        assert_eq!(exit_status(&[Exited(0), Exited(3)]), 3);
        assert_eq!(exit_status(&[Exited(2), Stopped]), 2);
        assert_eq!(exit_status(&[Stopped, TimedOut]), 124);
        assert_eq!(exit_status(&[Failed("x".into()), Exited(0)]), 125);
        assert_eq!(exit_status(&[Exited(256), Exited(0)]), 1);
    }

    #[test]
    fn cases_pass_only_when_every_report_passes() {
        let t = Instant::now();
        let m = |i: usize, s: &str| (i, s.to_string(), t);
        let markers = vec![
            m(0, "case-begin blast-loss"),
            m(0, "case blast-loss pass A: server ok"),
            m(1, "case blast-loss pass B: client ok"),
            m(0, "case link-down-up pass A: fine"),
            m(1, "case link-down-up fail B: survived"),
            m(0, "case peer-killed pass A: noticed after 9.1 s"),
        ];
        let ends = [End::Exited(0), End::Exited(0)];
        let r = collect_cases(&["blast-loss", "blast-delay", "link-down-up", "peer-killed"], &markers, &ends);
        assert!(r[0].passed);
        assert_eq!(r[0].detail, "A: server ok; B: client ok");
        assert!(r[0].secs.is_some());
        assert!(!r[1].passed);
        assert_eq!(r[1].detail, "no result");
        assert!(!r[2].passed);
        assert!(r[3].passed);
        let r = collect_cases(&["blast-delay"], &markers, &[End::TimedOut, End::Exited(0)]);
        assert_eq!(r[0].detail, "no result (A: killed at the timeout (124))");
    }

    #[test]
    fn the_script_has_every_case() {
        for c in CASES {
            assert!(CASES_SCRIPT.contains(&format!("\n    {c})")), "{c} is not in vm2_cases.sh");
        }
        assert_eq!(select_cases(&[]).unwrap(), CASES);
        assert_eq!(select_cases(&v(&["peer-killed", "blast-loss"])).unwrap(), ["blast-loss", "peer-killed"]);
        assert!(select_cases(&v(&["nope"])).is_err());
    }
}
