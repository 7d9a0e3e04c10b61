//! Booting the VM with qemu and reading its serial console.
//!
//! The guest's init prints marker lines `@@xtask-NONCE:PAYLOAD@@` (the nonce is fresh per boot):
//! `start` right before the command runs, `exit=N` after, `setup-failed MSG` if bring-up fails;
//! the test runner adds its own. Markers are taken out of the stream; console output before
//! `start` (boot noise) is kept back and shown only when something goes wrong (or with
//! `--verbose`); output after it is the command's and streams through.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::bail;
use crate::guest;
use crate::setup::Kernel;
use crate::util::{self, Error, Result};

/// Memory of the VM, MiB.
const MEMORY_MIB: u32 = 2048;
/// How long a KVM probe boot may take before KVM is judged not to work.
const PROBE_TIMEOUT: Duration = Duration::from_secs(12);

/// How qemu executes the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// Software emulation (multi-threaded TCG).
    Tcg,
}

impl Accel {
    fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// A piece of the guest's console stream.
#[derive(Debug, PartialEq)]
pub enum Piece<'a> {
    /// Ordinary output.
    Text(&'a [u8]),
    /// A marker's payload.
    Marker(&'a str),
}

/// Splits the console stream into text and markers, passing text on as soon as it cannot be
/// the start of a marker.
pub struct Splitter {
    prefix: Vec<u8>,
    buf: Vec<u8>,
    skip_newline: bool,
}

/// A marker longer than this is not one.
const MAX_MARKER: usize = 4096;

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

impl Splitter {
    /// A splitter for markers starting with `prefix`.
    pub fn new(prefix: &str) -> Self {
        Splitter { prefix: prefix.as_bytes().to_vec(), buf: Vec::new(), skip_newline: false }
    }

    /// Feeds bytes in; calls `out` for each piece recognised so far.
    pub fn push(&mut self, data: &[u8], out: &mut dyn FnMut(Piece)) {
        self.buf.extend_from_slice(data);
        loop {
            if self.skip_newline && !self.buf.is_empty() {
                if self.buf.starts_with(b"\r\n") {
                    self.buf.drain(..2);
                } else if self.buf[0] == b'\n' {
                    self.buf.drain(..1);
                } else if self.buf == b"\r" {
                    return;
                }
                self.skip_newline = false;
            }
            match find(&self.buf, &self.prefix) {
                Some(i) => {
                    if i > 0 {
                        out(Piece::Text(&self.buf[..i]));
                        self.buf.drain(..i);
                    }
                    let body = &self.buf[self.prefix.len()..];
                    let end = find(body, b"@@");
                    let nl = body.iter().position(|&b| b == b'\n');
                    match (end, nl) {
                        (Some(e), nl) if nl.is_none_or(|n| n > e) => {
                            let payload = String::from_utf8_lossy(&body[..e]).into_owned();
                            let consumed = self.prefix.len() + e + 2;
                            out(Piece::Marker(&payload));
                            self.buf.drain(..consumed);
                            self.skip_newline = true;
                        }
                        (_, Some(_)) => {
                            // A newline inside: not a marker after all.
                            out(Piece::Text(&self.buf[..1]));
                            self.buf.drain(..1);
                        }
                        _ if self.buf.len() > MAX_MARKER => {
                            out(Piece::Text(&self.buf[..1]));
                            self.buf.drain(..1);
                        }
                        _ => return,
                    }
                }
                None => {
                    // Keep back only a tail that could still grow into the prefix.
                    let keep = (1..self.prefix.len().min(self.buf.len() + 1))
                        .rev()
                        .find(|&k| self.buf.ends_with(&self.prefix[..k]))
                        .unwrap_or(0);
                    let emit = self.buf.len() - keep;
                    if emit > 0 {
                        out(Piece::Text(&self.buf[..emit]));
                        self.buf.drain(..emit);
                    }
                    return;
                }
            }
        }
    }

    /// Whatever is still held back (at the end of the stream).
    pub fn finish(&mut self, out: &mut dyn FnMut(Piece)) {
        if !self.buf.is_empty() {
            out(Piece::Text(&self.buf));
            self.buf.clear();
        }
    }
}

/// What the caller sees of a boot.
pub enum Event<'a> {
    /// The command's console output (after `start`).
    Output(&'a [u8]),
    /// Console output before `start` (kernel and init messages), only with `verbose`.
    Console(&'a [u8]),
    /// A marker other than start/exit/setup-failed.
    Marker(&'a str),
}

/// How a boot ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The command exited with this status.
    Exited(i32),
    /// The timeout struck; qemu was killed.
    TimedOut,
    /// The caller asked it to stop ([`Boot::stop`]); qemu was killed.
    Stopped,
}

/// The host end of a two-VM link: the only host address the link may use (the VMs' own
/// addresses never leave qemu).
pub const LINK_HOST: &str = "127.0.0.1";

/// A virtio NIC whose frames qemu carries as UDP datagrams between two ports on
/// [`LINK_HOST`] (qemu's `dgram` netdev): two VMs with mirrored ports share one Ethernet link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    /// Which of the VM's links this is (qemu's netdev `link{index}`).
    pub index: usize,
    /// The UDP port this VM's qemu receives on.
    pub local_port: u16,
    /// The UDP port the peer's qemu receives on.
    pub remote_port: u16,
    /// The NIC's MAC address.
    pub mac: String,
}

impl Nic {
    /// qemu's arguments for this NIC.
    fn qemu_args(&self) -> Vec<String> {
        vec![
            "-netdev".into(),
            format!(
                "dgram,id=link{},local.type=inet,local.host={LINK_HOST},local.port={},\
                 remote.type=inet,remote.host={LINK_HOST},remote.port={}",
                self.index, self.local_port, self.remote_port
            ),
            "-device".into(),
            // No option ROM: the kernel is booted directly, nothing PXE-boots.
            format!("virtio-net-pci,netdev=link{},mac={},romfile=", self.index, self.mac),
        ]
    }
}

/// `n` distinct free UDP ports on [`LINK_HOST`] (bound together, read, released: another
/// program may take them before qemu does, which makes qemu fail to start with "Address already
/// in use").
pub fn free_udp_ports(n: usize) -> Result<Vec<u16>> {
    let sockets = (0..n)
        .map(|_| {
            std::net::UdpSocket::bind((LINK_HOST, 0))
                .and_then(|s| Ok((s.local_addr()?.port(), s)))
                .map_err(|e| Error::new(format!("cannot find a free UDP port on {LINK_HOST}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(sockets.into_iter().map(|(port, _)| port).collect())
}

/// One boot's parameters.
pub struct Boot<'a> {
    /// Kernel image.
    pub kernel: &'a Path,
    /// The initramfs.
    pub initrd: &'a Path,
    /// The boot's marker nonce.
    pub nonce: &'a str,
    /// Kill qemu after this long (from qemu's start).
    pub timeout: Duration,
    /// Show the whole console, boot messages included, with the kernel at loglevel 7.
    pub verbose: bool,
    /// How to execute the guest.
    pub accel: Accel,
    /// Print how long the boot took (qemu start to command start).
    pub report_boot: bool,
    /// How this VM is named in xtask's messages (`A`, `B`; empty for the single VM).
    pub label: &'a str,
    /// NICs on links to another VM; none: no network device at all (`-nic none`).
    pub nics: Vec<Nic>,
    /// When set (checked every 100 ms), qemu is killed and the run ends with
    /// [`Outcome::Stopped`].
    pub stop: Option<&'a AtomicBool>,
}

impl Boot<'_> {
    /// `xtask: ` or `xtask: A: `, the start of this boot's messages.
    fn who(&self) -> String {
        if self.label.is_empty() {
            "xtask: ".into()
        } else {
            format!("xtask: {}: ", self.label)
        }
    }
}

enum Msg {
    Out(Vec<u8>),
    OutEof,
    Err(Vec<u8>),
}

fn qemu_command(b: &Boot) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    match b.accel {
        Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max"]),
    };
    let loglevel = if b.verbose { 7 } else { 3 };
    cmd.args(["-smp", "2", "-m", &MEMORY_MIB.to_string()])
        .args(["-nodefaults", "-no-user-config", "-display", "none", "-monitor", "none", "-serial", "stdio"])
        .arg("-no-reboot");
    if b.nics.is_empty() {
        cmd.args(["-nic", "none"]);
    }
    for nic in &b.nics {
        cmd.args(nic.qemu_args());
    }
    cmd.arg("-kernel")
        .arg(b.kernel)
        .arg("-initrd")
        .arg(b.initrd)
        .arg("-append")
        .arg(format!("console=ttyS0 quiet loglevel={loglevel} panic=-1 8250.nr_uarts=1 rdinit=/init"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn reader(mut r: impl Read + Send + 'static, tx: mpsc::Sender<Msg>, err: bool) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match r.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let chunk = buf[..n].to_vec();
                    if tx.send(if err { Msg::Err(chunk) } else { Msg::Out(chunk) }).is_err() {
                        return;
                    }
                }
            }
        }
        if !err {
            let _ = tx.send(Msg::OutEof);
        }
    });
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// How long a boot may take to start its command. Boots take 4 to 11 s under TCG (the 109 of
/// four full CI runs, stop 27); one in those runs never did, its console silent, and held the
/// run for its whole VM timeout (485 s). A boot past this limit is killed and reported as an
/// error with its console's last lines.
pub const BOOT_LIMIT: Duration = Duration::from_secs(120);

/// Boots, feeds the command's output and markers to `on`, and returns how it ended. A boot
/// that does not start its command within [`BOOT_LIMIT`] is an error.
pub fn run(b: &Boot, on: &mut dyn FnMut(Event)) -> Result<Outcome> {
    let mut cmd = qemu_command(b);
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        Error::new(format!(
            "cannot start `{}`: {e} (install qemu-system-x86: `cargo xtask setup`)",
            util::describe(&cmd)
        ))
    })?;
    let (tx, rx) = mpsc::channel();
    reader(child.stdout.take().expect("piped stdout"), tx.clone(), false);
    reader(child.stderr.take().expect("piped stderr"), tx, true);

    let mut splitter = Splitter::new(&guest::marker_prefix(b.nonce));
    let mut console: Vec<u8> = Vec::new(); // boot output, held back
    let mut qemu_err: Vec<u8> = Vec::new();
    let mut running = false; // the command has started
    let mut exit: Option<i32> = None;
    let mut setup_failed: Option<String> = None;
    let mut exit_deadline: Option<Instant> = None;
    let deadline = started + b.timeout;
    let boot_limit = BOOT_LIMIT.min(b.timeout);
    let boot_deadline = started + boot_limit;
    let mut boot_hung = false;
    let poll = Duration::from_millis(100);

    let outcome = loop {
        if b.stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            kill(&mut child);
            break Some(Outcome::Stopped);
        }
        let now = Instant::now();
        let mut until = exit_deadline.map_or(deadline, |d| d.min(deadline));
        if b.stop.is_some() {
            until = until.min(now + poll);
        }
        if !running {
            if now >= boot_deadline {
                kill(&mut child);
                boot_hung = true;
                break None;
            }
            until = until.min(boot_deadline);
        }
        if now >= until {
            if exit_deadline.is_some_and(|d| now >= d) {
                // It reported, but did not power off in time: stop it.
                kill(&mut child);
                break None;
            }
            kill(&mut child);
            break Some(Outcome::TimedOut);
        }
        let msg = match rx.recv_timeout(until.saturating_duration_since(now)) {
            Ok(m) => m,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => Msg::OutEof,
        };
        match msg {
            Msg::Err(e) => qemu_err.extend_from_slice(&e),
            Msg::OutEof => {
                let _ = child.wait();
                break None;
            }
            Msg::Out(data) => {
                splitter.push(&data, &mut |p| match p {
                    Piece::Text(t) if running && exit.is_none() => {
                        on(Event::Output(t));
                    }
                    Piece::Text(t) => {
                        if b.verbose {
                            on(Event::Console(t));
                        }
                        console.extend_from_slice(t);
                    }
                    Piece::Marker("start") => {
                        running = true;
                        if b.report_boot {
                            eprintln!(
                                "{}VM boot took {:.1} s ({})",
                                b.who(),
                                started.elapsed().as_secs_f64(),
                                b.accel.name()
                            );
                        }
                    }
                    Piece::Marker(m) if m.starts_with("exit=") && running => {
                        exit = m["exit=".len()..].trim().parse().ok().or(Some(255));
                    }
                    Piece::Marker(m) if m.starts_with("setup-failed") => {
                        setup_failed = Some(m["setup-failed".len()..].trim().to_string());
                    }
                    Piece::Marker(m) => on(Event::Marker(m)),
                });
                if (exit.is_some() || setup_failed.is_some()) && exit_deadline.is_none() {
                    exit_deadline = Some(Instant::now() + Duration::from_secs(10));
                }
            }
        }
    };
    splitter.finish(&mut |p| {
        if let Piece::Text(t) = p {
            if running && exit.is_none() {
                on(Event::Output(t));
            } else {
                console.extend_from_slice(t);
            }
        }
    });
    if let Some(o) = outcome {
        return Ok(o);
    }
    let console = String::from_utf8_lossy(&console);
    let qemu_err = String::from_utf8_lossy(&qemu_err);
    let details = || {
        let mut d = String::new();
        if !console.trim().is_empty() {
            d.push_str(&format!("\n--- VM console (last lines) ---\n{}", tail(&console, 60)));
        }
        if !qemu_err.trim().is_empty() {
            d.push_str(&format!("\n--- qemu stderr ---\n{}", tail(&qemu_err, 30)));
        }
        d
    };
    if boot_hung {
        bail!(
            "the VM did not finish booting within {} s (boots take seconds: it hung){}",
            boot_limit.as_secs(),
            details()
        );
    }
    if let Some(msg) = setup_failed {
        bail!("the VM's set-up failed: {msg}{}", details());
    }
    match exit {
        Some(code) => Ok(Outcome::Exited(code)),
        None if running => {
            bail!("the VM stopped while the command was running (it reported no exit status){}", details())
        }
        None => bail!(
            "the VM stopped before the command started (after {:.1} s){}",
            started.elapsed().as_secs_f64(),
            details()
        ),
    }
}

/// A fresh nonce for one boot's markers.
pub fn nonce() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{:x}{:x}", std::process::id(), t.subsec_nanos() ^ (t.as_secs() as u32))
}

fn probe_cache_key(kernel: &Kernel) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let qemu = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").to_string())
        .unwrap_or_default();
    let image = kernel.image.file_name().unwrap_or_default().to_string_lossy().into_owned();
    format!("guest={}/{image} host={} qemu={}", kernel.package, host.trim(), qemu.trim())
}

fn kvm_usable() -> bool {
    std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok()
}

/// KVM when `/dev/kvm` is usable and a short probe boot shows the guest kernel boots under it
/// (the result is cached per guest kernel, host kernel and qemu); else TCG.
/// `XTASK_ACCEL=kvm|tcg` overrides.
pub fn choose_accel(kernel: &Kernel) -> Result<Accel> {
    match std::env::var("XTASK_ACCEL").as_deref() {
        Ok("kvm") => return Ok(Accel::Kvm),
        Ok("tcg") => return Ok(Accel::Tcg),
        Ok("") | Err(_) => {}
        Ok(other) => bail!("XTASK_ACCEL={other}: expected kvm or tcg"),
    }
    if !kvm_usable() {
        return Ok(Accel::Tcg);
    }
    let cache: PathBuf = util::xtask_dir().join("accel-probe");
    let key = probe_cache_key(kernel);
    if let Ok(text) = std::fs::read_to_string(&cache) {
        if let Some((k, v)) = text.trim().rsplit_once(" => ") {
            if k == key {
                return Ok(if v == "kvm" { Accel::Kvm } else { Accel::Tcg });
            }
        }
    }
    eprintln!("xtask: /dev/kvm is there: probing whether the guest kernel boots under KVM (once; cached)");
    let nonce = nonce();
    let initrd = guest::pack_probe(&nonce)?;
    let boot = Boot {
        kernel: &kernel.image,
        initrd: initrd.path(),
        nonce: &nonce,
        timeout: PROBE_TIMEOUT,
        verbose: false,
        accel: Accel::Kvm,
        report_boot: false,
        label: "",
        nics: Vec::new(),
        stop: None,
    };
    let t = Instant::now();
    let accel = match run(&boot, &mut |_| {}) {
        Ok(Outcome::Exited(0)) => Accel::Kvm,
        _ => Accel::Tcg,
    };
    eprintln!(
        "xtask: KVM probe: {} after {:.1} s; using {}",
        if accel == Accel::Kvm { "booted" } else { "did not boot" },
        t.elapsed().as_secs_f64(),
        accel.name()
    );
    if let Err(e) = util::write_file(&cache, format!("{key} => {}\n", accel.name())) {
        eprintln!("xtask: warning: cannot cache the KVM probe result: {e}");
    }
    Ok(accel)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&str]) -> Vec<String> {
        let mut s = Splitter::new("@@x-1:");
        let mut out = Vec::new();
        let mut text = String::new();
        for c in chunks {
            s.push(c.as_bytes(), &mut |p| match p {
                Piece::Text(t) => text.push_str(std::str::from_utf8(t).unwrap()),
                Piece::Marker(m) => {
                    if !text.is_empty() {
                        out.push(std::mem::take(&mut text));
                    }
                    out.push(format!("<{m}>"));
                }
            });
        }
        s.finish(&mut |p| {
            if let Piece::Text(t) = p {
                text.push_str(std::str::from_utf8(t).unwrap())
            }
        });
        if !text.is_empty() {
            out.push(text);
        }
        out
    }

    #[test]
    fn markers_are_removed_with_their_newline() {
        assert_eq!(
            split(&["boot\n@@x-1:start@@\nhello\n@@x-1:exit=7@@\n"]),
            ["boot\n", "<start>", "hello\n", "<exit=7>"]
        );
        assert_eq!(split(&["@@x-1:start@@\r\nhi"]), ["<start>", "hi"]);
    }

    #[test]
    fn markers_split_across_chunks_and_mid_line() {
        let chunks = ["no newline@", "@x", "-1:ex", "it=3@", "@", "\n", "after"];
        assert_eq!(split(&chunks), ["no newline", "<exit=3>", "after"]);
    }

    #[test]
    fn text_is_not_held_back_unless_it_may_be_a_marker() {
        let mut s = Splitter::new("@@x-1:");
        let mut got = Vec::new();
        s.push(b"partial line @", &mut |p| {
            if let Piece::Text(t) = p {
                got.extend_from_slice(t)
            }
        });
        assert_eq!(got, b"partial line ");
        s.push(b"x", &mut |p| {
            if let Piece::Text(t) = p {
                got.extend_from_slice(t)
            }
        });
        assert_eq!(got, b"partial line @x");
    }

    #[test]
    fn the_link_uses_the_loopback_only() {
        let nic = Nic { index: 1, local_port: 4000, remote_port: 4001, mac: "52:54:00:19:00:01".into() };
        let args = nic.qemu_args();
        assert_eq!(
            args[1],
            "dgram,id=link1,local.type=inet,local.host=127.0.0.1,local.port=4000,\
             remote.type=inet,remote.host=127.0.0.1,remote.port=4001"
        );
        assert_eq!(args[3], "virtio-net-pci,netdev=link1,mac=52:54:00:19:00:01,romfile=");
        let p = free_udp_ports(4).unwrap();
        assert!(p.iter().all(|&x| x != 0) && (1..4).all(|i| !p[..i].contains(&p[i])), "{p:?}");
    }

    #[test]
    fn near_misses_stay_text() {
        assert_eq!(split(&["@@x-1:broken\nline\n"]), ["@@x-1:broken\nline\n"]);
        assert_eq!(split(&["@@x-2:start@@\n"]), ["@@x-2:start@@\n"]);
    }
}
