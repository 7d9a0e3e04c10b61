//! Hidden and unstable, behind the `bench-internals` feature: the reactor's pure per-operation
//! bookkeeping, for the host benchmark `benches/dispatch.rs`. Not part of the API.

use crate::proto::flow::negotiate;
use crate::proto::token::{ConnKey, GenSlab, Key, OpKey, Token};
use crate::proto::wire::ConnectInfo;
use crate::reactor::bench::{CqRoom, Lanes, Plan, RecvQueue, SendQueue};
use crate::sys::cq::WorkCompletion;
pub use crate::sys::pool::index::{IndexBuf, IndexPool};

/// One connection's queues and CQ room, with the reused lists the reactor keeps beside them
/// (`Scratch`): what [`Dispatch`] and [`SlabPath`] both drive.
#[derive(Debug)]
struct Queues {
    sq: SendQueue,
    rq: RecvQueue,
    room: CqRoom,
    plan: Plan,
    keys: Vec<OpKey>,
    done: Vec<OpKey>,
}

impl Queues {
    /// Receive-credit flow control on, both depths `depth`.
    fn new(depth: u32) -> Queues {
        let mut sq = SendQueue::new(16);
        sq.set_capacity(depth);
        let peer = ConnectInfo { flow_control: true, recv_depth: depth as u16, ..ConnectInfo::default() };
        sq.set_flow(negotiate(true, depth, Some(&peer)));
        let mut rq = RecvQueue::default();
        rq.set_capacity(depth);
        let mut room = CqRoom::new(4 * depth, depth);
        room.admit(depth);
        Queues { sq, rq, room, plan: Plan::default(), keys: Vec::new(), done: Vec::new() }
    }
}

/// One connection's queues, its CQ room and an operation table, driven without a device.
#[derive(Debug)]
pub struct Dispatch {
    ops: GenSlab<OpKey, u64>,
    q: Queues,
}

impl Dispatch {
    /// A connection with receive-credit flow control on, both depths `depth`.
    pub fn new(depth: u32) -> Dispatch {
        Dispatch { ops: GenSlab::new(), q: Queues::new(depth) }
    }

    /// The bookkeeping of one ping-pong on one side: a receive is submitted and posted, its
    /// completion found by `wr_id`, accounted and removed; a send likewise, with its credit, CQ
    /// room and signaling. Returns a value that depends on all of it.
    pub fn round(&mut self, user_data: u64) -> u64 {
        let r = self.ops.insert(user_data);
        self.q.rq.push(r);
        self.q.keys.clear();
        self.q.rq.plan(&mut self.q.keys);
        self.q.rq.posted(&self.q.keys, self.q.keys.len());
        let found = self.find(r.token().as_u64());
        let recv_ok = self.q.rq.complete(found);
        let mut sum = self.ops.remove(found).unwrap_or(0);
        if let Some(flow) = self.q.sq.flow_mut() {
            flow.on_repost(false);
            flow.on_receive(crate::proto::flow::Imm::data(1));
        }
        let s = self.ops.insert(user_data ^ 1);
        self.q.sq.push(s, true, 64);
        let ops = &mut self.ops;
        self.q.sq.plan_into(&mut self.q.room, || ops.insert(0), &mut self.q.plan);
        self.q.sq.posted(&self.q.plan, self.q.plan.wrs.len(), &mut self.q.room).for_each(drop);
        for w in self.q.plan.wrs.iter().filter(|w| w.signaled) {
            let found = self.find(w.op.token().as_u64());
            self.q.done.clear();
            self.q.sq.complete(found, &mut self.q.room, &mut self.q.done);
            for done in &self.q.done {
                sum = sum.wrapping_add(self.ops.remove(*done).unwrap_or(0));
            }
        }
        sum.wrapping_add(u64::from(recv_ok))
    }

    fn find(&self, wr_id: u64) -> OpKey {
        Token::from_u64(wr_id).and_then(|t| self.ops.key_of(t)).expect("a live operation")
    }
}

/// Today's per-message path without the device (issue 33's `Path`, kept to compare with the
/// ring design's [`Path`]): the echo server's side of a round
/// trip from the receive's work completion to the next receive's and the reply's work
/// requests built into their chains, and the reply's own completion. It calls the reactor's
/// own pieces on the same types (the token and operation table, `RecvQueue::complete`,
/// `SendQueue::complete`, `Flow::on_receive`, `OpEntry::into_completion`, `OpEntry::new`,
/// the queues' plans with credits, CQ room and signaling, `post::send_wr`,
/// `sys::qp::Chains`), in the reactor's order, joined by glue of its own. Left out, so not
/// measured here: the FFI (`ibv_poll_cq` and its conversion of `ibv_wc`, `ibv_post_*`); the
/// connection and CQ tables' look-ups; `Core::submit`'s checks (state and placement, the
/// pool's ownership, the size limits, the send backlog); `finish_op`'s overdraw, release,
/// credit-only and farewell branches and the connection's meters; the handler's `Conn` and
/// what runs after it (`after_completion`, the drained check); `flush_conn`'s state checks
/// and credit watch. The reactor flushes once a tick, after all the tick's completions; here
/// a flush follows each completion that submitted something (one completion a tick, as in a
/// ping-pong). The handler is a plain closure; the memory is caller memory
/// ([`crate::RawBuf`]) that nothing reads: no device is told of it.
pub struct SlabPath {
    conn: crate::proto::token::ConnKey,
    ops: GenSlab<OpKey, crate::reactor::bench::OpEntry>,
    q: Queues,
    signaled: Vec<OpKey>,
    send_wrs: Vec<crate::sys::qp::SendWr>,
    recv_wrs: Vec<crate::sys::qp::RecvWr>,
    chains: crate::sys::qp::Chains,
    /// The receive posted now, whose completion the next message is.
    posted: Option<OpKey>,
    /// Something was submitted since the last flush.
    dirty: bool,
    /// Stands in for the registered memory the operations name (never touched).
    memory: Box<[u8; 64]>,
}

impl std::fmt::Debug for SlabPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlabPath").field("ops", &self.ops.len()).finish()
    }
}

impl SlabPath {
    /// A connection with receive-credit flow control on, both depths `depth`, one receive
    /// posted.
    pub fn new(depth: u32) -> SlabPath {
        let mut conns: GenSlab<crate::proto::token::ConnKey, ()> = GenSlab::new();
        let mut p = SlabPath {
            conn: conns.insert(()),
            ops: GenSlab::new(),
            q: Queues::new(depth),
            signaled: Vec::new(),
            send_wrs: Vec::new(),
            recv_wrs: Vec::new(),
            chains: crate::sys::qp::Chains::default(),
            posted: None,
            dirty: false,
            memory: Box::new([0; 64]),
        };
        let raw = p.raw();
        p.submit(crate::Op::raw_recv(raw));
        p.flush();
        p
    }

    fn raw(&self) -> crate::RawBuf {
        crate::RawBuf { addr: self.memory.as_ptr() as u64, len: 64, lkey: 1 }
    }

    /// One message: its receive completes with 64 bytes and a credit, the handler sees it
    /// and submits what `handler` returns (a reply and a receive, for an echo), the
    /// submissions are planned and built into work requests, and the reply's completion is
    /// delivered to the handler too. Returns a value that depends on all of it.
    pub fn message(
        &mut self,
        handler: &mut dyn FnMut(crate::Completion, crate::RawBuf) -> [Option<crate::Op>; 2],
    ) -> u64 {
        use crate::proto::flow::Imm;
        use crate::sys::cq::WorkCompletion;
        let Some(posted) = self.posted.take() else { return 0 };
        let wc = WorkCompletion {
            wr_id: posted.token().as_u64(),
            status: crate::WcStatus::Success,
            byte_len: 64,
            imm: Some(Imm::data(1).encode()),
            remote_write: false,
            qp_num: 1,
        };
        let mut sum = self.complete(wc, handler);
        // The signaled sends the flush built (as the device would complete them), listed
        // first: completing one plans again.
        let mut signaled = std::mem::take(&mut self.signaled);
        signaled.clear();
        signaled.extend(self.q.plan.wrs.iter().filter(|w| w.signaled).map(|w| w.op));
        for op in &signaled {
            let wc = WorkCompletion { wr_id: op.token().as_u64(), byte_len: 0, imm: None, ..wc };
            sum = sum.wrapping_add(self.complete(wc, handler));
        }
        self.signaled = signaled;
        sum
    }

    /// `Core::complete` and `finish_op` for one work completion (the parts [`SlabPath`] names),
    /// then the flush of what the handler submitted.
    fn complete(
        &mut self,
        wc: crate::sys::cq::WorkCompletion,
        handler: &mut dyn FnMut(crate::Completion, crate::RawBuf) -> [Option<crate::Op>; 2],
    ) -> u64 {
        use crate::proto::flow::Imm;
        let Some(ot) = Token::from_u64(wc.wr_id).and_then(OpKey::of) else { return 0 };
        let Some(opcode) = self.ops.get(ot).map(|e| e.opcode) else { return 0 };
        self.q.done.clear();
        if opcode.on_send_queue() {
            self.q.sq.complete(ot, &mut self.q.room, &mut self.q.done);
        } else if self.q.rq.complete(ot) {
            self.q.done.push(ot);
        }
        let mut sum = 0u64;
        for i in 0..self.q.done.len() {
            let Some(op) = self.ops.remove(self.q.done[i]) else { continue };
            if op.control {
                continue;
            }
            if op.opcode == crate::OpCode::Recv {
                if let Some(flow) = self.q.sq.flow_mut() {
                    flow.on_receive(wc.imm.map_or(Imm::data(0), Imm::decode));
                }
            }
            let result = if op.opcode == crate::OpCode::Recv { Ok(wc.byte_len) } else { Ok(op.sge().1) };
            let completion = op.into_completion(result, wc.remote_write);
            sum = sum.wrapping_add(completion.user_data);
            let raw = self.raw();
            for op in handler(completion, raw).into_iter().flatten() {
                self.submit(op);
            }
        }
        // As the reactor flushes only a connection something was submitted on (its dirty
        // list).
        if std::mem::take(&mut self.dirty) {
            self.flush();
        }
        sum
    }

    /// `Core::submit`'s bookkeeping: the entry built into the table, queued.
    fn submit(&mut self, op: crate::Op) {
        let (opcode, pool_len) = crate::reactor::bench::queue_shape(&op);
        self.dirty = true;
        let key = self.ops.insert(crate::reactor::bench::OpEntry::new(self.conn, op, 0, None));
        if opcode == crate::OpCode::Recv {
            self.q.rq.push(key);
        } else {
            self.q.sq.push(key, opcode.consumes_peer_receive(), u32::try_from(pool_len).unwrap_or(u32::MAX));
        }
    }

    /// `Core::flush_conn`: receives planned, built and chained, then sends likewise.
    fn flush(&mut self) {
        self.q.keys.clear();
        self.q.rq.plan(&mut self.q.keys);
        if !self.q.keys.is_empty() {
            self.recv_wrs.clear();
            let ops = &self.ops;
            self.recv_wrs
                .extend(self.q.keys.iter().filter_map(|k| Some(crate::reactor::bench::recv_wr(*k, ops.get(*k)?))));
            std::hint::black_box(self.chains.recv_chain(&self.recv_wrs));
            self.q.rq.posted(&self.q.keys, self.q.keys.len());
            for k in &self.q.keys {
                if let Some(op) = self.ops.get_mut(*k) {
                    op.posted = true;
                }
                if let Some(flow) = self.q.sq.flow_mut() {
                    flow.on_repost(false);
                }
            }
            self.posted = self.q.keys.last().copied();
        }
        let (ops, conn) = (&mut self.ops, self.conn);
        self.q.sq.plan_into(
            &mut self.q.room,
            || ops.insert(crate::reactor::bench::OpEntry::control(conn)),
            &mut self.q.plan,
        );
        if !self.q.plan.wrs.is_empty() {
            self.send_wrs.clear();
            // Marked posted as each request is built, as `Posting::post_sends` does.
            let ops = &mut self.ops;
            self.send_wrs.extend(self.q.plan.wrs.iter().filter_map(|w| {
                let op = ops.get_mut(w.op)?;
                op.posted = true;
                Some(crate::reactor::bench::send_wr(op, w, 64))
            }));
            std::hint::black_box(self.chains.send_chain(&self.send_wrs));
            self.q.sq.posted(&self.q.plan, self.q.plan.wrs.len(), &mut self.q.room).for_each(drop);
        }
    }
}

/// The per-message path of the ring design (issue 47), without the device: the echo server's
/// side of a round trip on the structures the reactor adopts in phase 2, each rule of the
/// reactor's kept.
///
/// One message is what the reactor does for it, in its order:
///
/// 1. **The receive's completion** (`Core::complete` on the rings, `Path::complete`): inside
///    one `catch_unwind`, the `wr_id` decoded (`proto::token::WrId`), the connection found by
///    its slab index and its queue-pair epoch checked (one look-up a completion), the position
///    checked against the receive ring's posted window; the credit taken (`Flow::on_receive`,
///    the overdraw check); what the completion leaves to post (`after_completion`, reduced to
///    what a receive changes: `RecvOutcome::Deliver`'s `wake`) listed.
/// 2. **The handler**, guarded by that `catch_unwind`: found by the connection's slab index
///    beside the table ([`Path`]'s `handlers`), called with a [`Conn`] (the core, the
///    connection's key and owner id) and the [`Completion`] by value, built in the call's
///    argument straight from the slot (`Lanes::take_recv`: the pool buffer's marks updated for
///    the bytes received). The echo handler submits the reply (the received buffer) and a new
///    receive (a buffer from the pool, allocated for the `Conn`'s owner).
/// 3. **Each submission** (`Core::submit` on the gate): the connection looked up; the
///    connection's `Gate` (`reactor::data::gate`: state, the size limit, the backlog);
///    the buffer's pool and its owner marks (`set_owner`, and `show` for a send,
///    `lend_to_device` for a receive, with the request's scatter entry from the same look);
///    the slot made in place at the ring's tail; the connection listed to post.
/// 4. **The flush** (`Core::flush_conn`): the connection looked up; the receives, then the
///    sends, planned with credits (`proto/flow.rs`), CQ room and signaling, and written in
///    place into the connection's pre-linked work requests; each run cut into a chain as for
///    `ibv_post_*`; the credit watch.
/// 5. **The reply's completion**: decoded and checked as the receive's, in its own
///    `catch_unwind`; the signaled request retires the positions before it, each operation
///    found (`Lanes::next_sent`), its CQ entry given back and taken apart into its handler's
///    argument (`SentOp::take`); `wants_post` asked at the last; the handler drops the
///    completion: the buffer goes back to the pool.
///
/// Left out, as [`SlabPath`] leaves it out: the FFI (`ibv_poll_cq` and its conversion,
/// `ibv_post_*`: the chain's head is handed to `black_box` instead), the CQ's look-up and the
/// tick around it, the connection's meters and `Stats`, the reactor's other completion kinds
/// (the shared receive queue's tokens) and what a refused message or a failed status leads to
/// (closing the connection). The pool is the index-based one (`sys/pool/index.rs`) with its
/// memory not registered (no device: its local keys are 0). One completion a tick, as in a
/// ping-pong: a flush follows each completion that listed something. The device is a stand-in
/// (two small fifos of `wr_id`s: the receives posted, the signaled sends posted), counted with
/// the path.
pub struct Path {
    core: PathCore,
    /// The connections' handlers, by slab index: beside the connection table, not in its
    /// entries, so a handler is called where it is, with the core borrowed apart from it
    /// (nothing to take out of an entry before the call and put back after it, in a look-up of
    /// its own). A `Conn` reaches the core, never the handlers: no handler runs inside
    /// another's call.
    handlers: Vec<Option<Box<dyn Handler>>>,
    /// The connection.
    key: ConnKey,
    /// Stands in for the registered memory raw operations name (never touched).
    memory: Box<[u8; 64]>,
}

impl std::fmt::Debug for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Path").field("in_use", &self.core.pool.in_use()).finish()
    }
}

/// A handler of [`Path`]'s connection: the reactor's `ConnectionHandler::on_completion`, on
/// the ring design's types.
pub trait Handler {
    /// One completion of the connection, with the connection's commands.
    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion);
}

/// A completion as the handler gets it: the public `Completion`'s fields, with the
/// index-based buffer (what the public type holds once the reactor adopts it), built once from
/// the ring's slot.
pub type Completion = crate::reactor::bench::Done<IndexBuf>;

/// An operation of [`Path`]'s handler: a send or a receive of a pool buffer.
#[derive(Debug)]
pub struct Op {
    body: Body,
    user_data: u64,
}

#[derive(Debug)]
enum Body {
    Send(IndexBuf),
    Recv(IndexBuf),
    /// Caller memory, as [`SlabPath`]'s handler uses (no pool, no owner marks, no size or
    /// backlog check: `Conn::submit_raw`'s contract).
    RawSend(crate::RawBuf),
    RawRecv(crate::RawBuf),
}

impl Op {
    /// Sends the buffer's `len()` bytes.
    pub fn send(buf: IndexBuf) -> Op {
        Op { body: Body::Send(buf), user_data: 0 }
    }

    /// Receives one message into the buffer.
    pub fn recv(buf: IndexBuf) -> Op {
        Op { body: Body::Recv(buf), user_data: 0 }
    }

    /// Sends caller memory (never read here: no device).
    pub fn raw_send(raw: crate::RawBuf) -> Op {
        Op { body: Body::RawSend(raw), user_data: 0 }
    }

    /// Receives into caller memory (never written here: no device).
    pub fn raw_recv(raw: crate::RawBuf) -> Op {
        Op { body: Body::RawRecv(raw), user_data: 0 }
    }

    /// Sets the user_data the completion carries.
    pub fn user_data(mut self, user_data: u64) -> Op {
        self.user_data = user_data;
        self
    }
}

/// A submission [`Conn::submit`] refused, with the operation given back.
#[derive(Debug)]
pub struct Refused(pub Op);

/// The commands of [`Path`]'s connection inside a handler: the reactor's `Conn`, two words.
pub struct Conn<'a> {
    core: &'a mut PathCore,
    key: ConnKey,
    /// The connection's owner id, read in the look-up that found its completion (its buffers
    /// are allocated for it without another).
    owner: u64,
}

impl std::fmt::Debug for Conn<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("key", &self.key).finish()
    }
}

impl Conn<'_> {
    /// Submits an operation (`Core::submit` on the gate and the rings).
    #[inline]
    pub fn submit(&mut self, op: Op) -> Result<(), Refused> {
        self.core.submit(self.key, op)
    }

    /// A buffer of `len` bytes from the connection's pool, for this connection.
    #[inline]
    pub fn alloc(&mut self, len: usize) -> crate::Result<IndexBuf> {
        self.core.pool.alloc(len, self.owner)
    }
}

/// One connection's entry: what `ConnEntry` holds of the data path in the ring design.
struct PathConn {
    lanes: Lanes<IndexBuf>,
    gate: crate::reactor::bench::Gate,
    /// Its owner id (`sys::pool::next_owner`).
    owner: u64,
    /// Its queue pair's epoch, in every `wr_id` of its rings.
    epoch: u16,
    /// Listed to post at the end of the tick.
    dirty: bool,
    /// Its next send waits for credits (the credit watch's state).
    credit_waiting: bool,
}

/// The stand-in device of [`Path`]: the `wr_id`s of the receives posted, in order (it completes
/// the oldest when a message arrives), and of the signaled sends posted (it reports each, in
/// order).
#[derive(Default)]
struct Device {
    recvs: Fifo,
    signaled: Fifo,
}

/// A first-in first-out queue of a few `wr_id`s (a ping-pong keeps one or two): the stand-in
/// device's, cheaper than a `VecDeque` so it adds little to what the path counts.
struct Fifo {
    ids: [u64; Fifo::LEN],
    head: u32,
    tail: u32,
}

impl Default for Fifo {
    fn default() -> Fifo {
        Fifo { ids: [0; Fifo::LEN], head: 0, tail: 0 }
    }
}

impl Fifo {
    const LEN: usize = 64;

    /// Queues `id` (more than [`Fifo::LEN`] waiting would be a bug of the benchmark, caught by
    /// debug builds: the oldest would be overwritten).
    #[inline(always)]
    fn push(&mut self, id: u64) {
        debug_assert!((self.tail.wrapping_sub(self.head) as usize) < Fifo::LEN, "the stand-in device holds 64 ids");
        self.ids[self.tail as usize % Fifo::LEN] = id;
        self.tail = self.tail.wrapping_add(1);
    }

    /// The oldest id queued.
    #[inline(always)]
    fn pop(&mut self) -> Option<u64> {
        if self.head == self.tail {
            return None;
        }
        let id = self.ids[self.head as usize % Fifo::LEN];
        self.head = self.head.wrapping_add(1);
        Some(id)
    }
}

/// The reactor's side: the connection table, the pool, the CQ's room, the tick's lists.
struct PathCore {
    conns: GenSlab<ConnKey, PathConn>,
    pool: IndexPool,
    room: CqRoom,
    dirty: Vec<ConnKey>,
    /// The stand-in device: what it will report.
    device: Device,
    completions: u64,
    stale: u64,
    delivered: u64,
    panic: Option<Box<dyn std::any::Any + Send>>,
}

impl Path {
    /// A connection with receive-credit flow control on, both depths `depth`, its handler
    /// `handler`, one receive of 64 bytes posted.
    pub fn new(depth: u32, handler: Box<dyn Handler>) -> Path {
        let cfg = crate::PoolConfig {
            chunk_sizes: vec![4096],
            cluster_bytes: 1 << 20,
            max_bytes: 1 << 30,
            ..crate::PoolConfig::default()
        };
        let pool = IndexPool::unregistered(&cfg, 0).expect("a host pool");
        let mut room = CqRoom::new(4 * depth, depth);
        room.admit(depth);
        let mut core = PathCore {
            conns: GenSlab::new(),
            pool,
            room,
            dirty: Vec::new(),
            device: Device::default(),
            completions: 0,
            stale: 0,
            delivered: 0,
            panic: None,
        };
        let epoch = 1;
        let key = core.conns.insert_with(|key| {
            let mut lanes = Lanes::new(key.token().index(), epoch, 16).expect("an index in range");
            lanes.set_capacity(depth, depth);
            let peer = ConnectInfo { flow_control: true, recv_depth: depth as u16, ..ConnectInfo::default() };
            lanes.set_flow(negotiate(true, depth, Some(&peer)));
            PathConn {
                lanes,
                gate: crate::reactor::bench::Gate::new(true, false, false, Some(4096), 4096, 1024, 192 << 20),
                owner: crate::sys::pool::next_owner(),
                epoch,
                dirty: false,
                credit_waiting: false,
            }
        });
        let index = key.token().index() as usize;
        let mut handlers: Vec<Option<Box<dyn Handler>>> = (0..=index).map(|_| None).collect();
        handlers[index] = Some(handler);
        let mut p = Path { core, handlers, key, memory: Box::new([0; 64]) };
        let buf = p.core.pool.alloc(64, p.core.conns.get(key).map_or(0, |c| c.owner)).expect("a buffer");
        p.core.submit(key, Op::recv(buf)).expect("the first receive");
        p.core.flush(key);
        p
    }

    /// As [`Path::new`], with a receive in caller memory posted too (for [`RawEcho`]: the same
    /// work per message as [`SlabPath`]'s handler, no pool). The pool receive `new` posted is
    /// the first message (answered from caller memory, its buffer dropped); from then on every
    /// receive is caller memory, two posted at a time.
    pub fn new_raw(depth: u32, handler: Box<dyn Handler>) -> Path {
        let mut p = Path::new(depth, handler);
        let raw = p.raw_memory();
        let key = p.key;
        p.core.submit(key, Op::raw_recv(raw)).expect("a raw receive");
        p.core.flush(key);
        p
    }

    /// Memory the raw operations name (never touched: no device).
    pub fn raw_memory(&self) -> crate::RawBuf {
        crate::RawBuf { addr: self.memory.as_ptr() as u64, len: 64, lkey: 1 }
    }

    /// One message: its receive completes with 64 bytes and a credit, the handler sees it and
    /// submits (an echo: the reply and a receive), the submissions are planned and written into
    /// work requests, and the reply's completion is delivered to the handler too. Returns the
    /// completions delivered so far.
    pub fn message(&mut self) -> u64 {
        use crate::proto::flow::Imm;
        // The device completes the oldest receive posted with the message.
        let Some(wr_id) = self.core.device.recvs.pop() else { return 0 };
        let wc = WorkCompletion {
            wr_id,
            status: crate::WcStatus::Success,
            byte_len: 64,
            imm: Some(Imm::data(1).encode()),
            remote_write: false,
            qp_num: 1,
        };
        self.complete(&wc);
        // The signaled sends the flush posted, as the device reports them (completing one may
        // post more: they are reported too).
        while let Some(id) = self.core.device.signaled.pop() {
            self.complete(&WorkCompletion { wr_id: id, byte_len: 0, imm: None, ..wc });
        }
        self.core.delivered
    }

    /// Completions reaped that named no outstanding operation (stale), of all reaped.
    pub fn stale(&self) -> (u64, u64) {
        (self.core.stale, self.core.completions)
    }

    /// Pool buffers out (the posted receive's, and whatever a handler keeps).
    pub fn buffers_in_use(&self) -> usize {
        self.core.pool.in_use()
    }

    /// Completes a work completion with this `wr_id` (a stale or hostile one, for tests).
    pub fn complete_raw(&mut self, wr_id: u64) {
        let wc = WorkCompletion {
            wr_id,
            status: crate::WcStatus::Success,
            byte_len: 64,
            imm: Some(crate::proto::flow::Imm::data(1).encode()),
            remote_write: false,
            qp_num: 1,
        };
        self.complete(&wc);
    }

    /// The `wr_id` of the oldest receive posted now.
    pub fn posted_recv(&self) -> Option<u64> {
        self.core.conns.get(self.key).and_then(|c| c.lanes.oldest_recv())
    }

    /// `Core::complete` on the rings: one work completion (a poll's batch of one, as in a
    /// ping-pong), then the flush of what it listed.
    ///
    /// **One guard a batch.** The whole completion, the handler calls included, runs inside one
    /// `catch_unwind` ([`Path::complete_from`]): every handler call is guarded, and the
    /// completion is built in the handler's argument, once, in the look-up that found it
    /// (nothing is carried into a guard of its own and out again). A handler's panic is kept
    /// for the end of the tick, the handler stays where it is, and the completion resumes
    /// after it ([`Resume`]): the operations a signaled send completion completes after the
    /// one whose handler panicked are still delivered, each to its handler. Everything a
    /// completion changes of the lanes is done before its handler is called, so resuming finds
    /// them as they were when it panicked.
    #[inline(never)]
    fn complete(&mut self, wc: &WorkCompletion) {
        let mut at = Resume::Start;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.complete_from(wc, &mut at)));
        if let Err(panic) = r {
            self.resume(wc, at, panic);
        }
        // The reactor flushes once a tick; here after each completion that listed something.
        while let Some(key) = self.core.dirty.pop() {
            self.core.flush(key);
        }
    }

    /// [`Path::complete`] after a handler's `panic`: the panic kept, the completion resumed
    /// from `at`, as often as handlers panic.
    #[cold]
    #[inline(never)]
    fn resume(&mut self, wc: &WorkCompletion, mut at: Resume, panic: Box<dyn std::any::Any + Send>) {
        self.core.panic.get_or_insert(panic);
        while !matches!(at, Resume::Done) {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.complete_from(wc, &mut at)));
            match r {
                Ok(()) => break,
                Err(panic) => {
                    self.core.panic.get_or_insert(panic);
                }
            }
        }
    }

    /// The work of [`Path::complete`] from where `at` says: the start, or the next operation
    /// a send completion completes after a handler's panic. `at` says what is left before each
    /// handler call. One look-up of the connection a completion (and one more after each
    /// handler that another operation of the same send completion follows).
    #[inline(always)]
    fn complete_from(&mut self, wc: &WorkCompletion, at: &mut Resume) {
        use crate::proto::token::{Dir, WrId};
        use crate::reactor::bench::RecvOutcome;
        let Path { core, handlers, .. } = self;
        let (sent, mut c) = match *at {
            Resume::Start => {
                *at = Resume::Done;
                core.completions += 1;
                // (The shared receive queue's `SrqRecv` tokens are told apart here:
                // `WrId::is_ring`.)
                let found = WrId::decode(wc.wr_id).and_then(|id| {
                    let (key, c) = core.conns.get_index_mut(id.index)?;
                    (c.epoch == id.epoch).then_some((id, key, c))
                });
                let Some((id, key, c)) = found else {
                    core.stale += 1;
                    return;
                };
                if id.dir == Dir::Recv {
                    match c.lanes.recv_completed(id.seq, wc, false) {
                        RecvOutcome::Deliver { delivery, wake } => {
                            // `after_completion`, as far as a receive completion changes it
                            // (`wake`); a handler changes it only by what it submits, which
                            // lists the connection itself.
                            if wake {
                                list_dirty(&mut c.dirty, key, &mut core.dirty);
                            }
                            let owner = c.owner;
                            // The handler (none: the completion is dropped, its memory back),
                            // called with the completion built in its argument.
                            match handlers.get_mut(id.index as usize).and_then(Option::as_mut) {
                                Some(h) => {
                                    core.delivered += 1;
                                    call(h.as_mut(), c.lanes.take_recv(delivery), core, key, owner);
                                }
                                None => drop(c.lanes.take_recv(delivery)),
                            }
                        }
                        RecvOutcome::Control { .. } => list_dirty(&mut c.dirty, key, &mut core.dirty),
                        // Refused messages close the connection in the reactor (not in this
                        // path).
                        RecvOutcome::BadFrame(_) | RecvOutcome::Overdrawn => {}
                        RecvOutcome::Stale => core.stale += 1,
                    }
                    return;
                }
                let Some(end) = c.lanes.send_completed(id.seq) else {
                    core.stale += 1;
                    return;
                };
                (Sent { index: id.index, epoch: id.epoch, key, owner: c.owner, end, status: wc.status }, c)
            }
            Resume::Sent(sent) => {
                *at = Resume::Done;
                match core.conns.get_index_mut(sent.index).filter(|(_, c)| c.epoch == sent.epoch) {
                    Some((_, c)) => (sent, c),
                    None => return,
                }
            }
            Resume::Done => return,
        };
        // Each operation a send completion completes, in order (the runtime's own skipped), to
        // the handler with its completion built in its argument; after a handler ran the
        // connection is looked up again (it may have closed, the table may have grown). `at`
        // says `Done` here; `Sent` while an operation after the one delivered waits.
        let mut resumable = false;
        loop {
            let Some(op) = c.lanes.next_sent(sent.end, &mut core.room, sent.status) else {
                // The last were the runtime's own (a credit-only message, a probe): nothing
                // asked `after_completion` yet. (Their meter is left out, as all meters.)
                if !c.dirty && c.lanes.wants_post() {
                    list_dirty(&mut c.dirty, sent.key, &mut core.dirty);
                }
                break;
            };
            let more = op.more();
            if !more && !c.dirty && op.wants_post() {
                // `after_completion`, asked once its last operation is found: what waited for
                // the send slots and CQ room a send completion gives back (it gives back no
                // receive slot).
                list_dirty(&mut c.dirty, sent.key, &mut core.dirty);
            }
            if more != resumable {
                *at = if more { Resume::Sent(sent) } else { Resume::Done };
                resumable = more;
            }
            match handlers.get_mut(sent.index as usize).and_then(Option::as_mut) {
                Some(h) => {
                    core.delivered += 1;
                    call(h.as_mut(), op.take(&mut core.room, sent.status), core, sent.key, sent.owner);
                }
                None => drop(op.take(&mut core.room, sent.status)),
            }
            if !more {
                break;
            }
            c = match core.conns.get_index_mut(sent.index).filter(|(_, c)| c.epoch == sent.epoch) {
                Some((_, c)) => c,
                None => break,
            };
        }
    }
}

/// Calls handler `h` with `done` and the commands of connection `key` (owner id `owner`); the
/// completion is an argument of its own here, so the caller passes the call that builds it.
#[inline(always)]
fn call(h: &mut dyn Handler, done: Completion, core: &mut PathCore, key: ConnKey, owner: u64) {
    h.on_completion(&mut Conn { core, key, owner }, done);
}

/// Where [`Path::complete`] resumes after a handler's panic.
#[derive(Clone, Copy)]
enum Resume {
    /// Nothing done yet.
    Start,
    /// A send completion's operations from the next before `end` on.
    Sent(Sent),
    /// Nothing left.
    Done,
}

/// A send completion being delivered: its connection (slab index, queue-pair epoch, key,
/// owner), the end of what it completes and its status.
#[derive(Clone, Copy)]
struct Sent {
    index: u32,
    epoch: u16,
    key: ConnKey,
    owner: u64,
    end: u32,
    status: crate::WcStatus,
}

impl PathCore {
    /// `Core::submit` on the gate and the rings.
    #[inline(always)]
    fn submit(&mut self, key: ConnKey, op: Op) -> Result<(), Refused> {
        use crate::reactor::bench::Slot;
        let Some(c) = self.conns.get_mut(key) else { return Err(Refused(op)) };
        let Op { body, user_data } = op;
        match body {
            Body::Send(buf) => {
                let len = buf.len();
                let (queued, bytes) = c.lanes.backlog();
                if c.gate.message(len).is_err()
                    || c.gate.backlog(queued, c.lanes.free_slots(), bytes, len).is_err()
                    || !self.pool.owns(&buf)
                {
                    return Err(Refused(Op { body: Body::Send(buf), user_data }));
                }
                let owner = c.owner;
                c.lanes.submit_send_with(
                    #[inline(always)]
                    || Slot::send_on(buf, owner, user_data),
                );
            }
            Body::Recv(buf) => {
                if c.gate.recv().is_err() || !self.pool.owns(&buf) {
                    return Err(Refused(Op { body: Body::Recv(buf), user_data }));
                }
                let owner = c.owner;
                c.lanes.submit_recv_with(
                    #[inline(always)]
                    || Slot::recv_on(buf, owner, user_data),
                );
            }
            Body::RawSend(raw) => {
                if c.gate.message(raw.len as usize).is_err() {
                    return Err(Refused(Op { body: Body::RawSend(raw), user_data }));
                }
                c.lanes.submit_send(Slot::raw(crate::OpCode::Send, raw, user_data));
            }
            Body::RawRecv(raw) => {
                if c.gate.recv().is_err() {
                    return Err(Refused(Op { body: Body::RawRecv(raw), user_data }));
                }
                c.lanes.submit_recv(Slot::raw(crate::OpCode::Recv, raw, user_data));
            }
        }
        list_dirty(&mut c.dirty, key, &mut self.dirty);
        Ok(())
    }

    /// `Core::flush_conn` on the lanes: receives, then sends, written in place and chained.
    #[inline(never)]
    fn flush(&mut self, key: ConnKey) {
        let Some(c) = self.conns.get_mut(key) else { return };
        c.dirty = false;
        if !c.gate.is_open() {
            return;
        }
        let (first, n) = c.lanes.plan_recvs(false);
        if n > 0 {
            // The post: the chain's head to the device (here `black_box`); all taken.
            std::hint::black_box(c.lanes.recv_wrs().with_chain(first, n, |head| head));
            if let Some(refused) = c.lanes.recvs_posted(n, n, true) {
                drop(refused);
            }
            let device = &mut self.device;
            c.lanes.run_ids(first, n, |id| device.recvs.push(id));
        }
        let run = c.lanes.plan_sends_imm(&mut self.room, 64);
        if run.n > 0 {
            std::hint::black_box(c.lanes.send_wrs().with_chain(run.first, run.n, |head| head));
            let device = &mut self.device;
            c.lanes.run_signaled(run, |id| device.signaled.push(id));
            if let Some(refused) = c.lanes.sends_posted(run, run.n, &mut self.room) {
                drop(refused);
            }
        }
        // The credit watch (`post::credit_watch`, without its timer): its state changes are
        // what it meters.
        let blocked = c.lanes.credit_blocked();
        if blocked != c.credit_waiting {
            c.credit_waiting = blocked;
        }
    }
}

/// Lists connection `key` to post, once (`post::list_dirty`): `listed` is its entry's flag
/// (a field of its own, so the entry's lanes may be held meanwhile).
#[inline(always)]
fn list_dirty(listed: &mut bool, key: ConnKey, dirty: &mut Vec<ConnKey>) {
    if !*listed {
        *listed = true;
        dirty.push(key);
    }
}

/// [`SlabPath`]'s echo handler on [`Path`]: caller memory, no pool (the same work per message as
/// the slab path's, to compare the structures alone).
#[derive(Debug)]
pub struct RawEcho(pub crate::RawBuf);

impl Handler for RawEcho {
    #[inline]
    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (crate::OpCode::Recv, Ok(n)) = (c.opcode, c.result) {
            let _ = conn.submit(Op::raw_send(crate::RawBuf { len: n, ..self.0 }).user_data(c.user_data + 1));
            let _ = conn.submit(Op::raw_recv(self.0).user_data(c.user_data));
        }
    }
}

/// The echo server's handler of [`Path`] (as `examples/echo.rs`'s): every message sent back in
/// its own buffer, a fresh receive posted; a send's completion drops the buffer.
#[derive(Debug, Default)]
pub struct Echo;

impl Handler for Echo {
    #[inline]
    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (crate::OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let Some(buf) = c.buf else { return };
            if conn.submit(Op::send(buf).user_data(c.user_data + 1)).is_err() {
                return;
            }
            if let Ok(buf) = conn.alloc(64) {
                let _ = conn.submit(Op::recv(buf).user_data(c.user_data));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Completion as RingCompletion, Conn as RingConn, Handler, Op as RingOp, Path, SlabPath};
    use std::cell::Cell;
    use std::rc::Rc;

    /// Counts what the ring path's handler sees, checking each completion; echoes like
    /// [`super::Echo`].
    struct Checked {
        recvs: Rc<Cell<u64>>,
        sends: Rc<Cell<u64>>,
        panic_at: Option<u64>,
    }

    impl Handler for Checked {
        fn on_completion(&mut self, conn: &mut RingConn<'_>, c: RingCompletion) {
            match c.opcode {
                OpCode::Recv => {
                    assert_eq!(c.result, Ok(64));
                    let buf = c.buf.expect("the receive's buffer");
                    assert_eq!(buf.len(), 64, "exactly the bytes received");
                    self.recvs.set(self.recvs.get() + 1);
                    if self.panic_at == Some(self.recvs.get()) {
                        panic!("a handler's panic, caught at the boundary");
                    }
                    conn.submit(RingOp::send(buf).user_data(7)).expect("the reply");
                    let next = conn.alloc(64).expect("a buffer");
                    conn.submit(RingOp::recv(next).user_data(3)).expect("the next receive");
                }
                _ => {
                    assert_eq!((c.user_data, c.result), (7, Ok(64)));
                    assert_eq!(c.buf.as_ref().map(|b| b.len()), Some(64), "the reply's buffer back");
                    self.sends.set(self.sends.get() + 1);
                }
            }
        }
    }

    fn checked(panic_at: Option<u64>) -> (Path, Rc<Cell<u64>>, Rc<Cell<u64>>) {
        let (recvs, sends) = (Rc::new(Cell::new(0)), Rc::new(Cell::new(0)));
        let h = Checked { recvs: recvs.clone(), sends: sends.clone(), panic_at };
        (Path::new(16, Box::new(h)), recvs, sends)
    }

    /// Issue 47: the ring design's path is the echo's: every message's receive completes, the
    /// handler answers it and posts a receive, the answer completes and its buffer goes back;
    /// nothing piles up (one receive posted, one buffer out), and no completion is stale.
    #[test]
    fn the_ring_path_echoes_every_message_and_keeps_nothing() {
        let (mut p, recvs, sends) = checked(None);
        for i in 1..=1000u64 {
            assert_eq!(p.message(), 2 * i, "two completions delivered a message");
        }
        assert_eq!((recvs.get(), sends.get()), (1000, 1000));
        assert_eq!(p.buffers_in_use(), 1, "the receive posted now, nothing else held");
        assert_eq!(p.stale(), (0, 2000));
    }

    /// A completion naming no outstanding operation (one already completed, another epoch's,
    /// another connection slot's, a position never posted, a token, garbage) is counted stale
    /// and reaches no operation and no handler; the path goes on.
    #[test]
    fn stale_and_hostile_completions_are_counted_and_reach_nothing() {
        use crate::proto::token::{Dir, Kind, WrId};
        let (mut p, recvs, _) = checked(None);
        p.message();
        let done = p.posted_recv().expect("a receive posted");
        p.message();
        let live = p.posted_recv().expect("a receive posted");
        let id = WrId::decode(live).expect("a ring id");
        let before = (p.message(), recvs.get(), p.buffers_in_use());
        let live = p.posted_recv().unwrap();
        let id_now = WrId::decode(live).unwrap();
        let hostile = [
            done,
            WrId::at(WrId::base(id.index, id.epoch.wrapping_add(1), Dir::Recv).unwrap(), id_now.seq),
            WrId::at(WrId::base(id.index + 1, id.epoch, Dir::Recv).unwrap(), id_now.seq),
            WrId::at(WrId::base(id.index, id.epoch, Dir::Recv).unwrap(), id_now.seq + 1),
            WrId::at(WrId::base(id.index, id.epoch, Dir::Send).unwrap(), id_now.seq),
            crate::proto::token::Token::new(Kind::Op, id.index, 1).as_u64(),
            0,
            u64::MAX,
            0xA000_0000_0000_0000,
        ];
        let (stale, reaped) = p.stale();
        for raw in hostile {
            p.complete_raw(raw);
        }
        assert_eq!(p.stale(), (stale + hostile.len() as u64, reaped + hostile.len() as u64));
        assert_eq!((recvs.get(), p.buffers_in_use()), (before.1, before.2), "nothing reached");
        assert_eq!(p.posted_recv(), Some(live), "the posted receive is still the one posted");
        assert_eq!(p.message(), before.0 + 2, "and it completes as before");
    }

    /// A handler's panic is caught at the boundary, as `api/guard.rs` does: the handler stays,
    /// the next messages are delivered.
    #[test]
    fn a_handlers_panic_is_caught_and_the_handler_kept() {
        let (mut p, recvs, sends) = checked(Some(3));
        for _ in 0..3 {
            p.message();
        }
        assert!(p.core.panic.take().is_some(), "kept for the end of the tick");
        // The third receive's buffer was dropped with the panic and nothing was posted after it:
        // the connection has no receive posted any more (a handler that panics before posting
        // stalls its own connection, as in the reactor).
        assert_eq!(p.posted_recv(), None);
        assert_eq!((recvs.get(), sends.get()), (3, 2));
        assert_eq!(p.buffers_in_use(), 0);
    }

    /// Answers each message twice (its own buffer, then a fresh one), so one signaled send
    /// completes two operations; panics at the first send completion it sees.
    struct Twice {
        sent: Rc<std::cell::RefCell<Vec<u64>>>,
        panicked: bool,
    }

    impl Handler for Twice {
        fn on_completion(&mut self, conn: &mut RingConn<'_>, c: RingCompletion) {
            if c.opcode == OpCode::Recv {
                let buf = c.buf.expect("the receive's buffer");
                conn.submit(RingOp::send(buf).user_data(7)).expect("the first reply");
                let second = conn.alloc(64).expect("a buffer");
                conn.submit(RingOp::send(second).user_data(8)).expect("the second reply");
                let next = conn.alloc(64).expect("a buffer");
                conn.submit(RingOp::recv(next)).expect("the next receive");
                return;
            }
            assert_eq!(c.result, Ok(64));
            self.sent.borrow_mut().push(c.user_data);
            if !self.panicked {
                self.panicked = true;
                panic!("a handler's panic in the middle of a send completion");
            }
        }
    }

    /// A handler's panic at the first operation a signaled send completion completes is caught
    /// and the completion resumes after it: the second operation is delivered too (to the same
    /// handler), its buffer goes back, and the path goes on.
    #[test]
    fn a_panic_inside_a_send_completion_resumes_at_its_next_operation() {
        let sent = Rc::new(std::cell::RefCell::new(Vec::new()));
        let mut p = Path::new(16, Box::new(Twice { sent: sent.clone(), panicked: false }));
        // One receive completion, one send completion of two operations: three delivered.
        assert_eq!(p.message(), 3);
        assert!(p.core.panic.take().is_some(), "kept for the end of the tick");
        assert_eq!(*sent.borrow(), [7, 8], "both operations delivered, in order");
        assert_eq!(p.buffers_in_use(), 1, "both replies' buffers back, the receive posted");
        // Two sends a message against the one credit each message brings: the 16 credits the
        // peer granted last a few more messages (then the replies wait for credits).
        for i in 1..=10u64 {
            assert_eq!(p.message(), 3 + 3 * i);
        }
        assert!(p.core.panic.is_none());
        assert_eq!(sent.borrow().len(), 22);
        assert_eq!(p.buffers_in_use(), 1);
        assert_eq!(p.stale(), (0, 22));
    }

    use crate::{Completion, Op, OpCode, RawBuf};

    /// The path is the echo's: every message's receive completes, the handler answers it and
    /// posts the receive again, the answer completes; nothing piles up in the tables.
    #[test]
    fn the_slab_path_echoes_every_message_and_keeps_nothing() {
        let mut p = SlabPath::new(16);
        let (mut recvs, mut sends) = (0u64, 0u64);
        let mut handler = |c: Completion, raw: RawBuf| match c.opcode {
            OpCode::Recv => {
                assert_eq!(c.result, Ok(64));
                recvs += 1;
                [Some(Op::raw_send(raw).user_data(7)), Some(Op::raw_recv(raw).user_data(3))]
            }
            _ => {
                assert_eq!((c.user_data, c.result), (7, Ok(64)));
                sends += 1;
                [None, None]
            }
        };
        let live = p.ops.len();
        // The first receive is `Path::new`'s (user_data 0), the others the handler's.
        assert_eq!(p.message(&mut handler), 7);
        for _ in 1..1000 {
            assert_eq!(p.message(&mut handler), 3 + 7);
        }
        assert_eq!((recvs, sends), (1000, 1000));
        assert_eq!(p.ops.len(), live, "one receive posted, nothing else held");
    }
}
