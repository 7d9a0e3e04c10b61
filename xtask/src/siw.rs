//! Soft-iWARP for the guest: `siw.ko`, built out of tree for the guest's exact kernel.
//!
//! Debian builds its kernels without `CONFIG_RDMA_SIW`, but the driver's source is in the
//! `linux-source-X.Y` package and the kernel's build tree in `linux-headers-RELEASE`. This
//! module installs the headers (they live under `/usr/src`, so an install, as root), downloads
//! the source package with `apt-get download` (the version of the guest's kernel image when
//! the archive still has it), unpacks only `drivers/infiniband/sw/siw`, builds it against the
//! headers (kbuild's `M=`; the modversions come from the headers' `Module.symvers`, so it
//! loads into the packaged kernel) and caches the stripped `siw.ko` next to the kernel, in
//! `target/xtask/kernel/PACKAGE/siw/siw.ko`. A second run finds it there and does nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bail;
use crate::setup::Kernel;
use crate::util::{self, Context, Error, Result};

/// Where the built module is cached for `kernel`.
pub fn module_path(kernel: &Kernel) -> PathBuf {
    kernel_dir(kernel).join("siw").join("siw.ko")
}

fn kernel_dir(kernel: &Kernel) -> PathBuf {
    // `modules` is `.../PACKAGE/root/lib/modules/RELEASE`.
    kernel.modules.ancestors().nth(4).map(Path::to_path_buf).unwrap_or_else(|| kernel.modules.clone())
}

/// `linux-source-6.1` for the release `6.1.0-56-amd64`.
fn source_package(release: &str) -> Result<String> {
    let mut parts = release.split(['.', '-']);
    match (parts.next(), parts.next()) {
        (Some(a), Some(b)) if a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok() => {
            Ok(format!("linux-source-{a}.{b}"))
        }
        _ => bail!("cannot tell the kernel's major.minor from the release {release:?}"),
    }
}

/// The Debian version of an installed or available package (`apt-cache policy`'s candidate).
fn candidate_version(package: &str) -> Option<String> {
    let out = Command::new("apt-cache").args(["policy", package]).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix("Candidate:").map(|v| v.trim().to_string()))
        .filter(|v| v != "(none)")
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

/// Builds `siw.ko` for `kernel` unless it is cached; returns its path and, when it was built,
/// a line for setup's report.
pub fn ensure(kernel: &Kernel) -> Result<(PathBuf, Option<String>)> {
    let out = module_path(kernel);
    if out.is_file() {
        return Ok((out, None));
    }
    let release = &kernel.release;
    let headers = format!("linux-headers-{release}");
    let build_dir = PathBuf::from(format!("/usr/src/{headers}"));
    if !build_dir.join("Makefile").is_file() {
        if !installed(&headers) {
            if util::which("apt-get").is_none() || !util::is_root() {
                bail!(
                    "building siw.ko (Soft-iWARP) for the guest needs {headers}: install it as root \
                     (sudo apt-get install -y --no-install-recommends {headers}) or run `cargo xtask setup` as root"
                );
            }
            eprintln!("xtask: setup: installing {headers} (to build siw.ko for the guest)");
            let install = || {
                util::run(
                    Command::new("apt-get")
                        .args(["install", "-y", "-q", "--no-install-recommends", &headers])
                        .env("DEBIAN_FRONTEND", "noninteractive"),
                )
            };
            if install().is_err() {
                // Stale package lists may not name it yet: update once, then retry.
                util::run(Command::new("apt-get").args(["update", "-q"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
                install()?;
            }
        }
        if !build_dir.join("Makefile").is_file() {
            bail!("{headers} is installed but {} has no Makefile", build_dir.display());
        }
    }
    let source = source_package(release)?;
    let work = kernel_dir(kernel).join("siw-build");
    let _ = std::fs::remove_dir_all(&work);
    util::create_dir_all(&work)?;
    // The source of the same Debian version as the kernel image, when the archive has it.
    let image_version = candidate_version(&kernel.package);
    let wanted = match &image_version {
        Some(v) if candidate_version(&source).as_deref() == Some(v.as_str()) => format!("{source}={v}"),
        Some(v) => {
            eprintln!("xtask: setup: {source} {v} is not the candidate; taking the candidate");
            source.clone()
        }
        None => source.clone(),
    };
    eprintln!("xtask: setup: downloading {wanted} (apt-get download; only drivers/infiniband/sw/siw is unpacked)");
    let download = || util::output(Command::new("apt-get").args(["download", "-q", &wanted]).current_dir(&work));
    if let Err(first) = download() {
        // Stale package lists may not name it: update once (as root), then retry.
        if !util::is_root() {
            return Err(first);
        }
        util::run(Command::new("apt-get").args(["update", "-q"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
        download()?;
    }
    let deb = std::fs::read_dir(&work)
        .context(|| format!("cannot list {}", work.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| Error::new(format!("apt-get download {wanted} left no .deb in {}", work.display())))?;
    // The .deb holds usr/src/linux-source-X.Y.tar.xz; take that, then the driver's directory.
    let tarball = format!("usr/src/{source}.tar.xz");
    let script = format!(
        "set -e; dpkg-deb --fsys-tarfile {deb} | tar -x ./{tarball} 2>/dev/null || dpkg-deb --fsys-tarfile {deb} | tar -x {tarball}; \
         tar -xJf {tarball} --wildcards '{source}/drivers/infiniband/sw/siw/*'",
        deb = util::shell_quote(&deb.to_string_lossy()),
    );
    util::run(Command::new("sh").arg("-c").arg(&script).current_dir(&work))?;
    let src = work.join(&source).join("drivers/infiniband/sw/siw");
    if !src.join("siw_main.c").is_file() {
        bail!("{wanted} has no drivers/infiniband/sw/siw/siw_main.c");
    }
    eprintln!("xtask: setup: building siw.ko against {}", build_dir.display());
    util::output(
        Command::new("make")
            .arg("-C")
            .arg(&build_dir)
            .arg(format!("M={}", src.display()))
            .args(["CONFIG_RDMA_SIW=m", "modules"])
            .arg(format!("-j{}", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))),
    )?;
    let built = src.join("siw.ko");
    if !built.is_file() {
        bail!("make built no {}", built.display());
    }
    util::create_dir_all(out.parent().unwrap_or(Path::new(".")))?;
    let tmp = out.with_extension("ko.tmp");
    util::run(Command::new("strip").arg("--strip-debug").arg("-o").arg(&tmp).arg(&built))?;
    std::fs::rename(&tmp, &out).context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    let version = image_version.unwrap_or_else(|| "?".into());
    Ok((out.clone(), Some(format!("built siw.ko for {release} ({source} {version}) into {}", out.display()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_package_names_major_minor() {
        assert_eq!(source_package("6.1.0-56-amd64").unwrap(), "linux-source-6.1");
        assert_eq!(source_package("6.12.9-amd64").unwrap(), "linux-source-6.12");
        assert!(source_package("amd64").is_err());
    }
}
