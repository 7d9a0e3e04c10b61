//! One tokio program serving RDMA and a TCP control port (feature `tokio`): an echo server of
//! the async face (`rdma_reactor::io`) driven by `io::tokio::drive` inside a tokio
//! current-thread runtime, next to a `tokio::net::TcpListener` in the same task.
//!
//! ```text
//! tokio_control --bind ADDR:PORT --control ADDR:PORT
//! ```
//!
//! The control port takes one command per line: `stats` answers with the connections served,
//! the messages echoed and the reactor's counters; `quit` answers `bye` and stops the
//! program. Any `echo client` (or `aecho client`) can use the RDMA side.
//!
//! The control port serves up to 8 connections at once (a task of the reactor each; a ninth is
//! told `error: busy` and closed) and survives what a peer sends: a line that is not UTF-8,
//! longer than 4 KiB (never buffered beyond that) or no command is answered with an `error: `
//! line and the connection goes on; a connection reset, silent for a minute or open for ten
//! ends that connection alone. So one client cannot hold the port (the review of 2026-12-07,
//! X3: served one at a time, a client sending a byte a minute held it for 600 s). `quit` is
//! not authenticated: bind the control port to a loopback address (or one only operators
//! reach).

mod common;

use std::cell::RefCell;
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use common::observe::{classify, AcceptError};
use common::Args;
use rdma_reactor::io::{self, Connection, Listener};
use rdma_reactor::{Error, Reactor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const USAGE: &str = "\
usage: tokio_control --bind ADDR:PORT --control ADDR:PORT

An RDMA echo server and a TCP control port in one tokio program.
  --bind ADDR:PORT     RDMA address to serve echo clients on
  --control ADDR:PORT  TCP address of the control port: `stats` or `quit`, one per line (up to
                       8 connections at once; a bad line is answered `error: ...`; a connection
                       silent for 60 s, or open for 600 s, is closed). `quit` asks no password:
                       bind it to a loopback address";

/// The longest control line taken; the bytes of a longer one are dropped up to its end.
const MAX_LINE: usize = 4096;

/// A control connection that sends nothing (or reads nothing) this long is closed.
const CONTROL_IDLE: Duration = Duration::from_secs(60);

/// Control connections served at once; one more is told it is busy and closed.
const MAX_SESSIONS: usize = 8;

/// The longest a control connection lasts, whatever it does: a peer trickling a byte before
/// each [`CONTROL_IDLE`] runs out cannot hold the port (and lock out `quit`) for longer.
const CONTROL_SESSION: Duration = Duration::from_secs(600);

#[derive(Default)]
struct Counts {
    served: u64,
    live: u64,
    echoed: u64,
}

async fn echo(conn: Connection, counts: Rc<RefCell<Counts>>) {
    while let Ok(msg) = conn.recv().await {
        if conn.send(msg).await.0.is_err() {
            break;
        }
        counts.borrow_mut().echoed += 1;
    }
    let mut c = counts.borrow_mut();
    c.live -= 1;
    c.served += 1;
}

async fn serve_rdma(listener: Listener, counts: Rc<RefCell<Counts>>) -> Result<(), Error> {
    loop {
        let conn = listener.accept().await?;
        counts.borrow_mut().live += 1;
        let _task = io::spawn(echo(conn, counts.clone()))?;
    }
}

/// One line of the control port, as [`Lines`] cut it.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// A line of text, without its end (`\n` or `\r\n`).
    Text(String),
    /// A line that is not UTF-8.
    NotUtf8,
    /// A line longer than [`MAX_LINE`]: told as soon as it is, its bytes dropped up to its end.
    TooLong,
}

/// Cuts the bytes of a control connection into [`Line`]s, holding at most [`MAX_LINE`] bytes.
#[derive(Debug, Default)]
struct Lines {
    buf: Vec<u8>,
    /// Dropping the rest of a line found too long.
    skipping: bool,
}

impl Lines {
    /// `bytes` as read: the lines they complete, in order, appended to `out`.
    fn push(&mut self, bytes: &[u8], out: &mut Vec<Line>) {
        for piece in bytes.split_inclusive(|&b| b == b'\n') {
            let ended = piece.last() == Some(&b'\n');
            let body = if ended { &piece[..piece.len() - 1] } else { piece };
            if !self.skipping {
                if self.buf.len() + body.len() > MAX_LINE {
                    self.buf = Vec::new();
                    self.skipping = true;
                    out.push(Line::TooLong);
                } else {
                    self.buf.extend_from_slice(body);
                }
            }
            if ended {
                if !self.skipping {
                    out.push(Self::line(std::mem::take(&mut self.buf)));
                }
                self.skipping = false;
            }
        }
    }

    /// The end of the stream: the last line if it had no end of line.
    fn finish(&mut self) -> Option<Line> {
        let last = std::mem::take(&mut self.buf);
        (!last.is_empty() && !std::mem::take(&mut self.skipping)).then(|| Self::line(last))
    }

    fn line(mut bytes: Vec<u8>) -> Line {
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
        String::from_utf8(bytes).map_or(Line::NotUtf8, Line::Text)
    }
}

/// The answer to `line` (empty for a blank line), and whether it was `quit`.
fn answer(line: Line, counts: &RefCell<Counts>) -> (String, bool) {
    let text = match line {
        Line::Text(t) => t,
        Line::NotUtf8 => return ("error: the line is not UTF-8: stats or quit\n".into(), false),
        Line::TooLong => return (format!("error: a line longer than {MAX_LINE} bytes (ignored to its end)\n"), false),
    };
    match text.trim() {
        "" => (String::new(), false),
        "stats" => match io::stats() {
            Ok(st) => {
                let c = counts.borrow();
                let text = format!(
                    "served {} live {} echoed {}; reactor: connections {}, completions {}, wakeups {}, registered {} B\n",
                    c.served, c.live, c.echoed, st.connections, st.completions, st.wakeups, st.registered_bytes
                );
                (text, false)
            }
            Err(e) => (format!("error: no stats: {}\n", common::report(&e)), false),
        },
        "quit" => ("bye\n".into(), true),
        other => (format!("error: unknown command {other:?}: stats or quit\n"), false),
    }
}

/// `f`, or a `TimedOut` error after [`CONTROL_IDLE`].
async fn within<T>(f: impl Future<Output = std::io::Result<T>>) -> std::io::Result<T> {
    tokio::time::timeout(CONTROL_IDLE, f)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "silent for 60 s")))
}

/// One control connection, until its peer closes it (false), says `quit` (true), or an error
/// (a reset, a timeout) ends it.
async fn session(stream: tokio::net::TcpStream, counts: &RefCell<Counts>) -> std::io::Result<bool> {
    let (mut rd, mut wr) = stream.into_split();
    let mut lines = Lines::default();
    let mut chunk = [0u8; 1024];
    let mut ready = Vec::new();
    loop {
        let n = within(rd.read(&mut chunk)).await?;
        if n == 0 {
            ready.extend(lines.finish());
        } else {
            lines.push(&chunk[..n], &mut ready);
        }
        for line in ready.drain(..) {
            let (text, quit) = answer(line, counts);
            within(wr.write_all(text.as_bytes())).await?;
            if quit {
                return Ok(true);
            }
        }
        if n == 0 {
            return Ok(false);
        }
    }
}

/// What the control port's sessions share: how many are open, and a `quit` seen.
#[derive(Default)]
struct Sessions {
    open: std::cell::Cell<usize>,
    quit: tokio::sync::Notify,
}

/// Serves the control port, up to [`MAX_SESSIONS`] connections at once (a task of the reactor
/// each), until a `quit`. Nothing a peer does ends it: a failed connection ends alone, and an
/// accept that fails for want of descriptors or memory waits a second before the next (the
/// connection stays queued, and tokio would retry it at once).
async fn control(tcp: tokio::net::TcpListener, counts: Rc<RefCell<Counts>>) {
    let sessions = Rc::new(Sessions::default());
    loop {
        let accepted = tokio::select! {
            a = tcp.accept() => a,
            () = sessions.quit.notified() => return,
        };
        let (mut stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if classify(&e) == AcceptError::ThatOne => continue,
            Err(e) => {
                eprintln!("tokio_control: the control port: accept: {e}; again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if sessions.open.get() >= MAX_SESSIONS {
            // Told why, within a second; never waited on.
            let busy = format!("error: busy ({MAX_SESSIONS} control connections open); try again later\n");
            let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(busy.as_bytes())).await;
            continue;
        }
        sessions.open.set(sessions.open.get() + 1);
        let (held, counts) = (sessions.clone(), counts.clone());
        let task = io::spawn(async move {
            let sessions = held;
            let ended = tokio::time::timeout(CONTROL_SESSION, session(stream, &counts)).await;
            let ended =
                ended.unwrap_or_else(|_| Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "open for 600 s")));
            sessions.open.set(sessions.open.get() - 1);
            match ended {
                Ok(true) => {
                    println!("tokio_control: quit from {peer}");
                    sessions.quit.notify_one();
                }
                Ok(false) => {}
                Err(e) => eprintln!("tokio_control: control connection from {peer}: {e}; it is closed"),
            }
        });
        if let Err(e) = task {
            // Not served: not counted either (its stream went with the future).
            sessions.open.set(sessions.open.get() - 1);
            eprintln!("tokio_control: cannot serve a control connection: {}", common::report(&e));
        }
    }
}

fn main() {
    common::observe::init_logging("tokio_control");
    let args = Args::parse(std::env::args().skip(1), &[], USAGE);
    args.finish(&["bind", "control"]);
    let bind = args.addr("bind");
    let control_addr: SocketAddr = args.addr("control");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .unwrap_or_else(|e| common::die("tokio_control", &format!("tokio runtime: {e}")));
    let mut reactor =
        Reactor::new().unwrap_or_else(|e| common::die("tokio_control", &format!("reactor: {}", common::report(&e))));
    let counts = Rc::new(RefCell::new(Counts::default()));
    let program = {
        let counts = counts.clone();
        async move {
            let listener = Listener::bind(bind)?;
            let tcp = tokio::net::TcpListener::bind(control_addr)
                .await
                .map_err(|source| Error::Os { call: "bind (the control port)", source })?;
            println!("tokio_control: RDMA echo on {bind}, control on {control_addr} (pid {})", std::process::id());
            // The RDMA accept loop is a reactor task; the control port a tokio future; both
            // in this one task's select.
            tokio::select! {
                r = serve_rdma(listener, counts.clone()) => r,
                () = control(tcp, counts) => Ok(()),
            }
        }
    };
    let outcome = rt.block_on(async {
        match io::tokio::drive(&mut reactor, program) {
            Ok(driven) => driven.await,
            Err(e) => Err(e),
        }
    });
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) | Err(e) => common::die("tokio_control", &common::report(&e)),
    }
    let c = counts.borrow();
    println!("tokio_control: {} connections served, {} messages echoed; exiting", c.served, c.echoed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(reads: &[&[u8]]) -> Vec<Line> {
        let mut lines = Lines::default();
        let mut out = Vec::new();
        for r in reads {
            lines.push(r, &mut out);
            assert!(lines.buf.len() <= MAX_LINE, "held {} bytes", lines.buf.len());
        }
        out.extend(lines.finish());
        out
    }

    fn text(s: &str) -> Line {
        Line::Text(s.to_string())
    }

    #[test]
    fn lines_are_cut_across_reads_with_either_end() {
        assert_eq!(cut(&[b"sta", b"ts\r\nqu", b"it\n"]), vec![text("stats"), text("quit")]);
        assert_eq!(cut(&[b"stats\n\nstats"]), vec![text("stats"), text(""), text("stats")]);
        assert_eq!(cut(&[b""]), vec![]);
    }

    #[test]
    fn a_bad_line_is_one_bad_line_and_the_next_is_read() {
        assert_eq!(cut(&[b"st\xffats\nstats\n"]), vec![Line::NotUtf8, text("stats")]);
        // Too long: told once, as soon as it is, never held, and the next line is whole.
        let long = vec![b'x'; 3 * MAX_LINE];
        assert_eq!(cut(&[&long, &long, b"xx\nquit\n"]), vec![Line::TooLong, text("quit")]);
        assert_eq!(cut(&[&long[..MAX_LINE], b"\n"]), vec![text(&"x".repeat(MAX_LINE))]);
        assert_eq!(cut(&[&long[..MAX_LINE + 1]]), vec![Line::TooLong]);
    }

    #[test]
    fn bad_lines_are_answered_with_an_error_and_only_quit_quits() {
        let counts = RefCell::new(Counts::default());
        for line in [Line::NotUtf8, Line::TooLong, text("stat"), text("\u{0}quit")] {
            let (answer, quit) = answer(line, &counts);
            assert!(answer.starts_with("error: ") && answer.ends_with('\n') && !quit, "{answer}");
        }
        assert_eq!(answer(text("  quit "), &counts), ("bye\n".to_string(), true));
        assert_eq!(answer(text(""), &counts), (String::new(), false));
    }
}
