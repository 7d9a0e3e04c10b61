//! `--threads N` for the servers: N reactors, one per thread, the first listening and
//! spreading its connect requests over all of them (`Reactor::listen_spread`), the others
//! serving what it hands them (`Reactor::accept_handoffs`). Counts kept across reactors for
//! `--exit-after` and the per-reactor lines printed at exit.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use rdma_reactor::{Balance, Config, Ctx, ListenerHandler, Reactor, Remote};

use super::observe::Metrics;

/// What one reactor served.
#[derive(Default)]
struct Served {
    connections: AtomicU64,
    messages: AtomicU64,
    bytes: AtomicU64,
    failed: AtomicU64,
}

/// The reactors of one server and their counts. Touched only when a connection closes.
pub struct Group {
    exit_after: u64,
    closed: AtomicU64,
    served: Vec<Served>,
    remotes: OnceLock<Vec<Remote>>,
    /// `--metrics`: where reactor 0 serves `GET /metrics` (reactor i on the port + i), and how.
    metrics: Option<Metrics>,
}

impl Group {
    /// A group of `threads` reactors that stops once `exit_after` connections closed (0:
    /// never), each serving its metrics when `metrics` is given.
    pub fn new(threads: usize, exit_after: u64, metrics: Option<Metrics>) -> Arc<Group> {
        Arc::new(Group {
            exit_after,
            closed: AtomicU64::new(0),
            served: (0..threads).map(|_| Served::default()).collect(),
            remotes: OnceLock::new(),
            metrics,
        })
    }

    /// A connection of reactor `reactor` closed after `messages` of `bytes` in all (`failed`:
    /// not cleanly).
    /// Returns the number closed across the group if that was the last one `--exit-after`
    /// waits for; then every reactor has been asked to stop.
    pub fn closed(&self, ctx: &mut Ctx<'_>, reactor: usize, messages: u64, bytes: u64, failed: bool) -> Option<u64> {
        let s = &self.served[reactor];
        s.connections.fetch_add(1, Ordering::Relaxed);
        s.messages.fetch_add(messages, Ordering::Relaxed);
        s.bytes.fetch_add(bytes, Ordering::Relaxed);
        s.failed.fetch_add(u64::from(failed), Ordering::Relaxed);
        let n = self.closed.fetch_add(1, Ordering::AcqRel) + 1;
        if self.exit_after == 0 || n != self.exit_after {
            return None;
        }
        ctx.stop();
        for r in self.remotes.get().into_iter().flatten() {
            let _ = r.stop();
        }
        Some(n)
    }

    /// Messages served across the group.
    pub fn messages(&self) -> u64 {
        self.served.iter().map(|s| s.messages.load(Ordering::Relaxed)).sum()
    }

    /// Bytes served across the group.
    pub fn bytes(&self) -> u64 {
        self.served.iter().map(|s| s.bytes.load(Ordering::Relaxed)).sum()
    }

    /// Connections that closed in failure across the group.
    pub fn failed(&self) -> u64 {
        self.served.iter().map(|s| s.failed.load(Ordering::Relaxed)).sum()
    }

    /// One line per reactor: what it served.
    pub fn print(&self, program: &str) {
        for (i, s) in self.served.iter().enumerate() {
            println!(
                "{program} server: reactor {i}: {} connections, {} messages, {} bytes",
                s.connections.load(Ordering::Relaxed),
                s.messages.load(Ordering::Relaxed),
                s.bytes.load(Ordering::Relaxed)
            );
        }
    }
}

/// Parses `--balance` (round-robin, the default, or fewest).
pub fn balance(v: &str) -> Option<Balance> {
    match v {
        "round-robin" | "rr" => Some(Balance::RoundRobin),
        "fewest" => Some(Balance::Fewest),
        _ => None,
    }
}

/// Runs the group's reactors until they stop: reactor 0 on this thread listens on `bind`
/// (spreading over all when there are several), reactors 1.. on threads of their own take its
/// hand-offs. `make(i)` builds reactor `i`'s listener handler, on its thread. Prints the
/// per-reactor lines at the end. `note` ends the `listening` line.
pub fn serve<H, F>(
    program: &'static str,
    group: &Arc<Group>,
    bind: SocketAddr,
    cfg: Config,
    balance: Balance,
    note: &str,
    make: F,
) where
    H: ListenerHandler + 'static,
    F: Fn(usize) -> H + Send + Sync + 'static,
{
    let threads = group.served.len();
    let metrics = group.metrics;
    let make = Arc::new(make);
    let (tx, rx) = mpsc::channel();
    let workers: Vec<_> = (1..threads)
        .map(|i| {
            let (tx, make, cfg) = (tx.clone(), make.clone(), cfg.clone());
            std::thread::Builder::new()
                .name(format!("{program}-reactor-{i}"))
                .spawn(move || {
                    let mut reactor = Reactor::with_config(cfg)
                        .unwrap_or_else(|e| super::die(program, &format!("cannot start: {}", super::report(&e))));
                    reactor.accept_handoffs(make(i)).unwrap_or_else(|e| {
                        super::die(program, &format!("cannot take hand-offs: {}", super::report(&e)))
                    });
                    if let Some(m) = metrics {
                        serve_metrics(program, &mut reactor, m, i);
                    }
                    tx.send((i, reactor.remote())).expect("the main thread waits");
                    if let Err(e) = reactor.run() {
                        super::die(program, &format!("reactor {i} failed: {}", super::report(&e)));
                    }
                })
                .expect("spawn a reactor thread")
        })
        .collect();
    drop(tx);
    let mut reactor = Reactor::with_config(cfg)
        .unwrap_or_else(|e| super::die(program, &format!("cannot start: {}", super::report(&e))));
    let mut remotes = vec![reactor.remote()];
    let mut others: Vec<(usize, Remote)> = rx.iter().take(threads - 1).collect();
    others.sort_by_key(|(i, _)| *i);
    remotes.extend(others.into_iter().map(|(_, r)| r));
    group.remotes.set(remotes.clone()).unwrap_or_else(|_| unreachable!("set once"));
    let listening = if threads > 1 {
        reactor.listen_spread(bind, make(0), remotes, balance)
    } else {
        reactor.listen(bind, make(0))
    };
    listening.unwrap_or_else(|e| super::die(program, &format!("cannot listen on {bind}: {}", super::report(&e))));
    if let Some(m) = metrics {
        serve_metrics(program, &mut reactor, m, 0);
    }
    println!("{program} server: listening on {bind} (pid {}, {threads} reactor threads){note}", std::process::id());
    if let Err(e) = reactor.run() {
        super::die(program, &format!("reactor failed: {}", super::report(&e)));
    }
    for w in workers {
        w.join().unwrap_or_else(|_| super::die(program, "a reactor thread panicked"));
    }
    drop(reactor);
    group.print(program);
}

/// Reactor `index`'s metrics endpoint: `GET /metrics` on `m`'s address, port + `index`.
fn serve_metrics(program: &str, reactor: &mut Reactor, m: Metrics, index: usize) {
    let addr = SocketAddr::new(m.addr.ip(), m.addr.port().wrapping_add(index as u16));
    match super::observe::serve_metrics(&mut reactor.ctx(), m, index) {
        Ok(addr) => println!(
            "{program} server: reactor {index} serves GET /metrics on {addr} ({}; at most {} HTTP connections)",
            if m.conns { "totals and every connection's series, with peer addresses" } else { "totals" },
            m.max_conns
        ),
        Err(e) => super::die(program, &format!("cannot serve metrics on {addr}: {e}")),
    }
}
