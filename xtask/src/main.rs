//! `cargo xtask`: the rdma-reactor test bed (a Soft-RoCE VM under qemu).
//!
//! Commands: `setup`, `vm`, `test`, `demo`, `bench`, `path-count`, `fuzz`; see [`USAGE`].

mod bench;
mod demo;
mod fuzz;
mod guest;
mod host;
mod initramfs;
mod instructions;
mod json;
mod path_count;
mod project;
mod setup;
mod siw;
mod test;
mod util;
mod vm;
mod vm2;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use util::{Error, Result};

const USAGE: &str = "\
usage: cargo xtask <command> [options]

commands:
  setup                      install the Debian packages the test bed needs (when missing)
                             and download the guest kernel into target/xtask/kernel/
  vm [options] -- CMD [ARGS...]
                             boot the Soft-RoCE VM and run CMD there (as root, cwd /tmp);
                             exits with CMD's status (124: timeout; 125: xtask failed).
                             Several words run as a command with exactly these arguments;
                             one word runs as a sh command line (`sh -c WORD`)
  vm --perf [options] -- CMD [ARGS...]
                             profile CMD in the VM: the examples and benches built as a user
                             builds them (profile perf: release with line tables; no tests in
                             $BIN), perf and strace in the VM; CMD runs under `perf stat`, then
                             under `perf record`, then a flat `perf report` (self time by
                             command, binary and symbol; then the project's binaries alone)
  vm2 [options] -- CMD_A [ARGS...] -- CMD_B [ARGS...]
                             boot two VMs, A and B, joined by a virtual Ethernet link, and run
                             CMD_A in A and CMD_B in B (each as `vm` runs its command; CMD_A
                             cannot contain a `--` word); streams both consoles (`A| `, `B| `);
                             exits non-zero when either fails (the first failure's status;
                             124: timeout; 125: xtask or the VM failed)
  vm2 --cases [NAME...]      the two-VM cases (blast-loss, blast-delay, dreq-lost,
                             link-down-up, close-after-send, peer-link-down,
                             reconnect-link, reconnect-restart, peer-killed)
                             in one linked pair, as a table
  test [options]             host unit tests, then every tests/*.rs binary in one VM boot per
                             device, rxe0 then siw0 (or here, when this host has an active
                             RDMA device), then the two-VM cases in one linked pair per device
                             (`vm2 --cases`); tests that do not apply to iWARP are counted
                             n/a and listed after the table
  demo [options]             run the echo and blast examples, server and client (rping
                             until they exist), in the VM (on --device rxe|siw) or on this
                             host's RDMA device
  bench [--compare] [--instructions] [--rows ID,..] [--rounds N] [--device rxe|siw]
                             the criterion benchmarks (benches/latency.rs, profile perf) in the VM; with
                             --compare: echo and blast against perftest and cmtime in ONE VM
                             boot, interleaved over N rounds (default 3), as a table of ratios,
                             on the chosen device (perftest with -R on siw); with
                             --instructions (alone, or after --compare's table in the same
                             boot): user-space instructions per message counted by valgrind,
                             client and server, ours beside perftest's, and callgrind profiles
                             of our side annotated into target/xtask/instructions/. --rows:
                             only these rows of either table, e.g. stream64_event,stream64k_bw
  path-count [--check] [--profile]
                             on this host, no device: the per-message path of
                             bench_internals (issue 47's ring design, `new`; today's, `old`)
                             counted by valgrind, instructions a message (two message counts,
                             the difference); --check: fail when `new` is above
                             benches/path_budget.txt's budget + 5 % (.ci/run runs it);
                             --profile: a callgrind profile of `new` into
                             target/xtask/path-count/
  fuzz [--runs N] [--time SECS] [--seed N] [TARGET...]
                             the coverage-guided fuzz targets of fuzz/ (libFuzzer, stable
                             toolchain): connect_info, state_machines, flow (default: all),
                             one after the other, N runs each (default 10000000) or SECS
                             each; the corpus grows in target/fuzz/corpus/TARGET, a failing
                             input lands in target/fuzz/artifacts/TARGET/
  help                       this text

options:
  --timeout SECS             vm, vm2, demo: kill the VM after SECS (default 600);
                             test: the VM's overall limit (default 180 + watchdogs)
  --test-timeout SECS        test: watchdog per test binary (default 300)
  --env KEY=VALUE            vm, vm2: set a variable for CMD (repeatable)
  --device rxe|siw           vm, vm2, bench, demo: point $RDMA_DEV/$RDMA_ADDR/$PEER_ADDR...
                             at Soft-RoCE (rxe0, the default) or Soft-iWARP (siw0); both
                             devices are up in every VM; test: run the VM and two-VM
                             stages on this device only (default: rxe, then siw)
  --verbose                  vm, vm2, test, demo: show the VM's whole console, boot included;
                             fuzz: all of libFuzzer's output

in the VM: $BIN holds the project's examples and test binaries by name (on PATH; call
\"$BIN\"/echo, sh has a builtin echo); $RDMA_DEV is the chosen device (rxe0 or siw0),
$RDMA_DEVICE its kind (rxe or siw), $RDMA_ADDR its IPv4 address (rxe0 198.18.0.1 on the dummy
d0, siw0 198.18.1.1 on the dummy s0), $RDMA_ADDR6 its IPv6 one (fd18:0::1, fd18:1::1),
$RDMA_LL6 its link-local one (fe80::1:1, fe80::2:1; scope $RDMA_NETDEV); $RXE_* and $SIW_*
name each device's own, whichever is chosen; `runas rdmauser CMD [ARGS...]` runs CMD as the
unprivileged uid 1000 (memlock $RUNAS_MEMLOCK KiB, default 8192); /tmp is a tmpfs;
RUST_BACKTRACE=1.
in vm2's VMs: $VM_NAME is A or B, $RDMA_ADDR ends in .1 (A) or .2 (B) (::1, ::2 in IPv6),
$PEER_ADDR, $PEER_ADDR6, $PEER_LL6 the other's; rxe0 sits on one virtio NIC, siw0 on a
second one, s0, on a link of its own ($RDMA_NETDEV is the chosen one's); `tc ... netem` works (iproute2's tc),
and so does a `clsact` qdisc with u32 filters and the drop action;
`peer-signal NAME` / `peer-wait NAME [SECS]` / `peer-sync NAME [SECS]` coordinate the two
commands (bounded waits), `vm-poweroff` pulls the VM's plug (counts as exit 0).

environment: RDMA_REACTOR_HOST_RDMA=1|0 forces/forbids using this host's RDMA device
(then RDMA_ADDR must be set); XTASK_ACCEL=kvm|tcg skips the KVM probe.
";

/// Exit status of `vm` when the VM timed out (as timeout(1)).
const EXIT_TIMEOUT: u8 = 124;
/// Exit status of `vm`/`demo` when xtask itself failed.
const EXIT_XTASK: u8 = 125;

/// Parsed command-line options.
#[derive(Debug, Default, PartialEq)]
struct Opts {
    timeout: Option<u64>,
    test_timeout: Option<u64>,
    env: Vec<(String, String)>,
    verbose: bool,
    compare: bool,
    /// `bench --instructions`: count instructions per message with valgrind.
    instructions: bool,
    rounds: Option<u32>,
    /// `bench --instructions --rows A,B`: only these rows (every row by default).
    rows: Vec<String>,
    runs: Option<u64>,
    time: Option<u64>,
    seed: Option<u64>,
    cases: bool,
    perf: bool,
    /// `--device`: the soft RDMA device the command's variables name (vm, vm2, bench, demo), or
    /// the one device `test` runs its VM stages on (default: both).
    device: Option<guest::Device>,
    rest: Vec<String>,
}

/// Parses the options of `command`; `takes_rest` lets a command have trailing words (after `--`
/// or the first word that is not an option).
fn parse_opts(command: &str, args: &[String], takes_rest: bool) -> Result<Opts> {
    let mut o = Opts::default();
    let mut i = 0;
    let secs = |name: &str, v: Option<&String>| -> Result<u64> {
        let v = v.ok_or_else(|| Error::new(format!("{command}: {name} needs a value (seconds)")))?;
        match v.parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(Error::new(format!("{command}: {name} {v:?}: expected a positive number of seconds"))),
        }
    };
    while i < args.len() {
        let arg = args[i].as_str();
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg, None),
        };
        let mut value = || -> Option<String> {
            if inline.is_some() {
                inline.clone()
            } else {
                i += 1;
                args.get(i).cloned()
            }
        };
        match name {
            "--" if takes_rest => {
                o.rest = args[i + 1..].to_vec();
                break;
            }
            "--timeout" => o.timeout = Some(secs(name, value().as_ref())?),
            "--test-timeout" if command == "test" => o.test_timeout = Some(secs(name, value().as_ref())?),
            "--cases" if command == "vm2" => o.cases = true,
            "--perf" if command == "vm" => o.perf = true,
            "--device" if matches!(command, "vm" | "vm2" | "bench" | "demo" | "test") => {
                let v = value().unwrap_or_default();
                o.device = Some(guest::Device::parse(&v).map_err(|e| Error::new(format!("{command}: --device: {e}")))?);
            }
            "--env" if command == "vm" || command == "vm2" => {
                let kv = value().ok_or_else(|| Error::new(format!("{command}: --env needs KEY=VALUE")))?;
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| Error::new(format!("{command}: --env {kv:?}: expected KEY=VALUE")))?;
                let valid = !k.is_empty()
                    && !k.starts_with(|c: char| c.is_ascii_digit())
                    && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !valid {
                    return Err(Error::new(format!("{command}: --env {kv:?}: {k:?} is not a variable name")));
                }
                o.env.push((k.to_string(), v.to_string()));
            }
            "--verbose" | "-v" => o.verbose = true,
            "--compare" if command == "bench" => o.compare = true,
            "--instructions" if command == "bench" => o.instructions = true,
            "--rows" if command == "bench" => {
                let v = value().unwrap_or_default();
                for id in v.split(',').filter(|id| !id.is_empty()) {
                    if !instructions::ROWS.iter().any(|r| r.id == id) && !bench::ROWS.iter().any(|r| r.id == id) {
                        let mut known: Vec<&str> = bench::ROWS.iter().map(|r| r.id).collect();
                        for r in instructions::ROWS {
                            if !known.contains(&r.id) {
                                known.push(r.id);
                            }
                        }
                        return Err(Error::new(format!(
                            "bench: --rows: unknown row {id:?} (rows: {})",
                            known.join(", ")
                        )));
                    }
                    o.rows.push(id.to_string());
                }
            }
            "--rounds" if command == "bench" => {
                let v = value().unwrap_or_default();
                o.rounds = match v.parse::<u32>() {
                    Ok(n) if n > 0 => Some(n),
                    _ => return Err(Error::new(format!("bench: --rounds {v:?}: expected a positive number"))),
                };
            }
            "--runs" | "--time" | "--seed" if command == "fuzz" => {
                let v = value().unwrap_or_default();
                let n = match v.parse::<u64>() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(Error::new(format!("fuzz: {name} {v:?}: expected a positive number"))),
                };
                match name {
                    "--runs" => o.runs = Some(n),
                    "--time" => o.time = Some(n),
                    _ => o.seed = Some(n),
                }
            }
            _ if takes_rest && !arg.starts_with('-') => {
                o.rest = args[i..].to_vec();
                break;
            }
            _ => return Err(Error::new(format!("{command}: unknown option {arg:?} (see `cargo xtask help`)"))),
        }
        i += 1;
    }
    Ok(o)
}

fn cmd_vm(args: &[String]) -> Result<u8> {
    let o = parse_opts("vm", args, true)?;
    if o.rest.is_empty() {
        return Err(Error::new("vm: no command given: cargo xtask vm [--timeout SECS] -- CMD [ARGS...]"));
    }
    let kernel = setup::ensure(false)?;
    if o.perf {
        let bins = project::build_perf()?;
        return run_in_vm(&kernel, &bins, guest::perf_script(&o.rest), &o);
    }
    let bins = project::build()?;
    run_in_vm(&kernel, &bins, guest::command_script(&o.rest), &o)
}

/// Boots the VM with `script` as its command, streaming its output; returns the exit status.
fn run_in_vm(kernel: &setup::Kernel, bins: &project::Binaries, script: String, o: &Opts) -> Result<u8> {
    run_in_vm_capture(kernel, bins, script, o, &mut Vec::new())
}

/// As [`run_in_vm`], also keeping the output in `captured`.
fn run_in_vm_capture(
    kernel: &setup::Kernel,
    bins: &project::Binaries,
    script: String,
    o: &Opts,
    captured: &mut Vec<u8>,
) -> Result<u8> {
    let nonce = vm::nonce();
    let initrd = guest::pack(
        kernel,
        bins,
        &guest::Guest {
            nonce: &nonce,
            script,
            env: &o.env,
            link: None,
            profiling: o.perf,
            valgrind: o.instructions,
            device: o.device.unwrap_or_default(),
        },
    )?;
    let accel = vm::choose_accel(kernel)?;
    let timeout = Duration::from_secs(o.timeout.unwrap_or(600));
    let boot = vm::Boot {
        kernel: &kernel.image,
        initrd: initrd.path(),
        nonce: &nonce,
        timeout,
        verbose: o.verbose,
        accel,
        report_boot: true,
        label: "",
        nics: Vec::new(),
        stop: None,
    };
    let stdout = std::io::stdout();
    let outcome = vm::run(&boot, &mut |ev| {
        let t = match ev {
            vm::Event::Output(t) => {
                captured.extend_from_slice(t);
                t
            }
            vm::Event::Console(t) => t,
            vm::Event::Marker(_) => return,
        };
        let mut out = stdout.lock();
        let _ = out.write_all(t);
        let _ = out.flush();
    })?;
    match outcome {
        vm::Outcome::Exited(code) => Ok(u8::try_from(code).unwrap_or(255)),
        vm::Outcome::TimedOut => {
            eprintln!(
                "xtask: error: the VM ran into the {} s timeout and was killed (raise it with --timeout SECS)",
                timeout.as_secs()
            );
            Ok(EXIT_TIMEOUT)
        }
        vm::Outcome::Stopped => Err(Error::new("the VM was stopped")),
    }
}

fn cmd_vm2(args: &[String]) -> Result<u8> {
    let o = parse_opts("vm2", args, true)?;
    let pair =
        |timeout| vm2::PairOptions { timeout, verbose: o.verbose, env: &o.env, device: o.device.unwrap_or_default() };
    if o.cases {
        let names = vm2::select_cases(&o.rest)?;
        let kernel = setup::ensure(false)?;
        let bins = project::build()?;
        let started = std::time::Instant::now();
        let timeout = o.timeout.map_or(vm2::CASES_TIMEOUT, Duration::from_secs);
        let results = vm2::run_cases(&kernel, &bins, &names, &pair(timeout))?;
        println!("\nxtask: vm2 cases ({:.0} s)", started.elapsed().as_secs_f64());
        for r in &results {
            let secs = r.secs.map_or(String::new(), |s| format!(" [{s:.1} s]"));
            let verdict = if r.passed { "passed" } else { "FAILED" };
            println!("  {:<16} {verdict}{secs}: {}", r.name, r.detail);
        }
        let failed = results.iter().filter(|r| !r.passed).count();
        println!("{} passed, {failed} failed", results.len() - failed);
        return Ok(u8::from(failed > 0));
    }
    let (a, b) = vm2::split_commands(&o.rest)?;
    let kernel = setup::ensure(false)?;
    let bins = project::build()?;
    let scripts = [guest::link_command_script(&a), guest::link_command_script(&b)];
    let run = vm2::run_pair(&kernel, &bins, scripts, &pair(Duration::from_secs(o.timeout.unwrap_or(600))))?;
    Ok(vm2::summarize(&run.ends))
}

fn cmd_demo(args: &[String]) -> Result<u8> {
    let o = parse_opts("demo", args, false)?;
    let script = demo::script();
    if host::use_host_rdma()? {
        if o.device.is_some() {
            eprintln!("xtask: demo: --device chooses a device of the VM; this host's own device is used instead");
        }
        let addr = host::rdma_addr()?;
        let bins = project::build()?;
        let bin = host::bin_dir(&bins)?;
        eprintln!("xtask: using this host's RDMA device: running the demo here (RDMA_ADDR={addr})");
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c").arg(&script).current_dir(util::workspace_root());
        host::env(&mut cmd, &bin, &addr);
        let w = host::run_watched(&mut cmd, Duration::from_secs(o.timeout.unwrap_or(600)), &mut |_| {})?;
        if w.killed {
            eprintln!("xtask: error: the demo ran into the timeout and was killed");
            return Ok(EXIT_TIMEOUT);
        }
        return Ok(w.status.and_then(|s| s.code()).map_or(1, |c| u8::try_from(c).unwrap_or(255)));
    }
    let kernel = setup::ensure(false)?;
    let bins = project::build()?;
    run_in_vm(&kernel, &bins, script, &o)
}

fn cmd_bench(args: &[String]) -> Result<u8> {
    let mut o = parse_opts("bench", args, false)?;
    let kernel = setup::ensure(false)?;
    let bins = project::build_perf()?;
    if !o.compare && !o.instructions {
        o.timeout = o.timeout.or(Some(1800));
        return run_in_vm(&kernel, &bins, "cd /tmp && \"$BIN\"/latency --bench\n".into(), &o);
    }
    let rounds = o.rounds.unwrap_or(3);
    let mut script = String::new();
    let mut limit = 600;
    if o.compare {
        script.push_str(&bench::compare_script(rounds, &o.rows));
        limit += 600 * u64::from(rounds);
    }
    if o.instructions {
        script.push_str(&instructions::script(rounds, &o.rows));
        limit += 1200 * u64::from(rounds) + 900;
    }
    o.timeout = o.timeout.or(Some(limit));
    let started = std::time::Instant::now();
    let mut output = Vec::new();
    let code = run_in_vm_capture(&kernel, &bins, script, &o, &mut output)?;
    let text = String::from_utf8_lossy(&output);
    if !o.compare {
        return report_instructions(&text, rounds, code, &o, started);
    }
    let (table, complete) = bench::table(&bench::parse(&text), rounds, &o.rows);
    let machine = text.lines().find_map(|l| l.trim().strip_prefix("@@ machine ")).unwrap_or("?").to_string();
    let device = o.device.unwrap_or_default();
    let rows = if o.rows.is_empty() { String::new() } else { format!(" --rows {}", o.rows.join(",")) };
    println!(
        "\n`cargo xtask bench --compare{rows} --rounds {rounds} --device {}`: on {} ({}), one VM boot, {rounds} \
         interleaved rounds, {:.0} s; guest {machine}; accel {}\n",
        device.name(),
        device.dev(),
        device.describe(),
        started.elapsed().as_secs_f64(),
        vm::choose_accel(&kernel).map(|a| format!("{a:?}")).unwrap_or_else(|_| "?".into())
    );
    println!("{table}");
    if o.instructions {
        let counted = report_instructions(&text, rounds, code, &o, started)?;
        if !complete {
            eprintln!("xtask: bench --compare: a measurement failed (see `failed` above, and the output before it)");
            return Ok(if counted != 0 { counted } else { 1 });
        }
        return Ok(counted);
    }
    if code != 0 || !complete {
        eprintln!("xtask: bench --compare: a measurement failed (see `failed` above, and the output before it)");
        return Ok(if code != 0 { code } else { 1 });
    }
    Ok(0)
}

/// `bench --instructions`' table and profiles, from the guest's output.
fn report_instructions(text: &str, rounds: u32, code: u8, o: &Opts, started: std::time::Instant) -> Result<u8> {
    let device = o.device.unwrap_or_default();
    let machine = text.lines().find_map(|l| l.trim().strip_prefix("@@ machine ")).unwrap_or("?").to_string();
    let (table, complete) = instructions::table(&instructions::parse(text), rounds, &o.rows);
    let rows = if o.rows.is_empty() { String::new() } else { format!(" --rows {}", o.rows.join(",")) };
    println!(
        "\n`cargo xtask bench --instructions{rows} --rounds {rounds} --device {}`: user-space instructions per \
         message (cachegrind, the difference between two message counts over the extra messages), one VM \
         boot, {rounds} interleaved rounds, {:.0} s in all; guest {machine}\n",
        device.name(),
        started.elapsed().as_secs_f64(),
    );
    println!("{table}");
    let dir = util::target_dir().join("xtask").join("instructions");
    for (name, b64) in instructions::profiles(text) {
        match instructions::annotate(&dir, &name, &b64, 25) {
            Ok((path, tops)) => println!("callgrind profile {name} ({}):\n{tops}", path.display()),
            Err(e) => eprintln!("xtask: bench --instructions: profile {name}: {e}"),
        }
    }
    if code != 0 || !complete {
        eprintln!("xtask: bench --instructions: a count failed (see `failed` above, and the output before it)");
        return Ok(if code != 0 { code } else { 1 });
    }
    Ok(0)
}

fn cmd_test(args: &[String]) -> Result<u8> {
    let o = parse_opts("test", args, false)?;
    let opts = test::Options {
        per_binary: Duration::from_secs(o.test_timeout.unwrap_or(300)),
        vm_timeout: o.timeout.map(Duration::from_secs),
        verbose: o.verbose,
        device: o.device,
    };
    Ok(u8::try_from(test::run(&opts)?).unwrap_or(1))
}

fn cmd_fuzz(args: &[String]) -> Result<u8> {
    let o = parse_opts("fuzz", args, true)?;
    let targets = fuzz::select(&o.rest)?;
    let limits =
        fuzz::Limits { runs: o.runs.or(o.time.is_none().then_some(fuzz::DEFAULT_RUNS)), secs: o.time, seed: o.seed };
    let bins = fuzz::build()?;
    let mut results = Vec::new();
    for t in &targets {
        results.push((t.name, fuzz::run(&bins, t, limits, &fuzz::work_corpus(t), o.verbose)?));
    }
    println!();
    println!("xtask: fuzz results (libFuzzer, coverage-guided)");
    for (name, r) in &results {
        println!("  {name:<16} {} [{:.0} s]{}", r.summary(), r.secs, if r.ok { "" } else { "  <-- FAILED" });
    }
    let failed = results.iter().filter(|(_, r)| !r.ok).count();
    println!("{} passed, {failed} failed", results.len() - failed);
    Ok(if failed == 0 { 0 } else { 1 })
}

fn cmd_path_count(args: &[String]) -> Result<u8> {
    let (mut check, mut profile) = (false, false);
    for a in args {
        match a.as_str() {
            "--check" => check = true,
            "--profile" => profile = true,
            other => return Err(Error::new(format!("path-count: unknown option {other:?}"))),
        }
    }
    path_count::run(check, profile)
}

fn cmd_setup(args: &[String]) -> Result<u8> {
    parse_opts("setup", args, false)?;
    setup::ensure(true)?;
    Ok(0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = args.split_first() else {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    };
    let result = match command.as_str() {
        "setup" => cmd_setup(rest),
        "vm" => cmd_vm(rest),
        "vm2" => cmd_vm2(rest),
        "test" => cmd_test(rest),
        "demo" => cmd_demo(rest),
        "bench" => cmd_bench(rest),
        "fuzz" => cmd_fuzz(rest),
        "path-count" => cmd_path_count(rest),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(0)
        }
        other => {
            eprintln!("xtask: unknown command {other:?}\n");
            eprint!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::from(if matches!(command.as_str(), "vm" | "vm2" | "demo") { EXIT_XTASK } else { 1 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn vm_options_and_command() {
        let o = parse_opts("vm", &v(&["--timeout", "20", "--", "sleep", "100"]), true).unwrap();
        assert_eq!(o.timeout, Some(20));
        assert_eq!(o.rest, v(&["sleep", "100"]));
        let o = parse_opts("vm", &v(&["--timeout=5", "--env", "A=b=c", "sh", "-c", "exit 7"]), true).unwrap();
        assert_eq!(o.timeout, Some(5));
        assert_eq!(o.env, vec![("A".to_string(), "b=c".to_string())]);
        assert_eq!(o.rest, v(&["sh", "-c", "exit 7"]));
        let o = parse_opts("vm", &v(&["--", "--timeout", "1"]), true).unwrap();
        assert_eq!(o.rest, v(&["--timeout", "1"]));
    }

    #[test]
    fn vm2_options_and_two_commands() {
        let o = parse_opts("vm2", &v(&["--timeout", "30", "--env", "X=1", "--", "a", "--", "b", "c"]), true).unwrap();
        assert_eq!((o.timeout, o.env.len(), o.cases), (Some(30), 1, false));
        let (a, b) = vm2::split_commands(&o.rest).unwrap();
        assert_eq!((a, b), (v(&["a"]), v(&["b", "c"])));
        let o = parse_opts("vm2", &v(&["--cases", "link-down-up"]), true).unwrap();
        assert!(o.cases);
        assert_eq!(o.rest, v(&["link-down-up"]));
        assert!(parse_opts("vm", &v(&["--cases"]), true).is_err());
        assert!(parse_opts("vm", &v(&["--perf", "--", "x"]), true).unwrap().perf);
        assert!(parse_opts("test", &v(&["--perf"]), false).is_err());
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        for bad in [
            &["--timeout"][..],
            &["--timeout", "x"],
            &["--timeout", "0"],
            &["--env", "1A=2"],
            &["--env", "noeq"],
            &["--bogus"],
        ] {
            assert!(parse_opts("vm", &v(bad), true).is_err(), "{bad:?}");
        }
        assert!(parse_opts("test", &v(&["extra"]), false).is_err());
        assert!(parse_opts("demo", &v(&["--test-timeout", "3"]), false).is_err());
        assert_eq!(parse_opts("test", &v(&["--test-timeout", "30"]), false).unwrap().test_timeout, Some(30));
        assert!(parse_opts("test", &v(&["--runs", "3"]), false).is_err());
        assert_eq!(parse_opts("test", &v(&["--device", "siw"]), false).unwrap().device, Some(guest::Device::Siw));
        assert_eq!(parse_opts("bench", &v(&["--device=rxe"]), false).unwrap().device, Some(guest::Device::Rxe));
        assert_eq!(parse_opts("test", &v(&[]), false).unwrap().device, None);
        assert!(parse_opts("test", &v(&["--device", "mlx5"]), false).is_err());
        assert!(parse_opts("fuzz", &v(&["--device", "siw"]), true).is_err());
        assert!(parse_opts("fuzz", &v(&["--runs", "0"]), true).is_err());
    }

    #[test]
    fn fuzz_options_and_targets() {
        let o = parse_opts("fuzz", &v(&["--runs", "1000", "--seed=7", "flow", "state_machines"]), true).unwrap();
        assert_eq!((o.runs, o.time, o.seed), (Some(1000), None, Some(7)));
        assert_eq!(o.rest, v(&["flow", "state_machines"]));
        assert_eq!(parse_opts("fuzz", &v(&["--time", "60"]), true).unwrap().time, Some(60));
    }
}
