//! `cargo xtask setup`: the Debian packages the test bed needs, and the cached guest kernel.
//!
//! Idempotent: packages are checked with `dpkg-query` and apt is only called when something is
//! missing; the kernel (the package `linux-image-amd64` depends on) is downloaded once with
//! `apt-get download`, unpacked with `dpkg-deb -x` under `target/xtask/kernel/` and indexed with
//! `depmod -b`. The Soft-iWARP module the Debian kernel lacks is built for it once (see
//! [`crate::siw`]).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bail;
use crate::util::{self, Context, Error, Result};

/// The Debian packages the test bed uses on the host (and copies into the VM).
pub const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "kmod",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "libibverbs-dev",
    "librdmacm-dev",
    "rdmacm-utils",
    "perftest",
    "libclang-dev",
    "clang",
    "pkg-config",
    "iproute2",
    "xz-utils",
    // `cargo xtask vm --perf`: perf for the guest's kernel (bookworm's linux-perf is 6.1, the
    // guest's), strace for counting system calls.
    "linux-perf",
    "strace",
    // `cargo xtask bench --instructions`: cachegrind and callgrind in the guest, and
    // callgrind_annotate on the host.
    "valgrind",
];

/// The meta-package whose dependency names the current kernel image package.
const KERNEL_META: &str = "linux-image-amd64";

/// A guest kernel unpacked under `target/xtask/kernel/`.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// The Debian package it came from, e.g. `linux-image-6.1.0-56-amd64`.
    pub package: String,
    /// The kernel release, e.g. `6.1.0-56-amd64`.
    pub release: String,
    /// What qemu boots: the uncompressed ELF `vmlinux` (PVH entry) taken out of `vmlinuz-*` when
    /// the kernel supports that, which saves seconds of decompression under emulation; else
    /// `vmlinuz`.
    pub image: PathBuf,
    /// `lib/modules/RELEASE` of the unpacked tree (with a `modules.dep`).
    pub modules: PathBuf,
}

/// What a setup run found or did, for its report.
struct Apt {
    updated: bool,
    actions: Vec<String>,
}

impl Apt {
    fn update(&mut self) -> Result<()> {
        if self.updated {
            return Ok(());
        }
        require_apt_root("apt-get update")?;
        eprintln!("xtask: setup: apt-get update");
        util::run(Command::new("apt-get").args(["update", "-q"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
        self.updated = true;
        self.actions.push("updated the apt package lists".into());
        Ok(())
    }
}

fn require_apt_root(what: &str) -> Result<()> {
    if util::which("apt-get").is_none() {
        bail!(
            "{what} needs apt-get, and this host has none.\n\
             The test bed needs Debian/Ubuntu packages; install their equivalents by hand: {}\n\
             and a kernel image with the rdma_rxe module",
            PACKAGES.join(" ")
        );
    }
    if !util::is_root() {
        bail!(
            "{what} needs root. Run `cargo xtask setup` as root, or install the packages yourself:\n  \
             sudo apt-get install -y --no-install-recommends {}",
            PACKAGES.join(" ")
        );
    }
    Ok(())
}

/// The packages of [`PACKAGES`] that are not installed (all of them if dpkg-query is missing).
pub fn missing_packages() -> Result<Vec<&'static str>> {
    if util::which("dpkg-query").is_none() {
        return Ok(PACKAGES.to_vec());
    }
    // dpkg-query exits 1 when some package is unknown; its stdout still lists the known ones.
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${db:Status-Abbrev}\\n"])
        .args(PACKAGES)
        .output()
        .context(|| "cannot run dpkg-query")?;
    let listed = String::from_utf8_lossy(&out.stdout);
    let installed: Vec<&str> = listed
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let name = it.next()?;
            let status = it.next()?;
            status.starts_with("ii").then_some(name)
        })
        .collect();
    // Multi-arch packages may be listed as name:arch.
    Ok(PACKAGES
        .iter()
        .copied()
        .filter(|p| !installed.iter().any(|i| i == p || i.split(':').next() == Some(p)))
        .collect())
}

fn kernel_root() -> PathBuf {
    util::xtask_dir().join("kernel")
}

/// Where a workspace path is, relative to the workspace root when it is inside it.
pub fn show(p: &Path) -> String {
    let root = util::workspace_root();
    p.strip_prefix(&root).unwrap_or(p).display().to_string()
}

/// The cached kernel, if a complete one is there.
pub fn cached_kernel() -> Option<Kernel> {
    let package = std::fs::read_to_string(kernel_root().join("current")).ok()?;
    let package = package.trim();
    let dir = kernel_root().join(package);
    if !dir.join(".complete").exists() {
        return None;
    }
    kernel_in(package, &dir.join("root")).ok()
}

fn kernel_in(package: &str, root: &Path) -> Result<Kernel> {
    let release = package
        .strip_prefix("linux-image-")
        .ok_or_else(|| Error::new(format!("unexpected kernel package name {package}")))?
        .to_string();
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
    let modules = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| root.join(d).join(&release))
        .find(|d| d.is_dir())
        .ok_or_else(|| Error::new(format!("{package} has no lib/modules/{release} in {}", root.display())))?;
    if !vmlinuz.is_file() {
        bail!("{package} has no boot/vmlinuz-{release} in {}", root.display());
    }
    let vmlinux = root.join("boot").join(format!("vmlinux-{release}"));
    let no_vmlinux = root.join("boot").join(".no-vmlinux");
    if !vmlinux.is_file() && !no_vmlinux.exists() {
        if let Err(e) = extract_vmlinux(root, &release, &vmlinuz, &vmlinux) {
            eprintln!("xtask: setup: booting the compressed kernel (slower): {e}");
            let _ = std::fs::write(&no_vmlinux, format!("{e}\n"));
        }
    }
    let image = if vmlinux.is_file() { vmlinux } else { vmlinuz };
    Ok(Kernel { package: package.to_string(), release, image, modules })
}

/// Takes the ELF `vmlinux` out of a bzImage whose payload is xz-compressed, for a kernel built
/// with `CONFIG_PVH=y` (qemu boots such an ELF directly through its PVH entry point).
fn extract_vmlinux(root: &Path, release: &str, vmlinuz: &Path, out: &Path) -> Result<()> {
    use std::io::Write;
    use std::process::Stdio;
    let config = std::fs::read_to_string(root.join("boot").join(format!("config-{release}"))).unwrap_or_default();
    if !config.lines().any(|l| l == "CONFIG_PVH=y") {
        bail!("the kernel has no PVH entry point (CONFIG_PVH)");
    }
    let image = std::fs::read(vmlinuz).context(|| format!("cannot read {}", vmlinuz.display()))?;
    const XZ_MAGIC: &[u8] = b"\xfd7zXZ\0";
    let start = image
        .windows(XZ_MAGIC.len())
        .position(|w| w == XZ_MAGIC)
        .ok_or_else(|| Error::new(format!("{} has no xz payload", vmlinuz.display())))?;
    let tmp = out.with_extension("tmp-xtask");
    let file = std::fs::File::create(&tmp).context(|| format!("cannot create {}", tmp.display()))?;
    let mut child = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(file)
        .stderr(Stdio::null())
        .spawn()
        .context(|| "cannot run xz (install xz-utils)")?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let payload = image[start..].to_vec();
    let writer = std::thread::spawn(move || {
        // xz stops reading after the stream's end: a broken pipe here is expected.
        let _ = stdin.write_all(&payload);
    });
    let status = child.wait().context(|| "waiting for xz")?;
    let _ = writer.join();
    let head = std::fs::read(&tmp).map(|d| d.get(..4) == Some(b"\x7fELF")).unwrap_or(false);
    if !status.success() || !head {
        let _ = std::fs::remove_file(&tmp);
        bail!("xz could not unpack an ELF vmlinux from {}", vmlinuz.display());
    }
    std::fs::rename(&tmp, out).context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))
}

/// The kernel image package `linux-image-amd64` depends on today.
fn resolve_kernel_package(apt: &mut Apt) -> Result<String> {
    let lookup = || -> Option<String> {
        let out = Command::new("apt-cache").args(["depends", KERNEL_META]).output().ok()?;
        String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
            let dep = l.trim().strip_prefix("Depends:")?.trim();
            dep.starts_with("linux-image-").then(|| dep.trim_matches(|c| c == '<' || c == '>').to_string())
        })
    };
    if util::which("apt-cache").is_none() {
        require_apt_root("downloading the guest kernel")?;
    }
    if let Some(p) = lookup() {
        return Ok(p);
    }
    // No package lists yet (a fresh machine): update once and ask again.
    apt.update()?;
    lookup().ok_or_else(|| {
        Error::new(format!(
            "`apt-cache depends {KERNEL_META}` names no linux-image package; \
             is this a Debian amd64 host with the main archive in its sources?"
        ))
    })
}

fn download_kernel(apt: &mut Apt) -> Result<Kernel> {
    let package = resolve_kernel_package(apt)?;
    let dir = kernel_root().join(&package);
    let download = kernel_root().join("download");
    let _ = std::fs::remove_dir_all(&download);
    util::create_dir_all(&download)?;
    eprintln!("xtask: setup: downloading {package} (apt-get download)");
    let fetch =
        |apt_dl: &Path| util::output(Command::new("apt-get").args(["download", "-q", &package]).current_dir(apt_dl));
    if let Err(first) = fetch(&download) {
        // Stale lists can name a package the mirror no longer has: update once, then retry.
        if apt.updated || !util::is_root() {
            return Err(first);
        }
        apt.update()?;
        fetch(&download)?;
    }
    let deb = std::fs::read_dir(&download)
        .context(|| format!("cannot list {}", download.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| Error::new(format!("apt-get download {package} left no .deb in {}", download.display())))?;
    let _ = std::fs::remove_dir_all(&dir);
    let root = dir.join("root");
    util::create_dir_all(&root)?;
    eprintln!("xtask: setup: unpacking {} (dpkg-deb -x)", deb.file_name().unwrap_or_default().to_string_lossy());
    util::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    let kernel = kernel_in(&package, &root)?;
    // The package ships no modules.dep (its postinst makes one): index the unpacked tree.
    util::output(Command::new("depmod").arg("-b").arg(&root).arg(&kernel.release).env("PATH", sbin_path()))?;
    if !kernel.modules.join("modules.dep").is_file() {
        bail!("depmod -b {} {} made no modules.dep", root.display(), kernel.release);
    }
    util::write_file(&dir.join(".complete"), "")?;
    util::write_file(&kernel_root().join("current"), format!("{package}\n"))?;
    let _ = std::fs::remove_dir_all(&download);
    apt.actions.push(format!("downloaded and unpacked {package} into {}", show(&dir)));
    Ok(kernel)
}

/// `PATH` with the sbin directories, where depmod lives.
fn sbin_path() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    format!("{path}:/usr/local/sbin:/usr/sbin:/sbin")
}

/// Makes sure packages and kernel are there; `report` prints a summary even when nothing was done.
pub fn ensure(report: bool) -> Result<Kernel> {
    if std::env::consts::ARCH != "x86_64" || std::env::consts::OS != "linux" {
        bail!("the test bed runs on x86_64 Linux only (this is {} {})", std::env::consts::ARCH, std::env::consts::OS);
    }
    let mut apt = Apt { updated: false, actions: Vec::new() };
    let missing = missing_packages()?;
    if !missing.is_empty() {
        if util::which("apt-get").is_none() || !util::is_root() {
            bail!(
                "missing packages: {}\n{}",
                missing.join(" "),
                if util::which("apt-get").is_none() {
                    "this host has no apt-get: install their equivalents by hand".to_string()
                } else {
                    format!(
                        "install them as root: sudo apt-get install -y --no-install-recommends {}\n\
                         (or run `cargo xtask setup` as root)",
                        missing.join(" ")
                    )
                }
            );
        }
        apt.update()?;
        eprintln!("xtask: setup: installing {}", missing.join(" "));
        util::run(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(&missing)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
        let still = missing_packages()?;
        if !still.is_empty() {
            bail!("apt-get install ran but these packages are still not installed: {}", still.join(" "));
        }
        apt.actions.push(format!("installed {}", missing.join(" ")));
    }
    let kernel = match cached_kernel() {
        Some(k) => k,
        None => download_kernel(&mut apt)?,
    };
    let (siw, built) = crate::siw::ensure(&kernel)?;
    if let Some(line) = built {
        apt.actions.push(line);
    } else if report {
        eprintln!("xtask: setup: siw.ko is cached in {}", show(&siw));
    }
    if report || !apt.actions.is_empty() {
        for a in &apt.actions {
            eprintln!("xtask: setup: {a}");
        }
        if missing.is_empty() {
            eprintln!("xtask: setup: all {} packages were already installed", PACKAGES.len());
        }
        if !apt.actions.iter().any(|a| a.starts_with("downloaded")) {
            eprintln!(
                "xtask: setup: kernel {} is cached in {}",
                kernel.package,
                show(&kernel_root().join(&kernel.package))
            );
        }
    }
    Ok(kernel)
}
