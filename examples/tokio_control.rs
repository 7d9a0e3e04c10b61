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

mod common;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;

use common::Args;
use rdma_reactor::io::{self, Connection, Listener};
use rdma_reactor::{Error, Reactor};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const USAGE: &str = "\
usage: tokio_control --bind ADDR:PORT --control ADDR:PORT

An RDMA echo server and a TCP control port in one tokio program.
  --bind ADDR:PORT     RDMA address to serve echo clients on
  --control ADDR:PORT  TCP address of the control port: `stats` or `quit`, one per line";

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

/// Serves the control port until a `quit`.
async fn control(tcp: tokio::net::TcpListener, counts: Rc<RefCell<Counts>>) -> std::io::Result<()> {
    loop {
        let (stream, peer) = tcp.accept().await?;
        let (rd, mut wr) = stream.into_split();
        let mut lines = BufReader::new(rd).lines();
        while let Some(line) = lines.next_line().await? {
            match line.trim() {
                "stats" => {
                    let st = io::stats().map_err(std::io::Error::other)?;
                    let text = {
                        let c = counts.borrow();
                        format!(
                            "served {} live {} echoed {}; reactor: connections {}, completions {}, wakeups {}, \
                             registered {} B\n",
                            c.served, c.live, c.echoed, st.connections, st.completions, st.wakeups, st.registered_bytes
                        )
                    };
                    wr.write_all(text.as_bytes()).await?;
                }
                "quit" => {
                    wr.write_all(b"bye\n").await?;
                    println!("tokio_control: quit from {peer}");
                    return Ok(());
                }
                other => wr.write_all(format!("unknown command {other:?}: stats or quit\n").as_bytes()).await?,
            }
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
                r = control(tcp, counts) => r.map_err(|source| Error::Os { call: "the control port", source }),
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
