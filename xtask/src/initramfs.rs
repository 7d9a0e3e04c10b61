//! Packing the VM's root file system: an uncompressed cpio (newc) archive written by hand.
//!
//! Uncompressed because the kernel then only copies it (decompressing tens of MiB under software
//! emulation costs more than qemu loading the larger file).

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bail;
use crate::setup::Kernel;
use crate::util::{self, Context, Error, Result};

/// Where a regular file's bytes come from.
#[derive(Debug)]
enum Source {
    Host(PathBuf),
    Data(Vec<u8>),
}

#[derive(Debug)]
enum Entry {
    Dir { mode: u32, uid: u32, gid: u32 },
    File { src: Source, mode: u32 },
    Symlink(String),
    CharDev { mode: u32, major: u32, minor: u32 },
}

/// The contents of an initramfs, keyed by path (no leading `/`).
#[derive(Debug, Default)]
pub struct Archive {
    entries: BTreeMap<String, Entry>,
}

fn rel(path: &str) -> String {
    path.trim_start_matches('/').trim_end_matches('/').to_string()
}

impl Archive {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    /// True when `path` is already in the archive.
    pub fn contains(&self, path: &str) -> bool {
        self.entries.contains_key(&rel(path))
    }

    fn parents(&mut self, path: &str) -> Result<()> {
        let mut prefix = String::new();
        let comps: Vec<&str> = path.split('/').collect();
        for c in &comps[..comps.len().saturating_sub(1)] {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(c);
            match self.entries.get(&prefix) {
                None => {
                    self.entries.insert(prefix.clone(), Entry::Dir { mode: 0o755, uid: 0, gid: 0 });
                }
                Some(Entry::Dir { .. }) => {}
                Some(_) => {
                    bail!("initramfs: cannot put /{path} under /{prefix}, which is not a directory")
                }
            }
        }
        Ok(())
    }

    fn insert(&mut self, path: &str, entry: Entry) -> Result<()> {
        let path = rel(path);
        if path.is_empty() || path.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
            bail!("initramfs: bad path {path:?}");
        }
        self.parents(&path)?;
        self.entries.insert(path, entry);
        Ok(())
    }

    /// A directory with the given mode and owner.
    pub fn dir(&mut self, path: &str, mode: u32, uid: u32, gid: u32) -> Result<()> {
        self.insert(path, Entry::Dir { mode, uid, gid })
    }

    /// A file with these bytes.
    pub fn data(&mut self, path: &str, data: impl Into<Vec<u8>>, mode: u32) -> Result<()> {
        self.insert(path, Entry::File { src: Source::Data(data.into()), mode })
    }

    /// A copy of a host file (symlinks followed), keeping its permission bits.
    pub fn host_file(&mut self, path: &str, src: &Path) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(src).context(|| format!("initramfs: cannot read {}", src.display()))?;
        if !meta.is_file() {
            bail!("initramfs: {} is not a regular file", src.display());
        }
        self.insert(
            path,
            Entry::File { src: Source::Host(src.to_path_buf()), mode: meta.permissions().mode() & 0o7777 },
        )
    }

    /// A symbolic link.
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<()> {
        self.insert(path, Entry::Symlink(target.to_string()))
    }

    /// A character device node.
    pub fn char_dev(&mut self, path: &str, mode: u32, major: u32, minor: u32) -> Result<()> {
        self.insert(path, Entry::CharDev { mode, major, minor })
    }

    /// Writes the archive in cpio newc format; returns the number of bytes written.
    pub fn write_to(&self, out: impl Write) -> Result<u64> {
        let mut w = CpioWriter { out: BufWriter::with_capacity(1 << 20, out), pos: 0, ino: 1 };
        for (path, e) in &self.entries {
            let res = match e {
                Entry::Dir { mode, uid, gid } => w.entry(path, 0o040000 | mode, *uid, *gid, 2, (0, 0), &[]),
                Entry::Symlink(t) => w.entry(path, 0o120777, 0, 0, 1, (0, 0), t.as_bytes()),
                Entry::CharDev { mode, major, minor } => w.entry(path, 0o020000 | mode, 0, 0, 1, (*major, *minor), &[]),
                Entry::File { src: Source::Data(d), mode } => w.entry(path, 0o100000 | mode, 0, 0, 1, (0, 0), d),
                Entry::File { src: Source::Host(p), mode } => {
                    let d = std::fs::read(p).context(|| format!("initramfs: cannot read {}", p.display()))?;
                    w.entry(path, 0o100000 | mode, 0, 0, 1, (0, 0), &d)
                }
            };
            res.context(|| "initramfs: cannot write the archive")?;
        }
        w.entry("TRAILER!!!", 0, 0, 0, 1, (0, 0), &[]).context(|| "initramfs: cannot write the archive")?;
        w.out.flush().context(|| "initramfs: cannot write the archive")?;
        Ok(w.pos)
    }
}

struct CpioWriter<W: Write> {
    out: W,
    pos: u64,
    ino: u32,
}

impl<W: Write> CpioWriter<W> {
    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - (self.pos % 4) as usize) % 4;
        self.put(&[0u8; 3][..n])
    }

    #[allow(clippy::too_many_arguments)]
    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        uid: u32,
        gid: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> io::Result<()> {
        let size = u32::try_from(data.len()).map_err(|_| io::Error::other(format!("{name} is over 4 GiB")))?;
        let ino = self.ino;
        self.ino += 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}{dmaj:08x}{dmin:08x}{rmaj:08x}{rmin:08x}{namesize:08x}{check:08x}",
            mtime = 0,
            dmaj = 0,
            dmin = 0,
            rmaj = rdev.0,
            rmin = rdev.1,
            namesize = name.len() + 1,
            check = 0
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }
}

/// Where `host` goes in the archive: its directory with symlinks resolved (so nothing lands under
/// a merged-/usr link such as `/lib`), its own file name kept (so sonames still match).
pub fn guest_path(host: &Path) -> Result<String> {
    let (Some(dir), Some(name)) = (host.parent(), host.file_name()) else {
        bail!("initramfs: {} has no directory", host.display());
    };
    let dir = std::fs::canonicalize(dir).context(|| format!("initramfs: cannot resolve {}", dir.display()))?;
    Ok(rel(&dir.join(name).to_string_lossy()))
}

/// Copies the host's merged-/usr links (`/lib -> usr/lib` and friends) into the archive.
pub fn usr_links(a: &mut Archive) -> Result<()> {
    for top in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let p = Path::new("/").join(top);
        if let Ok(target) = std::fs::read_link(&p) {
            a.symlink(top, &target.to_string_lossy())?;
        }
    }
    Ok(())
}

/// The shared libraries `ldd` says `file` needs (the dynamic loader included).
pub fn ldd(file: &Path) -> Result<Vec<PathBuf>> {
    let mut cmd = Command::new("ldd");
    cmd.arg(file);
    let out = cmd.output().context(|| format!("cannot run `{}`", util::describe(&cmd)))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stdout.contains("not a dynamic executable")
        || stderr.contains("not a dynamic executable")
        || stdout.contains("statically linked")
    {
        return Ok(Vec::new());
    }
    if !out.status.success() {
        bail!("`{}` failed: {}", util::describe(&cmd), stderr.trim());
    }
    let mut libs = Vec::new();
    for line in stdout.lines().map(str::trim) {
        if line.contains("=> not found") {
            bail!("{} needs {}, which is not installed (run `cargo xtask setup`)", file.display(), line);
        }
        let path = match line.split_once("=>") {
            Some((_, rhs)) => rhs.trim(),
            None => line,
        };
        let path = path.split(" (").next().unwrap_or("").trim();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// Adds `host` at `guest` (default: [`guest_path`]) and every library it needs.
pub fn add_with_libs(a: &mut Archive, host: &Path, guest: Option<&str>) -> Result<()> {
    let guest = match guest {
        Some(g) => g.to_string(),
        None => guest_path(host)?,
    };
    a.host_file(&guest, host)?;
    for lib in ldd(host)? {
        let g = guest_path(&lib)?;
        if !a.contains(&g) {
            a.host_file(&g, &lib)?;
        }
    }
    Ok(())
}

/// Busybox and a link for each of its applets, except names some real program already has.
pub fn add_busybox(a: &mut Archive, taken: &[&str]) -> Result<()> {
    let host = util::which("busybox")
        .ok_or_else(|| Error::new("busybox not found: run `cargo xtask setup` (package busybox-static)"))?;
    add_with_libs(a, &host, None)?;
    let guest = guest_path(&host)?;
    let dir = guest.rsplit_once('/').map(|(d, _)| d.to_string()).unwrap_or_default();
    let list = util::output(Command::new(&host).arg("--list"))?;
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty() && *l != "busybox") {
        let path = format!("{dir}/{applet}");
        if taken.contains(&applet) || a.contains(&path) {
            continue;
        }
        a.symlink(&path, "busybox")?;
    }
    Ok(())
}

/// A kernel module file, its dependencies in modules.dep order.
struct ModInfo {
    path: String,
    deps: Vec<String>,
}

fn mod_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// Copies the modules `wanted` (and what they depend on, from modules.dep) into `dir` of the
/// archive, decompressed; returns their file names in load order. Built-in modules are skipped;
/// a missing module is an error unless it is in `optional`.
pub fn add_modules(
    a: &mut Archive,
    kernel: &Kernel,
    wanted: &[&str],
    optional: &[&str],
    dir: &str,
) -> Result<Vec<String>> {
    let dep_file = kernel.modules.join("modules.dep");
    let deps = std::fs::read_to_string(&dep_file).context(|| format!("cannot read {}", dep_file.display()))?;
    let builtin = std::fs::read_to_string(kernel.modules.join("modules.builtin")).unwrap_or_default();
    let builtin: Vec<String> = builtin.lines().map(mod_name).collect();
    let mut index: HashMap<String, ModInfo> = HashMap::new();
    for line in deps.lines() {
        let Some((m, d)) = line.split_once(':') else {
            continue;
        };
        index.insert(mod_name(m), ModInfo { path: m.to_string(), deps: d.split_whitespace().map(mod_name).collect() });
    }
    fn visit(name: &str, index: &HashMap<String, ModInfo>, order: &mut Vec<String>, depth: usize) -> Result<()> {
        if order.iter().any(|o| o == name) {
            return Ok(());
        }
        let info = index.get(name).ok_or_else(|| Error::new(format!("kernel module {name} is not in modules.dep")))?;
        if depth > 64 {
            bail!("kernel module dependencies loop at {name}");
        }
        for d in &info.deps {
            visit(d, index, order, depth + 1)?;
        }
        order.push(name.to_string());
        Ok(())
    }
    let mut order = Vec::new();
    for w in wanted {
        let name = w.replace('-', "_");
        if builtin.contains(&name) {
            continue;
        }
        if !index.contains_key(&name) && optional.contains(w) {
            continue;
        }
        visit(&name, &index, &mut order, 0)
            .map_err(|e| Error::new(format!("{e} (kernel {}: {})", kernel.release, kernel.modules.display())))?;
    }
    let mut files = Vec::new();
    for name in &order {
        let src = kernel.modules.join(&index[name].path);
        let data = read_module(&src)?;
        let file = format!("{name}.ko");
        a.data(&format!("{dir}/{file}"), data, 0o644)?;
        files.push(file);
    }
    Ok(files)
}

/// A module's bytes, decompressed with the matching host tool when it is `.ko.xz`/`.zst`/`.gz`.
fn read_module(src: &Path) -> Result<Vec<u8>> {
    let s = src.to_string_lossy();
    let tool = if s.ends_with(".xz") {
        Some(("xz", "xz-utils"))
    } else if s.ends_with(".zst") {
        Some(("zstd", "zstd"))
    } else if s.ends_with(".gz") {
        Some(("gzip", "gzip"))
    } else {
        None
    };
    match tool {
        None => std::fs::read(src).context(|| format!("cannot read {}", src.display())),
        Some((prog, pkg)) => {
            let mut cmd = Command::new(prog);
            cmd.arg("-dc").arg(src);
            let out = cmd
                .output()
                .context(|| format!("cannot run `{}` to decompress a module (install {pkg})", util::describe(&cmd)))?;
            if !out.status.success() {
                bail!("`{}` failed: {}", util::describe(&cmd), String::from_utf8_lossy(&out.stderr).trim());
            }
            Ok(out.stdout)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(hdr: &[u8]) -> Vec<u32> {
        (0..13)
            .map(|i| u32::from_str_radix(std::str::from_utf8(&hdr[6 + i * 8..14 + i * 8]).unwrap(), 16).unwrap())
            .collect()
    }

    #[test]
    fn writes_newc_with_parents_first_and_padding() {
        let mut a = Archive::new();
        a.data("/etc/x/hello", b"hi!".to_vec(), 0o644).unwrap();
        a.symlink("lib", "usr/lib").unwrap();
        a.char_dev("dev/console", 0o600, 5, 1).unwrap();
        let mut out = Vec::new();
        let n = a.write_to(&mut out).unwrap();
        assert_eq!(n as usize, out.len());
        assert_eq!(out.len() % 4, 0);
        // Walk the archive back.
        let mut pos = 0;
        let mut names = Vec::new();
        loop {
            assert_eq!(&out[pos..pos + 6], b"070701");
            let f = fields(&out[pos..pos + 110]);
            let namesize = f[11] as usize;
            let name = std::str::from_utf8(&out[pos + 110..pos + 110 + namesize - 1]).unwrap().to_string();
            pos = (pos + 110 + namesize).div_ceil(4) * 4;
            let data = &out[pos..pos + f[6] as usize];
            pos = (pos + f[6] as usize).div_ceil(4) * 4;
            match name.as_str() {
                "etc/x/hello" => assert_eq!((data, f[1]), (&b"hi!"[..], 0o100644)),
                "lib" => assert_eq!((data, f[1]), (&b"usr/lib"[..], 0o120777)),
                "dev/console" => assert_eq!((f[1], f[9], f[10]), (0o020600, 5, 1)),
                "etc" | "etc/x" | "dev" => assert_eq!(f[1], 0o040755),
                "TRAILER!!!" => {}
                other => panic!("unexpected {other}"),
            }
            names.push(name);
            if names.last().unwrap() == "TRAILER!!!" {
                break;
            }
        }
        assert_eq!(pos, out.len());
        assert_eq!(names, ["dev", "dev/console", "etc", "etc/x", "etc/x/hello", "lib", "TRAILER!!!"]);
    }

    #[test]
    fn rejects_files_under_links_and_bad_paths() {
        let mut a = Archive::new();
        a.symlink("lib", "usr/lib").unwrap();
        assert!(a.data("lib/x.so", Vec::new(), 0o644).is_err());
        assert!(a.data("a/../b", Vec::new(), 0o644).is_err());
        assert!(a.data("/", Vec::new(), 0o644).is_err());
    }

    #[test]
    fn module_names() {
        assert_eq!(mod_name("kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz"), "rdma_rxe");
        assert_eq!(mod_name("kernel/crypto/crc32-generic.ko"), "crc32_generic");
    }
}
