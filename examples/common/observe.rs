//! What an operator watches: the runtime's log lines on stderr (`RUST_LOG`, with the crate's
//! feature `log`) and a Prometheus endpoint (`--metrics ADDR:PORT`) served from the reactor's
//! own thread, on a TCP socket registered with it as a user fd.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Instant;

use rdma_reactor::{Ctx, FdEvent, Interest, Readiness};

/// A logger for the `log` facade writing `[secs LEVEL target] message` to stderr, at the level
/// `RUST_LOG` names (`error`, `warn`, `info`, `debug`, `trace`; `target=level` pairs
/// separated by commas are taken too, the most verbose level winning). Unset: no logger.
/// Without the crate's feature `log` the runtime logs nothing, which it says once.
pub fn init_logging(program: &'static str) {
    let Ok(spec) = std::env::var("RUST_LOG") else { return };
    let level = spec
        .split(',')
        .filter_map(|part| part.rsplit('=').next())
        .filter_map(|l| l.trim().parse::<log::LevelFilter>().ok())
        .max()
        .unwrap_or(log::LevelFilter::Error);
    // Installed once for the life of the process (`log` keeps a `&'static` logger).
    let logger: &'static StderrLogger = Box::leak(Box::new(StderrLogger { program, start: Instant::now() }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
    if !cfg!(feature = "log") {
        eprintln!("{program}: RUST_LOG is set, but rdma-reactor was built without its feature `log`: it logs nothing");
    }
}

struct StderrLogger {
    program: &'static str,
    start: Instant,
}

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let secs = self.start.elapsed().as_secs_f64();
            eprintln!("[{secs:9.3} {:<5} {} {}] {}", record.level(), self.program, record.target(), record.args());
        }
    }

    fn flush(&self) {}
}

/// Largest request taken (headers included).
const MAX_REQUEST: usize = 8 * 1024;

/// Serves `GET /metrics` on `addr` from this reactor (`Reactor::prometheus`, every sample
/// labelled `reactor="INDEX"`): a non-blocking listening socket registered with the reactor,
/// and a registration per HTTP connection, which reads the request, writes the answer as the
/// socket takes it (`WRITABLE` only while there is something to write) and closes. Nothing
/// blocks the reactor's thread.
pub fn serve_metrics(ctx: &mut Ctx<'_>, addr: SocketAddr, index: usize) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let fd = listener.try_clone()?;
    ctx.register_fd(&fd, Interest::READABLE, 0, move |ctx: &mut Ctx<'_>, _ev: FdEvent| loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                let mut http = Http { stream, request: Vec::new(), answer: Vec::new(), sent: 0, index };
                // The reactor registers a duplicate of this one, closed when it returns.
                let registered = http.stream.try_clone().and_then(|fd| {
                    ctx.register_fd(&fd, Interest::READABLE, 0, move |ctx: &mut Ctx<'_>, ev: FdEvent| {
                        http.on_ready(ctx, ev)
                    })
                    .map_err(|e| std::io::Error::other(e.to_string()))
                });
                if let Err(e) = registered {
                    eprintln!("metrics: cannot take a connection: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                eprintln!("metrics: accept on {addr}: {e}");
                break;
            }
        }
    })
    .map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(())
}

/// One HTTP connection of the metrics endpoint.
struct Http {
    stream: TcpStream,
    request: Vec<u8>,
    answer: Vec<u8>,
    sent: usize,
    index: usize,
}

impl Http {
    fn on_ready(&mut self, ctx: &mut Ctx<'_>, ev: FdEvent) {
        if ev.readiness.intersects(Readiness::ERROR) {
            ctx.deregister_fd(ev.token);
            return;
        }
        if self.answer.is_empty() {
            if !self.read_request(ctx, ev) {
                return;
            }
            let _ = ctx.set_fd_interest(ev.token, Interest::WRITABLE);
        }
        while self.sent < self.answer.len() {
            match self.stream.write(&self.answer[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        // Answered (or the peer went away): the registration's drop closes the socket.
        ctx.deregister_fd(ev.token);
    }

    /// Reads what the socket has; true once the request is complete and answered in
    /// `self.answer`.
    fn read_request(&mut self, ctx: &mut Ctx<'_>, ev: FdEvent) -> bool {
        let mut chunk = [0u8; 2048];
        // The client may close its side right after its request (`nc`, HTTP/1.0 clients): what
        // came before the end is still a request to answer.
        let mut ended = false;
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => self.request.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    ctx.deregister_fd(ev.token);
                    return false;
                }
            }
            if self.request.len() > MAX_REQUEST {
                break;
            }
        }
        let complete = self.request.windows(4).any(|w| w == b"\r\n\r\n");
        if !complete && ended {
            ctx.deregister_fd(ev.token);
            return false;
        }
        if !complete && self.request.len() <= MAX_REQUEST {
            return false;
        }
        let line = self.request.split(|&b| b == b'\r').next().unwrap_or_default();
        let (status, ctype, body) = if !complete {
            ("431 Request Header Fields Too Large", "text/plain", "request too large\n".to_string())
        } else if line.starts_with(b"GET /metrics ") || line == b"GET /metrics" {
            let index = self.index.to_string();
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", ctx.prometheus(&[("reactor", &index)]))
        } else if line.starts_with(b"GET ") {
            ("404 Not Found", "text/plain", "only /metrics is here\n".to_string())
        } else {
            ("405 Method Not Allowed", "text/plain", "only GET /metrics\n".to_string())
        };
        self.answer = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes();
        true
    }
}
