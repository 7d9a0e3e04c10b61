//! What the VM contains and what its init does.
//!
//! Layout inside the VM:
//! - `/init`: a busybox sh script (PID 1): mounts proc/sys/devtmpfs, tmpfs on `/tmp` and
//!   `/dev/shm`, loads the RDMA modules, creates the dummy netdev `d0` (198.18.0.1/24) and the
//!   soft-RoCE device `rxe0` on it, waits until its port is ACTIVE, then runs `/xtask/cmd.sh` as
//!   root (memlock unlimited, cwd `/tmp`) and reports its exit status on the console.
//! - `$BIN` = `/xtask/bin`: the project's examples and integration tests by target name.
//! - the rdma-core/perftest/iproute2 tools at their host paths, busybox applets for the rest.
//! - `runas USER CMD [ARGS...]` (`/usr/local/bin/runas`): runs CMD as USER (`rdmauser`, uid and
//!   gid 1000, home `/home/rdmauser`) with memlock limited to `$RUNAS_MEMLOCK` KiB (default 8192,
//!   or `unlimited`).
//!
//! A VM of a linked pair (`cargo xtask vm2`, [`Link`]) differs in its network: instead of `d0`
//! its rxe0 sits on a virtio NIC (its address `$RDMA_ADDR`, the peer's `$PEER_ADDR`, in one
//! /24), `sch_netem` is loaded (and `sch_ingress`, `cls_u32`, `act_gact`: a `clsact` u32
//! filter can drop chosen packets), and it has the helpers `peer-signal`, `peer-wait`, `peer-sync`
//! (a busybox httpd on the link serves this VM's signals), `vm-poweroff` and `xtask-mark`
//! (see [`LINK_HELPERS`]).

use std::path::{Path, PathBuf};

use crate::initramfs::{self, Archive};
use crate::project::Binaries;
use crate::setup::Kernel;
use crate::util::{self, shell_quote, Error, Result};

/// The address of the rxe netdev inside the VM (`$RDMA_ADDR`); TEST-NET-2 (RFC 2544), never routed.
pub const RDMA_ADDR: &str = "198.18.0.1";
/// The netdev rxe0 sits on.
pub const NETDEV: &str = "d0";
/// The soft-RoCE device's name.
pub const RXE_DEV: &str = "rxe0";
/// The Soft-iWARP device's name.
pub const SIW_DEV: &str = "siw0";
/// The netdev siw0 sits on in the single VM (a second dummy).
pub const SIW_NETDEV: &str = "s0";
/// The netdev siw0 sits on in a linked VM: its own virtio NIC, renamed (rxe0 has the other).
pub const SIW_LINK_NETDEV: &str = "s0";
/// A linked VM's NICs: the first for rxe0, the second for siw0, each on a link of its own.
pub const LINK_NICS: usize = 2;

/// The MAC address of NIC `nic` (0: rxe0's, 1: siw0's) of linked VM `vm` (0: A, 1: B); the
/// guest tells its NICs apart by it.
pub fn link_mac(nic: usize, vm: usize) -> String {
    format!("52:54:00:{:02x}:00:{:02x}", 0x18 + nic, vm + 1)
}

/// Which soft RDMA device a boot's command is pointed at (`$RDMA_DEV`, `$RDMA_ADDR`, ...).
/// Both devices are up in every boot; this only chooses what the variables name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// Soft-RoCE (`rdma_rxe`): RoCE v2, the default.
    #[default]
    Rxe,
    /// Soft-iWARP (`siw`, built out of tree, [`crate::siw`]): iWARP over TCP.
    Siw,
}

impl Device {
    /// Its name on the command line and in row labels.
    pub fn name(self) -> &'static str {
        match self {
            Device::Rxe => "rxe",
            Device::Siw => "siw",
        }
    }

    /// The RDMA device's name (`$RDMA_DEV`): `rxe0` or `siw0`.
    pub fn dev(self) -> &'static str {
        match self {
            Device::Rxe => RXE_DEV,
            Device::Siw => SIW_DEV,
        }
    }

    /// What it is, for headings: `Soft-RoCE` or `Soft-iWARP`.
    pub fn describe(self) -> &'static str {
        match self {
            Device::Rxe => "Soft-RoCE",
            Device::Siw => "Soft-iWARP",
        }
    }

    /// Parses `rxe` or `siw`.
    pub fn parse(s: &str) -> Result<Device> {
        match s {
            "rxe" => Ok(Device::Rxe),
            "siw" => Ok(Device::Siw),
            _ => Err(Error::new(format!("unknown device {s:?}: rxe or siw"))),
        }
    }

    /// The IPv4 subnet's third octet and the IPv6 prefix's group of this device's netdev.
    fn net(self) -> u8 {
        match self {
            Device::Rxe => 0,
            Device::Siw => 1,
        }
    }
}

/// The IPv4 address of `device`'s netdev in VM `n` (1 for the single VM and A, 2 for B).
pub fn addr4(device: Device, n: u8) -> String {
    format!("198.18.{}.{n}", device.net())
}

/// The IPv6 (ULA) address of `device`'s netdev in VM `n` (`$RDMA_ADDR6`).
pub fn addr6(device: Device, n: u8) -> String {
    format!("fd18:{}::{n}", device.net())
}

/// The link-local IPv6 address of `device`'s netdev in VM `n` (`$RDMA_LL6`, without its scope).
pub fn ll6(device: Device, n: u8) -> String {
    format!("fe80::{}:{n}", device.net() + 1)
}
/// Where the project's binaries are inside the VM (`$BIN`).
pub const BIN_DIR: &str = "/xtask/bin";
/// The unprivileged user.
pub const USER: &str = "rdmauser";
/// Its uid and gid.
pub const USER_ID: u32 = 1000;

/// Host programs copied into the VM (at their host paths, with their libraries).
pub const TOOLS: &[&str] = &[
    "rping",
    "rdma_server",
    "rdma_client",
    "cmtime",
    "ucmatose",
    "udaddy",
    "ib_send_lat",
    "ib_send_bw",
    "ib_write_lat",
    "ib_write_bw",
    "ib_read_lat",
    "ib_read_bw",
    "ibv_devices",
    "ibv_devinfo",
    "ibv_rc_pingpong",
    "rdma",
    "ip",
    "tc",
];

/// Kernel modules loaded at boot, in this order (their dependencies come first).
/// crc32_generic first: rdma_rxe needs a crc32 crypto driver or `rdma link add` fails;
/// crc32c_generic and libcrc32c for siw (its MPA CRC), which is loaded last, from
/// [`crate::siw`]'s build.
const MODULES: &[&str] =
    &["crc32_generic", "crc32c_generic", "configfs", "dummy", "ib_uverbs", "rdma_ucm", "rdma_rxe", "libcrc32c"];
/// Modules that newer kernels may not have (rxe there uses the crc32 library directly).
const OPTIONAL_MODULES: &[&str] = &["crc32_generic", "crc32c_generic"];
/// More modules for a linked VM: its NICs, netem for `tc qdisc ... netem`, and `clsact` with
/// `u32` matches and the drop action for a filter that drops chosen packets (`dreq-lost`).
const LINK_MODULES: &[&str] = &["virtio_pci", "virtio_net", "sch_netem", "sch_ingress", "cls_u32", "act_gact"];

/// The two VMs of a linked pair, by name, and their addresses (TEST-NET-2, never routed; the
/// frames travel only between the two qemu processes).
pub const LINK_VMS: [(&str, &str); 2] = [("A", "198.18.0.1"), ("B", "198.18.0.2")];
/// The TCP port of a linked VM's signal server (busybox httpd on `$RDMA_ADDR`), which
/// `peer-wait` on the other VM polls.
pub const SIGNAL_PORT: u16 = 7999;
/// Where a linked VM keeps the signals it has set (the signal server's document root).
const SIGNAL_DIR: &str = "/run/peer";

/// A VM's place on a two-VM link.
#[derive(Debug, Clone, Copy)]
pub struct Link<'a> {
    /// `A` or `B` (`$VM_NAME`).
    pub name: &'a str,
    /// Its own address (`$RDMA_ADDR`).
    pub addr: &'a str,
    /// The other VM's address (`$PEER_ADDR`).
    pub peer: &'a str,
}

/// The prefix of every marker line the guest prints for xtask (followed by `PAYLOAD@@`).
pub fn marker_prefix(nonce: &str) -> String {
    format!("@@xtask-{nonce}:")
}

/// A marker line as a shell command (for generated scripts).
pub fn echo_marker(nonce: &str, payload_sh: &str) -> String {
    format!("echo \"{}{payload_sh}@@\"", marker_prefix(nonce))
}

/// The script `/xtask/cmd.sh` for `cargo xtask vm -- ARGS`: one argument is a shell command
/// line (`sh -c ARG`); several are a command and its arguments, passed exactly.
pub fn command_script(args: &[String]) -> String {
    let mut s = String::from("# the command given to `cargo xtask vm`\n");
    if let [line] = args {
        s.push_str(line);
    } else {
        s.push_str(&args.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" "));
    }
    s.push('\n');
    s
}

/// The start of a linked VM's `cmd.sh`: busybox's sh runs its own applets in preference to
/// `PATH`, so `ip` and `tc` would be busybox's (whose `tc` has no netem); these functions make
/// them iproute2's in the command line. A nested `sh` needs `. /xtask/iproute2.sh` again.
pub const IPROUTE2_PRELUDE: &str = ". /xtask/iproute2.sh\n";

/// [`command_script`] for a linked VM: [`IPROUTE2_PRELUDE`] first.
pub fn link_command_script(args: &[String]) -> String {
    format!("{IPROUTE2_PRELUDE}{}", command_script(args))
}

/// What a guest boot runs.
pub struct Guest<'a> {
    /// The unique marker nonce of this boot.
    pub nonce: &'a str,
    /// `/xtask/cmd.sh`.
    pub script: String,
    /// Extra `KEY=VALUE` environment for the command.
    pub env: &'a [(String, String)],
    /// `Some`: one of two linked VMs (a virtio NIC instead of the dummy `d0`).
    pub link: Option<Link<'a>>,
    /// Add [`PROFILE_TOOLS`] (`perf`, `strace`) and let root profile the kernel too
    /// (`perf_event_paranoid` -1, `kptr_restrict` 0).
    pub profiling: bool,
    /// Add valgrind's cachegrind and callgrind ([`add_valgrind`]: `bench --instructions`).
    pub valgrind: bool,
    /// The device the command's variables name.
    pub device: Device,
}

/// Host programs copied into the VM only when it profiles (`vm --perf`, `bench`): perf's
/// libraries are large.
pub const PROFILE_TOOLS: &[&str] = &["perf", "strace"];

/// The script of `cargo xtask vm --perf -- ARGS`: the command ([`command_script`]) runs twice,
/// under `perf stat` (software counters: emulation has no hardware ones) and under
/// `perf record` (cpu-clock samples of every process it starts), then a flat report of where
/// the samples fell (self time, by command, binary and symbol; inlined frames resolved from
/// the perf profile's line tables) and the hottest symbols of the project's binaries alone.
/// Exits with the recorded run's status. `--env PERF_RECORD='...'` replaces the record options
/// (default `-F 4999 -e cpu-clock`; `--call-graph dwarf` for call chains), `--env
/// PERF_REPORT='...'` the report's (default `--no-children`).
pub fn perf_script(args: &[String]) -> String {
    let cmd = command_script(args);
    format!(
        r#"# cargo xtask vm --perf (xtask/src/guest.rs)
echo -1 > /proc/sys/kernel/perf_event_paranoid
echo 0 > /proc/sys/kernel/kptr_restrict
cat > /tmp/perf-cmd.sh <<'XTASK_PERF_EOF'
{cmd}XTASK_PERF_EOF
echo "== perf stat"
perf stat -e task-clock,context-switches,cpu-migrations,page-faults -- sh /tmp/perf-cmd.sh
echo "== perf record"
perf record -q ${{PERF_RECORD:--F 4999 -e cpu-clock}} -o /tmp/perf.data -- sh /tmp/perf-cmd.sh
rc=$?
echo "== perf report: self time by command, binary, symbol (>= 0.5 %)"
perf report -i /tmp/perf.data --stdio ${{PERF_REPORT:---no-children}} --sort comm,dso,symbol --percent-limit 0.5 2>/dev/null | grep -v '^$'
echo "== perf report: the project's binaries alone (\$BIN), by symbol"
dsos=$(ls "$BIN" | tr '\n' ',')
perf report -i /tmp/perf.data --stdio ${{PERF_REPORT:---no-children}} --dsos "${{dsos%,}}" --sort comm,symbol --percent-limit 0.3 2>/dev/null | grep -v '^$'
exit $rc
"#
    )
}

/// Shell lines giving `dev` its IPv4 and IPv6 addresses for `device` in VM `n` (no duplicate
/// address detection: the addresses are usable at once) and bringing it up.
fn addresses(dev: &str, device: Device, n: u8) -> String {
    let (a4, a6, ll) = (addr4(device, n), addr6(device, n), ll6(device, n));
    format!(
        "out=$(ip addr add {a4}/24 dev {dev} 2>&1 && ip -6 addr add {a6}/64 dev {dev} nodad 2>&1 \
         && ip -6 addr add {ll}/64 dev {dev} nodad 2>&1 && ip link set {dev} up 2>&1) || fail \"netdev {dev}: $out\"\n"
    )
}

/// The network part of `/init` for the single VM: rxe0 on the dummy netdev `d0`, siw0 on the
/// dummy `s0` (a linked VM names siw0's NIC the same).
fn dummy_net() -> String {
    format!(
        r#"out=$(ip link add {NETDEV} type dummy 2>&1 && ip link add {SIW_NETDEV} type dummy 2>&1) || fail "dummy netdevs: $out"
{}{}out=$(rdma link add {RXE_DEV} type rxe netdev {NETDEV} 2>&1) || fail "rdma link add {RXE_DEV}: $out"
out=$(rdma link add {SIW_DEV} type siw netdev {SIW_NETDEV} 2>&1) || fail "rdma link add {SIW_DEV}: $out"
"#,
        addresses(NETDEV, Device::Rxe, 1),
        addresses(SIW_NETDEV, Device::Siw, 1),
    )
}

/// The network part of `/init` for a linked VM: rxe0 on the virtio NIC (the one netdev besides
/// `lo`), the environment naming both ends, and the signal server.
/// A linked VM's number in the addresses: 1 for A, 2 for B.
fn link_index(l: &Link) -> u8 {
    if l.name == LINK_VMS[0].0 {
        1
    } else {
        2
    }
}

fn link_net(l: &Link) -> String {
    let (name, addr, peer) = (l.name, l.addr, l.peer);
    let n = link_index(l);
    let rxe_addrs = addresses("$nic", Device::Rxe, n);
    let siw_addrs = addresses(SIW_LINK_NETDEV, Device::Siw, n);
    let host = format!("vm-{}", name.to_ascii_lowercase());
    let n0 = link_mac(0, n as usize - 1);
    let n1 = link_mac(1, n as usize - 1);
    format!(
        r#"hostname {host}
nic=
snic=
i=0
while :; do
    for n in /sys/class/net/*; do
        case "$(cat $n/address 2>/dev/null)" in
        {n0}) nic=${{n##*/}} ;;
        {n1}) snic=${{n##*/}} ;;
        esac
    done
    [ -n "$nic" ] && [ -n "$snic" ] && break
    i=$((i + 1))
    [ $i -gt 200 ] && fail "the link's two NICs ({n0}, {n1}) did not appear: $(ls /sys/class/net)"
    usleep 50000
done
out=$(ip link set dev $snic name {SIW_LINK_NETDEV} 2>&1) || fail "rename $snic to {SIW_LINK_NETDEV}: $out"
export RXE_NETDEV=$nic VM_NAME={name} LINK_PEER_ADDR={peer}
{rxe_addrs}{siw_addrs}out=$(rdma link add {RXE_DEV} type rxe netdev $nic 2>&1) || fail "rdma link add {RXE_DEV} netdev $nic: $out"
out=$(rdma link add {SIW_DEV} type siw netdev {SIW_LINK_NETDEV} 2>&1) || fail "rdma link add {SIW_DEV} netdev {SIW_LINK_NETDEV}: $out"
mkdir -p {SIGNAL_DIR}
out=$(httpd -p {addr}:{SIGNAL_PORT} -h {SIGNAL_DIR} 2>&1) || fail "httpd (the signal server): $out"
"#
    )
}

/// The `export` line naming the chosen device's addresses: `$RDMA_DEV`, `$RDMA_ADDR`,
/// `$RDMA_ADDR6`, `$RDMA_LL6`, `$RDMA_NETDEV` (and in a linked VM `$PEER_ADDR`, `$PEER_ADDR6`,
/// `$PEER_LL6`), plus both devices' own (`$RXE_ADDR`, `$SIW_ADDR`, ...), whichever is chosen.
fn device_env(g: &Guest) -> String {
    let (n, rxe_netdev, siw_netdev) = match &g.link {
        None => (1, NETDEV.to_string(), SIW_NETDEV),
        Some(l) => (link_index(l), "$RXE_NETDEV".to_string(), SIW_LINK_NETDEV),
    };
    let mut e = format!(
        "export RXE_DEV={RXE_DEV} RXE_ADDR={} RXE_ADDR6={} RXE_NETDEV={rxe_netdev} \\\n    SIW_DEV={SIW_DEV} SIW_ADDR={} SIW_ADDR6={} SIW_NETDEV={siw_netdev}\n",
        addr4(Device::Rxe, n),
        addr6(Device::Rxe, n),
        addr4(Device::Siw, n),
        addr6(Device::Siw, n),
    );
    let d = g.device;
    let (dev, netdev) = match d {
        Device::Rxe => (RXE_DEV, rxe_netdev),
        Device::Siw => (SIW_DEV, siw_netdev.to_string()),
    };
    e.push_str(&format!(
        "export RDMA_DEVICE={} RDMA_DEV={dev} RDMA_ADDR={} RDMA_ADDR6={} RDMA_LL6={} RDMA_NETDEV={netdev}\n",
        d.name(),
        addr4(d, n),
        addr6(d, n),
        ll6(d, n)
    ));
    if g.link.is_some() {
        let p = 3 - n;
        e.push_str(&format!("export PEER_ADDR={} PEER_ADDR6={} PEER_LL6={}\n", addr4(d, p), addr6(d, p), ll6(d, p)));
    }
    e
}

fn init_script(g: &Guest, modules: &[String], prelude: &str) -> String {
    let m = marker_prefix(g.nonce);
    let dev_env = device_env(g);
    let mut env = String::new();
    for (k, v) in g.env {
        env.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    let mods = modules.join(" ");
    let (net, hostname) = match &g.link {
        None => (dummy_net(), "hostname rxe-vm\n"),
        Some(l) => (link_net(l), ""),
    };
    format!(
        r#"#!/bin/sh
# PID 1 of the rdma-reactor test VM, generated by `cargo xtask`.
export PATH={BIN_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TMPDIR=/tmp BIN={BIN_DIR}
export RUST_BACKTRACE=1
{prelude}
fail() {{
    echo "{m}setup-failed $(echo "$*" | tr '\n' ' ')@@"
    poweroff -f
    sleep 30
}}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
# Pass the command's output through unchanged (no CR before LF).
stty -onlcr 2>/dev/null
{hostname}for m in {mods}; do
    out=$(insmod /xtask/modules/$m.ko 2>&1) || fail "insmod $m: $out"
done
[ -d /sys/kernel/config ] && mount -t configfs configfs /sys/kernel/config 2>/dev/null
ip link set lo up
# IPv6 addresses usable at once (no duplicate address detection on these private links).
echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad
echo 0 > /proc/sys/net/ipv6/conf/all/accept_dad
# ... and kept when a test takes the netdev down and up (Linux drops IPv6 addresses then).
echo 1 > /proc/sys/net/ipv6/conf/default/keep_addr_on_down
echo 1 > /proc/sys/net/ipv6/conf/all/keep_addr_on_down
# Soft-iWARP's streams are kernel TCP sockets, and a test's clients and servers share this
# kernel: 10 000 connections closing at once leave 10 000 orphaned sockets on each side for a
# moment. The 2 GiB default (8192) makes the kernel abort streams past it ("TCP: too many
# orphaned sockets"), and a stream aborted that way closes without the other end hearing it
# (tests/scale.rs, FAULTS.md).
echo 65536 > /proc/sys/net/ipv4/tcp_max_orphans
{net}for d in {RXE_DEV} {SIW_DEV}; do
    i=0
    until rdma link show $d/1 2>/dev/null | grep -q 'state ACTIVE'; do
        i=$((i + 1))
        [ $i -gt 200 ] && fail "$d did not become ACTIVE: $(rdma link show 2>&1)"
        usleep 50000
    done
done
chmod 0666 /dev/infiniband/* 2>/dev/null
ulimit -l unlimited
{dev_env}{env}cd /tmp
echo "{m}start@@"
sh /xtask/cmd.sh </dev/null
echo "{m}exit=$?@@"
sync
poweroff -f
sleep 30
"#
    )
}

const RUNAS: &str = r#"#!/bin/sh
# runas USER CMD [ARGS...]: run CMD as USER (e.g. rdmauser, uid 1000), with HOME, USER and
# LOGNAME set and the memlock limit lowered to $RUNAS_MEMLOCK KiB (default 8192, as systemd
# gives logins; `unlimited` keeps root's), like an ordinary login would have.
if [ $# -lt 2 ]; then
    echo "usage: runas USER CMD [ARGS...]" >&2
    exit 2
fi
user=$1
shift
ulimit -l "${RUNAS_MEMLOCK:-8192}" || exit 125
# `--` keeps su from taking CMD's options (e.g. `id -u`) as its own.
exec su -s /bin/sh -c 'exec "$@"' -- "$user" runas "$@"
"#;

/// The helper commands of a linked VM (in `/usr/local/bin`), by name; `NONCE` in a text stands
/// for the boot's marker nonce.
pub const LINK_HELPERS: &[(&str, &str)] = &[
    (
        "peer-signal",
        r#"#!/bin/sh
# peer-signal NAME [TEXT]: tells the peer VM that NAME happened: `peer-wait NAME` there
# returns (printing TEXT, default 1). NAME: letters, digits, . _ - (not first).
case $1 in
    '' | [._-]* | *[!A-Za-z0-9._-]*) echo "usage: peer-signal NAME [TEXT] (NAME: [A-Za-z0-9._-]+)" >&2; exit 2 ;;
esac
printf '%s\n' "${2:-1}" > "/run/peer/.$1" && mv "/run/peer/.$1" "/run/peer/$1"
"#,
    ),
    (
        "peer-wait",
        r#"#!/bin/sh
# peer-wait NAME [SECS]: waits until the peer VM has run `peer-signal NAME` (polling its
# signal server, an httpd, every 0.2 s), at most SECS seconds (default 60); prints the
# signal's TEXT. Exit status 0, or 1 on timeout (with a message on stderr).
case $1 in
    '' | [._-]* | *[!A-Za-z0-9._-]*) echo "usage: peer-wait NAME [SECS]" >&2; exit 2 ;;
esac
secs=${2:-60}
uptime_s() { read -r u _ < /proc/uptime; echo "${u%%.*}"; }
end=$(( $(uptime_s) + secs ))
while :; do
    # (busybox's static wget crashes; nc speaks enough HTTP/1.0)
    resp=$(printf 'GET /%s HTTP/1.0\r\n\r\n' "$1" | timeout 5 nc -w 2 "$LINK_PEER_ADDR" SIGNAL_PORT 2>/dev/null | tr -d '\r')
    case $resp in
        "HTTP/1."?" 200 "*)
            printf '%s\n' "$resp" | sed '1,/^$/d'
            exit 0
            ;;
    esac
    if [ "$(uptime_s)" -ge "$end" ]; then
        echo "peer-wait: the peer ($LINK_PEER_ADDR) did not signal $1 within $secs s" >&2
        exit 1
    fi
    usleep 200000
done
"#,
    ),
    (
        "peer-sync",
        r#"#!/bin/sh
# peer-sync NAME [SECS]: a barrier: signals NAME, then waits (at most SECS, default 60) until
# the peer has signalled NAME too.
peer-signal "$1" && peer-wait "$1" "${2:-60}" > /dev/null
"#,
    ),
    (
        "vm-poweroff",
        r#"#!/bin/sh
# vm-poweroff: powers this VM off at once, as if its plug were pulled (no orderly shutdown,
# nothing more goes out on the link). The command counts as having exited with status 0.
echo "@@xtask-NONCE:exit=0@@" > /dev/console
echo o > /proc/sysrq-trigger
sleep 5
poweroff -f
"#,
    ),
    (
        "xtask-mark",
        r#"#!/bin/sh
# xtask-mark TEXT...: prints a marker line for xtask on the console (as `case NAME pass|fail
# DETAIL` for `cargo xtask vm2 --cases`); it is not shown.
echo "@@xtask-NONCE:$*@@" > /dev/console
"#,
    ),
];

/// `/xtask/iproute2.sh`, which [`IPROUTE2_PRELUDE`] sources.
fn iproute2_functions() -> Result<String> {
    let ip = initramfs::guest_path(&host_tool("ip")?)?;
    let tc = initramfs::guest_path(&host_tool("tc")?)?;
    Ok(format!(
        "# busybox sh prefers its own applets to PATH: use iproute2's ip and tc.\n\
         ip() {{ /{ip} \"$@\"; }}\ntc() {{ /{tc} \"$@\"; }}\n"
    ))
}

fn host_tool(name: &str) -> Result<PathBuf> {
    util::which(name).ok_or_else(|| {
        Error::new(format!("{name} not found on this host: run `cargo xtask setup` to install the packages"))
    })
}

/// The rxe and siw verbs providers and their driver files (libibverbs dlopens them).
fn add_providers(a: &mut Archive) -> Result<()> {
    let libs = initramfs::ldd(&host_tool("ibv_devices")?)?;
    let ibverbs = libs
        .iter()
        .find(|l| l.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libibverbs.so")))
        .ok_or_else(|| Error::new("ibv_devices is not linked to libibverbs?"))?;
    let dir = ibverbs.parent().unwrap_or(Path::new("/")).join("libibverbs");
    for name in ["rxe", "siw"] {
        let prefix = format!("lib{name}-rdmav");
        let provider = std::fs::read_dir(&dir)
            .ok()
            .and_then(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix)))
            })
            .ok_or_else(|| Error::new(format!("no {prefix}*.so in {}: install ibverbs-providers", dir.display())))?;
        initramfs::add_with_libs(a, &provider, None)?;
        let driver = PathBuf::from(format!("/etc/libibverbs.d/{name}.driver"));
        let guest = format!("etc/libibverbs.d/{name}.driver");
        if driver.is_file() {
            a.host_file(&guest, &driver)?;
        } else {
            a.data(&guest, format!("driver {name}\n"), 0o644)?;
        }
    }
    // pthread_exit/cancel dlopen libgcc_s for unwinding and abort without it.
    let libc = libs
        .iter()
        .find(|l| l.file_name().is_some_and(|n| n == "libc.so.6"))
        .ok_or_else(|| Error::new("ibv_devices is not linked to libc.so.6?"))?;
    let gcc_s = libc.parent().unwrap_or(Path::new("/")).join("libgcc_s.so.1");
    initramfs::add_with_libs(a, &gcc_s, None)
}

fn add_base(a: &mut Archive, profiling: bool) -> Result<()> {
    initramfs::usr_links(a)?;
    for d in ["proc", "sys", "dev", "tmp", "run", "mnt", "var/tmp", "usr/local/bin"] {
        a.dir(d, if d.ends_with("tmp") { 0o1777 } else { 0o755 }, 0, 0)?;
    }
    a.dir("root", 0o700, 0, 0)?;
    a.dir(&format!("home/{USER}"), 0o755, USER_ID, USER_ID)?;
    a.char_dev("dev/console", 0o600, 5, 1)?;
    a.data(
        "etc/passwd",
        format!(
            "root:x:0:0:root:/root:/bin/sh\n{USER}:x:{USER_ID}:{USER_ID}:rdma-reactor test user:/home/{USER}:/bin/sh\n"
        ),
        0o644,
    )?;
    a.data("etc/group", format!("root:x:0:\n{USER}:x:{USER_ID}:\n"), 0o644)?;
    a.data("etc/shadow", format!("root:*:1::::::\n{USER}:*:1::::::\n"), 0o600)?;
    a.data("etc/nsswitch.conf", "passwd: files\ngroup: files\nshadow: files\nhosts: files\n", 0o644)?;
    a.data("etc/hosts", format!("127.0.0.1 localhost\n{RDMA_ADDR} rxe-vm\n"), 0o644)?;
    a.data("etc/hostname", "rxe-vm\n", 0o644)?;
    a.data("usr/local/bin/runas", RUNAS, 0o755)?;
    let mut taken: Vec<&str> = TOOLS.to_vec();
    taken.push("runas");
    for t in TOOLS {
        initramfs::add_with_libs(a, &host_tool(t)?, None)?;
    }
    if profiling {
        for t in PROFILE_TOOLS {
            initramfs::add_with_libs(a, &host_tool(t)?, None)?;
            taken.push(*t);
        }
    }
    add_providers(a)?;
    initramfs::add_busybox(a, &taken)
}

/// A packed initramfs file, removed when dropped (each boot has its own, so runs in parallel
/// do not trip over each other).
pub struct Initrd(PathBuf);

impl Initrd {
    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Initrd {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Where Debian's valgrind keeps its tools (compiled into `valgrind.bin`).
const VALGRIND_LIBEXEC: &str = "/usr/libexec/valgrind";

/// valgrind for counting instructions in the guest (`bench --instructions`): the launcher
/// `valgrind.bin` (Debian's `valgrind` is a shell wrapper around it that sets nothing the
/// counts need), the cachegrind and callgrind tools (static) and the core preload, at their
/// host paths. Only when asked: it is not small.
fn add_valgrind(a: &mut Archive) -> Result<()> {
    initramfs::add_with_libs(a, &host_tool("valgrind.bin")?, None)?;
    for f in ["cachegrind-amd64-linux", "callgrind-amd64-linux", "vgpreload_core-amd64-linux.so", "default.supp"] {
        let p = Path::new(VALGRIND_LIBEXEC).join(f);
        if !p.exists() {
            return Err(Error::new(format!("{} not found: run `cargo xtask setup` (package valgrind)", p.display())));
        }
        a.host_file(&initramfs::guest_path(&p)?, &p)?;
    }
    Ok(())
}

/// Packs the initramfs for one boot (`target/xtask/vm/initramfs-NONCE.cpio`).
pub fn pack(kernel: &Kernel, bins: &Binaries, guest: &Guest) -> Result<Initrd> {
    let mut a = Archive::new();
    add_base(&mut a, guest.profiling)?;
    if guest.valgrind {
        add_valgrind(&mut a)?;
    }
    let mut wanted = MODULES.to_vec();
    if guest.link.is_some() {
        wanted.extend_from_slice(LINK_MODULES);
    }
    let modules = initramfs::add_modules(&mut a, kernel, &wanted, OPTIONAL_MODULES, "xtask/modules")?;
    let mut names: Vec<String> = modules.iter().map(|f| f.trim_end_matches(".ko").to_string()).collect();
    // siw last: it needs ib_core and libcrc32c, loaded above.
    let siw = crate::siw::module_path(kernel);
    let siw_bytes = std::fs::read(&siw)
        .map_err(|e| Error::new(format!("cannot read {} ({e}): run `cargo xtask setup`", siw.display())))?;
    a.data("xtask/modules/siw.ko", siw_bytes, 0o644)?;
    names.push("siw".into());
    a.dir(BIN_DIR, 0o755, 0, 0)?;
    for b in bins.all() {
        initramfs::add_with_libs(&mut a, &b.path, Some(&format!("{BIN_DIR}/{}", b.name)))?;
    }
    if let Some(l) = &guest.link {
        a.data("etc/hostname", format!("vm-{}\n", l.name.to_ascii_lowercase()), 0o644)?;
        let hosts: String = LINK_VMS.iter().map(|(n, ip)| format!("{ip} vm-{}\n", n.to_ascii_lowercase())).collect();
        a.data("etc/hosts", format!("127.0.0.1 localhost\n{hosts}"), 0o644)?;
        for (name, text) in LINK_HELPERS {
            let text = text.replace("NONCE", guest.nonce).replace("SIGNAL_PORT", &SIGNAL_PORT.to_string());
            a.data(&format!("usr/local/bin/{name}"), text, 0o755)?;
        }
        a.data("xtask/iproute2.sh", iproute2_functions()?, 0o644)?;
        a.data("xtask/cases.sh", crate::vm2::CASES_SCRIPT, 0o755)?;
    }
    a.data("init", init_script(guest, &names, &iproute2_functions()?), 0o755)?;
    a.data("xtask/cmd.sh", guest.script.clone(), 0o755)?;
    write(&a, &format!("initramfs-{}.cpio", guest.nonce)).map(Initrd)
}

/// A minimal initramfs (busybox only) that reports exit 0 at once: the KVM probe boots it.
pub fn pack_probe(nonce: &str) -> Result<Initrd> {
    let mut a = Archive::new();
    initramfs::usr_links(&mut a)?;
    for d in ["proc", "sys", "dev"] {
        a.dir(d, 0o755, 0, 0)?;
    }
    a.char_dev("dev/console", 0o600, 5, 1)?;
    initramfs::add_busybox(&mut a, &[])?;
    let m = marker_prefix(nonce);
    a.data("init", format!("#!/bin/sh\necho \"{m}start@@\"\necho \"{m}exit=0@@\"\npoweroff -f\nsleep 30\n"), 0o755)?;
    write(&a, &format!("probe-{nonce}.cpio")).map(Initrd)
}

fn write(a: &Archive, name: &str) -> Result<PathBuf> {
    let dir = util::xtask_dir().join("vm");
    util::create_dir_all(&dir)?;
    let path = dir.join(name);
    let file =
        std::fs::File::create(&path).map_err(|e| Error::new(format!("cannot create {}: {e}", path.display())))?;
    a.write_to(file)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_argument_is_a_command_line_several_are_argv() {
        let one = command_script(&["ibv_devices | grep -q rxe0 && exit 7".into()]);
        assert!(one.ends_with("\nibv_devices | grep -q rxe0 && exit 7\n"));
        let argv = command_script(&["sh".into(), "-c".into(), "echo 'a b' $X && exit 7".into()]);
        assert!(argv.ends_with("\nsh -c 'echo '\\''a b'\\'' $X && exit 7'\n"), "{argv}");
    }

    #[test]
    fn init_reports_start_and_exit() {
        let g = Guest {
            nonce: "n1",
            script: String::new(),
            env: &[("A".into(), "x y".into())],
            link: None,
            profiling: false,
            valgrind: false,
            device: Device::Rxe,
        };
        let s = init_script(&g, &["dummy".into()], "");
        assert!(s.contains("echo \"@@xtask-n1:start@@\""));
        assert!(s.contains("echo \"@@xtask-n1:exit=$?@@\""));
        assert!(s.contains("export A='x y'\n"));
        assert!(s.contains("for m in dummy; do"));
        // The single VM: rxe0 on the dummy d0, siw0 on the dummy s0, nothing of the link.
        assert!(s.contains("hostname rxe-vm\n"));
        assert!(s.contains("ip link add d0 type dummy") && s.contains("ip link add s0 type dummy"));
        assert!(
            s.contains("rdma link add rxe0 type rxe netdev d0") && s.contains("rdma link add siw0 type siw netdev s0")
        );
        assert!(s.contains("ip -6 addr add fe80::2:1/64 dev s0 nodad"));
        assert!(s.contains(
            "export RDMA_DEVICE=rxe RDMA_DEV=rxe0 RDMA_ADDR=198.18.0.1 RDMA_ADDR6=fd18:0::1 RDMA_LL6=fe80::1:1 RDMA_NETDEV=d0\n"
        ));
        assert!(!s.contains("PEER_ADDR") && !s.contains("httpd"));
        let siw = init_script(&Guest { device: Device::Siw, ..g }, &[], "");
        assert!(siw.contains(
            "export RDMA_DEVICE=siw RDMA_DEV=siw0 RDMA_ADDR=198.18.1.1 RDMA_ADDR6=fd18:1::1 RDMA_LL6=fe80::2:1 RDMA_NETDEV=s0\n"
        ));
    }

    #[test]
    fn a_linked_vm_uses_its_nic_and_serves_signals() {
        let link = Link { name: "B", addr: LINK_VMS[1].1, peer: LINK_VMS[0].1 };
        let g = Guest {
            nonce: "n2",
            script: String::new(),
            env: &[],
            link: Some(link),
            profiling: false,
            valgrind: false,
            device: Device::Siw,
        };
        let s = init_script(&g, &["virtio_net".into()], "");
        assert!(s.contains("export RXE_NETDEV=$nic VM_NAME=B LINK_PEER_ADDR=198.18.0.1\n"));
        assert!(s.contains("ip addr add 198.18.0.2/24 dev $nic"));
        assert!(s.contains("52:54:00:18:00:02) nic=") && s.contains("52:54:00:19:00:02) snic="));
        assert!(s.contains("ip link set dev $snic name s0"));
        assert!(s.contains("ip addr add 198.18.1.2/24 dev s0"));
        assert!(s.contains("rdma link add rxe0 type rxe netdev $nic"));
        assert!(s.contains("rdma link add siw0 type siw netdev s0"));
        // siw chosen: the variables name siw0 on s0, the peer's siw addresses.
        assert!(s.contains(
            "export RDMA_DEVICE=siw RDMA_DEV=siw0 RDMA_ADDR=198.18.1.2 RDMA_ADDR6=fd18:1::2 RDMA_LL6=fe80::2:2 RDMA_NETDEV=s0\n"
        ));
        assert!(s.contains("export PEER_ADDR=198.18.1.1 PEER_ADDR6=fd18:1::1 PEER_LL6=fe80::2:1\n"));
        assert!(s.contains("httpd -p 198.18.0.2:7999 -h /run/peer"));
        assert!(s.contains("hostname vm-b\n") && !s.contains("hostname rxe-vm"));
        assert!(!s.contains("type dummy"));
        assert!(link_command_script(&["tc qdisc show".into()]).starts_with(". /xtask/iproute2.sh\n"));
    }
}
