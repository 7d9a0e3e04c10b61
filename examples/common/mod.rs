//! Small helpers shared by the examples: argument parsing and latency statistics.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::exit;
use std::str::FromStr;

pub mod group;
pub mod observe;

/// Parsed `--flag value` and `--switch` arguments.
pub struct Args {
    values: HashMap<String, String>,
    switches: Vec<String>,
    usage: &'static str,
}

impl Args {
    /// Parses `args`; `switches` are the flags that take no value. Exits with the usage on
    /// `--help` or a malformed command line.
    pub fn parse(args: impl Iterator<Item = String>, switches: &[&str], usage: &'static str) -> Args {
        let mut values = HashMap::new();
        let mut found = Vec::new();
        let mut it = args.peekable();
        while let Some(a) = it.next() {
            if a == "--help" || a == "-h" {
                println!("{usage}");
                exit(0);
            }
            let Some(name) = a.strip_prefix("--") else { fail(usage, &format!("unexpected argument {a:?}")) };
            if switches.contains(&name) {
                found.push(name.to_string());
                continue;
            }
            let (name, value) = match name.split_once('=') {
                Some((n, v)) => (n.to_string(), v.to_string()),
                None => match it.next() {
                    Some(v) => (name.to_string(), v),
                    None => fail(usage, &format!("--{name} needs a value")),
                },
            };
            values.insert(name, value);
        }
        Args { values, switches: found, usage }
    }

    /// True when the switch was given.
    pub fn switch(&self, name: &str) -> bool {
        self.switches.iter().any(|s| s == name)
    }

    /// True when the option was given a value.
    pub fn given(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// A value parsed as `T`, or `default`.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> T
    where
        T::Err: std::fmt::Display,
    {
        match self.values.get(name) {
            None => default,
            Some(v) => v.parse().unwrap_or_else(|e| fail(self.usage, &format!("--{name} {v:?}: {e}"))),
        }
    }

    /// `--spin-us N`: spin-then-sleep polling for N microseconds after work (0: event mode).
    pub fn spin(&self) -> std::time::Duration {
        self.spin_or(0)
    }

    /// `--spin-us N`, or `default_us` when it is not given.
    pub fn spin_or(&self, default_us: u64) -> std::time::Duration {
        std::time::Duration::from_micros(self.get("spin-us", default_us))
    }

    /// `--keepalive-ms N`, `--ack-timeout-ms N`, `--retry-count N` (dead-peer detection, see
    /// `Config::keepalive`), `--credit-timeout-ms N` (stalled-peer detection, see
    /// `Config::credit_timeout`) and `--violation-backoff-ms N` (the penalty box, see
    /// `Config::violation_backoff`) applied to `cfg`.
    pub fn liveness(&self, cfg: rdma_reactor::Config) -> rdma_reactor::Config {
        let ms = |name: &str| Some(self.get::<u64>(name, 0)).filter(|v| *v > 0).map(std::time::Duration::from_millis);
        rdma_reactor::Config {
            keepalive: ms("keepalive-ms"),
            ack_timeout: ms("ack-timeout-ms"),
            retry_count: self.get("retry-count", cfg.retry_count),
            // Not given: the library's default (60 s); 0 waits for ever.
            credit_timeout: if self.values.contains_key("credit-timeout-ms") {
                ms("credit-timeout-ms")
            } else {
                cfg.credit_timeout
            },
            violation_backoff: ms("violation-backoff-ms"),
            ..cfg
        }
    }

    /// `--metrics [ADDR:]PORT` (a bare port: 127.0.0.1), `--metrics-max-conns N` and the switch
    /// `--metrics-conns`: where and how a server serves `GET /metrics` (`observe::serve_metrics`;
    /// reactor `i` of `--threads N` on PORT + i). `None` without `--metrics`.
    pub fn metrics(&self) -> Option<observe::Metrics> {
        let v = self.values.get("metrics")?;
        let addr =
            observe::parse_metrics_addr(v).unwrap_or_else(|e| fail(self.usage, &format!("--metrics {v:?}: {e}")));
        let max_conns = self.get("metrics-max-conns", observe::MAX_CONNS);
        if max_conns == 0 {
            fail(self.usage, "--metrics-max-conns must be at least 1");
        }
        Some(observe::Metrics { addr, max_conns, idle: observe::IDLE, conns: self.switch("metrics-conns") })
    }

    /// The value flags [`Args::metrics`] reads (`metrics-conns` is a switch).
    pub const METRICS: [&'static str; 2] = ["metrics", "metrics-max-conns"];

    /// The flags [`Args::liveness`] reads.
    pub const LIVENESS: [&'static str; 5] =
        ["keepalive-ms", "ack-timeout-ms", "retry-count", "credit-timeout-ms", "violation-backoff-ms"];

    /// `--srq` (a switch) with `--srq-receives N`, `--srq-credit N`, `--srq-max-credit N`,
    /// `--srq-reserve N` (default a thirty-second of the receives) and `--srq-size BYTES`: a shared receive queue per device
    /// (`Config::srq`), or `None` without `--srq`.
    pub fn srq(&self) -> Option<rdma_reactor::SrqConfig> {
        if !self.switch("srq") {
            return None;
        }
        let d = rdma_reactor::SrqConfig::default();
        let receives = self.get("srq-receives", d.receives);
        Some(rdma_reactor::SrqConfig {
            receives,
            credit: self.get("srq-credit", d.credit),
            max_credit: self.get("srq-max-credit", d.max_credit),
            buf_size: self.size("srq-size", d.buf_size as usize) as u32,
            low_water: receives / 4,
            reserve: self.get("srq-reserve", receives / 32),
        })
    }

    /// `cfg` with the shared receive queue of [`Args::srq`], if any (the runtime gives each
    /// device's pool a size class of exactly its buffer size when that is below the smallest).
    pub fn with_srq(&self, cfg: rdma_reactor::Config) -> rdma_reactor::Config {
        rdma_reactor::Config { srq: self.srq(), ..cfg }
    }

    /// The value flags [`Args::srq`] reads (`srq` itself is a switch).
    pub const SRQ: [&'static str; 5] = ["srq-receives", "srq-credit", "srq-max-credit", "srq-size", "srq-reserve"];

    /// `--marks N,N,...`: live-connection counts at which a server prints a `mark` line.
    pub fn marks(&self) -> Vec<u64> {
        let v: String = self.get("marks", String::new());
        v.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.trim().parse().unwrap_or_else(|e| fail(self.usage, &format!("--marks {s:?}: {e}"))))
            .collect()
    }

    /// A required socket address: `IPV4:PORT`, `[IPV6]:PORT`, `[IPV6%SCOPE]:PORT` (the scope a
    /// number or an interface's name, as in `[fe80::2:1%s0]:7471`) or `HOST:PORT`.
    pub fn addr(&self, name: &str) -> SocketAddr {
        let Some(v) = self.values.get(name) else { fail(self.usage, &format!("--{name} ADDR:PORT is required")) };
        parse_addr(v).unwrap_or_else(|e| fail(self.usage, &format!("--{name} {v:?}: {e}")))
    }

    /// A byte size: a number with an optional K, M or G suffix (powers of 1024).
    pub fn size(&self, name: &str, default: usize) -> usize {
        match self.values.get(name) {
            None => default,
            Some(v) => parse_size(v).unwrap_or_else(|| fail(self.usage, &format!("--{name} {v:?}: not a size"))),
        }
    }

    /// Rejects flags no one asked about.
    pub fn finish(&self, known: &[&str]) {
        for k in self.values.keys() {
            if !known.contains(&k.as_str()) {
                fail(self.usage, &format!("unknown flag --{k}"));
            }
        }
    }
}

/// Prints the `mark` line a test parses when the live connections reach one of `marks`:
/// `PROGRAM server: mark N live N registered_bytes B srq_receives R`.
pub fn print_mark(program: &str, marks: &[u64], live: u64, stats: &rdma_reactor::Stats) {
    if marks.contains(&live) {
        println!(
            "{program} server: mark {live} live {} registered_bytes {} srq_receives {}",
            stats.connections, stats.registered_bytes, stats.srq_receives
        );
    }
}

/// Parses a socket address: `IPV4:PORT`, `[IPV6]:PORT`, `[IPV6%SCOPE]:PORT` with the scope as a
/// number or an interface's name (looked up with `if_nametoindex`), or `HOST:PORT` (resolved,
/// the first address).
pub fn parse_addr(v: &str) -> Result<SocketAddr, String> {
    if let Some(rest) = v.strip_prefix('[') {
        let Some((host, port)) = rest.split_once(']') else { return Err("no `]` after `[IPV6`".into()) };
        let Some(port) = port.strip_prefix(':') else { return Err("expected `[IPV6]:PORT`".into()) };
        let port: u16 = port.parse().map_err(|e| format!("port {port:?}: {e}"))?;
        let (ip, scope) = match host.split_once('%') {
            Some((ip, scope)) => (ip, Some(scope)),
            None => (host, None),
        };
        let ip: std::net::Ipv6Addr = ip.parse().map_err(|e| format!("{ip:?}: not an IPv6 address: {e}"))?;
        let scope_id = match scope {
            None => 0,
            Some("") => return Err("an empty scope after `%`".into()),
            Some(s) if s.bytes().all(|b| b.is_ascii_digit()) => s.parse().map_err(|e| format!("scope {s:?}: {e}"))?,
            Some(s) => interface_index(s)?,
        };
        return Ok(SocketAddr::V6(std::net::SocketAddrV6::new(ip, port, 0, scope_id)));
    }
    match v.to_socket_addrs() {
        Ok(mut a) => a.next().ok_or_else(|| "resolves to no address".to_string()),
        Err(e) => Err(format!("not an address:port ({e})")),
    }
}

/// The index of the network interface `name` (an IPv6 scope), or an error naming it.
pub fn interface_index(name: &str) -> Result<u32, String> {
    let c = std::ffi::CString::new(name).map_err(|_| format!("interface name {name:?} has a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated string that lives across the call; if_nametoindex only
    // reads it.
    let index = unsafe { nix::libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        return Err(format!("no network interface {name:?} (the scope after `%`)"));
    }
    Ok(index)
}

/// Parses `4096`, `64K`, `1M`, `1G`.
pub fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim();
    let (num, mul) = match v.chars().last()? {
        'k' | 'K' => (&v[..v.len() - 1], 1024),
        'm' | 'M' => (&v[..v.len() - 1], 1024 * 1024),
        'g' | 'G' => (&v[..v.len() - 1], 1024 * 1024 * 1024),
        _ => (v, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

/// Runs a client's `reactor` until it is idle (dying with `program`'s name if the loop itself
/// fails, waiting at most `wait` per tick), and calls `check(reactor, now)` after every idle
/// tick and every 64th busy one, `now` being the counter's nanoseconds since `clock` started:
/// the clients' progress lines and hold checks. The counter, not the system clock, and not on
/// every tick: the system clock can be a system call (the test VM's HPET), and this loop runs
/// once per tick.
pub fn run_client(
    program: &str,
    reactor: &mut rdma_reactor::Reactor,
    wait: std::time::Duration,
    clock: &Clock,
    mut check: impl FnMut(&mut rdma_reactor::Reactor, u64),
) {
    let mut ticks = 0u32;
    while !reactor.is_idle() {
        let work = match reactor.run_once(Some(wait)) {
            Ok(work) => work,
            Err(e) => die(program, &format!("reactor failed: {}", report(&e))),
        };
        ticks = ticks.wrapping_add(1);
        if work == 0 || ticks % 64 == 0 {
            check(reactor, clock.elapsed_ns());
        }
    }
}

/// Prints `program: msg` and exits 1 (a failure at run time, not a usage error).
pub fn die(program: &str, msg: &str) -> ! {
    eprintln!("{program}: {msg}");
    exit(1)
}

/// An error and its causes on one line (`a: b: c`): the crate's errors leave their cause to
/// `source()`.
pub fn report(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// Prints the error and the usage, exits 2.
pub fn fail(usage: &str, msg: &str) -> ! {
    eprintln!("error: {msg}\n\n{usage}");
    exit(2)
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Formats nanoseconds as microseconds.
/// A cheap clock for timing round trips: the CPU's time-stamp counter on x86_64 (perftest
/// times with it too), calibrated against the system clock. Reading the system clock can be a
/// system call (an emulated HPET in the test VM costs tens of microseconds), which would be
/// counted into every round trip it times.
pub struct Clock {
    t0: std::time::Instant,
    c0: u64,
    ns_per_tick: f64,
}

impl Clock {
    /// Starts the clock; calibrates the counter over 20 ms.
    pub fn new() -> Clock {
        let (t0, c0) = (std::time::Instant::now(), Clock::ticks());
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut c = Clock { t0, c0, ns_per_tick: 1.0 };
        c.calibrate();
        c
    }

    /// The counter.
    pub fn ticks() -> u64 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: rdtsc reads the time-stamp counter; it has no preconditions and touches no
        // memory.
        return unsafe { std::arch::x86_64::_rdtsc() };
        #[cfg(not(target_arch = "x86_64"))]
        {
            use std::sync::OnceLock;
            static BASE: OnceLock<std::time::Instant> = OnceLock::new();
            BASE.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64
        }
    }

    /// Re-measures the rate over everything since the start (more precise at the end of a run).
    pub fn calibrate(&mut self) {
        let ns = self.t0.elapsed().as_nanos() as f64;
        let ticks = Clock::ticks().wrapping_sub(self.c0).max(1) as f64;
        self.ns_per_tick = ns / ticks;
    }

    /// Nanoseconds in `ticks` counter ticks.
    pub fn ns(&self, ticks: u64) -> u64 {
        (ticks as f64 * self.ns_per_tick) as u64
    }

    /// Nanoseconds since the clock started, by the counter.
    pub fn elapsed_ns(&self) -> u64 {
        self.ns(Clock::ticks().wrapping_sub(self.c0))
    }
}

/// Formats nanoseconds as microseconds.
pub fn us(ns: u64) -> String {
    format!("{:.1} us", ns as f64 / 1000.0)
}

/// The round-trip report of the echo clients (`cargo xtask bench` reads its `p50` and `rate:`
/// lines): what ran, the latency distribution of `sorted` (nanoseconds, sorted) and the rate.
pub fn print_round_trips(
    program: &str,
    sorted: &[u64],
    size: usize,
    clients: u64,
    elapsed: std::time::Duration,
    verify: bool,
) {
    let msgs = sorted.len() as u64;
    println!(
        "{program} client: {msgs} round trips of {size} bytes over {clients} connection(s) in {:.3} s{}",
        elapsed.as_secs_f64(),
        if verify { ", every byte verified" } else { "" }
    );
    if let (Some(min), Some(max)) = (sorted.first(), sorted.last()) {
        println!(
            "latency: min {}  p50 {}  p99 {}  p99.9 {}  max {}",
            us(*min),
            us(percentile(sorted, 50.0)),
            us(percentile(sorted, 99.0)),
            us(percentile(sorted, 99.9)),
            us(*max)
        );
        println!("rate: {:.0} messages/s", msgs as f64 / elapsed.as_secs_f64());
    }
}

/// A deterministic byte pattern for message `seq` of connection `conn`, so every byte can be
/// checked.
pub fn fill_pattern(buf: &mut [u8], conn: u64, seq: u64) {
    let mut x = conn.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seq.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ 0x5555;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Index of the first byte where `buf` differs from the pattern, if any.
pub fn check_pattern(buf: &[u8], conn: u64, seq: u64) -> Option<usize> {
    let mut want = vec![0u8; buf.len()];
    fill_pattern(&mut want, conn, seq);
    buf.iter().zip(&want).position(|(a, b)| a != b)
}

/// A numbered message (at least 8 bytes): its sequence number in the first 8 bytes (little
/// endian), then the pattern of ([`fill_pattern`]) `conn` and `seq`. A receiver checks it
/// without knowing which message comes next (a reconnecting sender resends what it could not
/// confirm, over a new connection).
pub fn fill_numbered(buf: &mut [u8], conn: u64, seq: u64) {
    fill_pattern(buf, conn, seq);
    buf[..8].copy_from_slice(&seq.to_le_bytes());
}

/// A numbered message's sequence number, or the index of its first byte that is not as
/// [`fill_numbered`] wrote it.
pub fn check_numbered(buf: &[u8], conn: u64) -> Result<u64, usize> {
    let seq = u64::from_le_bytes(buf.get(..8).ok_or(buf.len())?.try_into().expect("8 bytes"));
    let mut want = vec![0u8; buf.len()];
    fill_numbered(&mut want, conn, seq);
    match buf.iter().zip(&want).position(|(a, b)| a != b) {
        None => Ok(seq),
        Some(at) => Err(at),
    }
}
