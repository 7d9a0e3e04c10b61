//! Running on a host that has a real (active) RDMA device instead of in the VM.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::bail;
use crate::project::{self, Binaries};
use crate::util::{self, Error, Result};

/// The variable that forces host mode (`1`) or the VM (`0`); unset means: detect.
pub const HOST_RDMA_ENV: &str = "RDMA_REACTOR_HOST_RDMA";

/// True when tests and the demo should run on this host: `RDMA_REACTOR_HOST_RDMA=1`, or
/// `ibv_devinfo` shows a port in state PORT_ACTIVE (and the variable is not `0`).
pub fn use_host_rdma() -> Result<bool> {
    match std::env::var(HOST_RDMA_ENV).as_deref() {
        Ok("1") => return Ok(true),
        Ok("0") => return Ok(false),
        Ok("") | Err(_) => {}
        Ok(other) => bail!("{HOST_RDMA_ENV}={other}: expected 1 (use this host's RDMA device) or 0 (use the VM)"),
    }
    let Some(devinfo) = util::which("ibv_devinfo") else {
        return Ok(false);
    };
    let active = Command::new(devinfo)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("PORT_ACTIVE"))
        .unwrap_or(false);
    Ok(active)
}

/// `RDMA_ADDR` for host mode: it must be set (the address of an interface with an RDMA device).
pub fn rdma_addr() -> Result<String> {
    match std::env::var("RDMA_ADDR") {
        Ok(a) if !a.trim().is_empty() => Ok(a),
        _ => Err(Error::new(
            "the RDMA binaries run on this host (it has an active RDMA port, or \
             RDMA_REACTOR_HOST_RDMA=1), and they need RDMA_ADDR: set it to the IP address of the \
             RDMA-capable interface (e.g. RDMA_ADDR=192.0.2.10), or set RDMA_REACTOR_HOST_RDMA=0 \
             to use the VM",
        )),
    }
}

/// The host's `$BIN`: `target/xtask/host-bin`, with a link per example and test binary.
pub fn bin_dir(bins: &Binaries) -> Result<PathBuf> {
    let dir = util::xtask_dir().join("host-bin");
    project::link_dir(bins, &dir)?;
    Ok(dir)
}

/// The environment the VM gives commands, host-style.
pub fn env(cmd: &mut Command, bin: &std::path::Path, addr: &str) {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin.to_path_buf()];
    paths.extend(std::env::split_paths(&path));
    cmd.env("BIN", bin).env("RDMA_ADDR", addr).env("RUST_BACKTRACE", "1");
    if let Ok(p) = std::env::join_paths(paths) {
        cmd.env("PATH", p);
    }
}

/// A finished watched process.
pub struct Watched {
    /// Its exit status (None when it was killed by the watchdog).
    pub status: Option<ExitStatus>,
    /// The watchdog killed it.
    pub killed: bool,
    /// How long it ran.
    pub elapsed: Duration,
}

/// Runs `cmd` with its stdout read line by line into `on_line` (stderr inherited), killing it
/// after `timeout`.
pub fn run_watched(cmd: &mut Command, timeout: Duration, on_line: &mut dyn FnMut(&str)) -> Result<Watched> {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Error::new(format!("cannot run `{}`: {e}", util::describe(cmd))))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = Vec::new();
        while r.read_until(b'\n', &mut line).map(|n| n > 0).unwrap_or(false) {
            if tx.send(String::from_utf8_lossy(&line).into_owned()).is_err() {
                break;
            }
            line.clear();
        }
    });
    let deadline = start + timeout;
    let mut killed = false;
    loop {
        let now = Instant::now();
        if now >= deadline {
            let _ = child.kill();
            killed = true;
            break;
        }
        match rx.recv_timeout((deadline - now).min(Duration::from_millis(200))) {
            Ok(line) => {
                print!("{line}");
                let _ = std::io::stdout().flush();
                on_line(line.trim_end());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // stdout is closed; the process may live on: keep the watchdog on it.
                while !killed && matches!(child.try_wait(), Ok(None)) {
                    if Instant::now() >= deadline {
                        let _ = child.kill();
                        killed = true;
                    } else {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                break;
            }
        }
    }
    let status = child.wait().map_err(|e| Error::new(format!("waiting for `{}`: {e}", util::describe(cmd))))?;
    // Lines still in the channel (after a kill or at the end).
    for line in rx.try_iter() {
        print!("{line}");
        on_line(line.trim_end());
    }
    Ok(Watched { status: (!killed).then_some(status), killed, elapsed: start.elapsed() })
}
