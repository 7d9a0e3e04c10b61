//! Errors, process helpers and the workspace's well-known paths.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

/// An xtask failure: a message that already says what was being done and why it failed.
#[derive(Debug)]
pub struct Error(String);

impl Error {
    /// An error with this message.
    pub fn new(msg: impl Into<String>) -> Self {
        Error(msg.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// The result type of every fallible xtask function.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with an [`Error`] built from a format string.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::util::Error::new(format!($($arg)*)))
    };
}

/// Adds context (what was being done) to an I/O error.
pub trait Context<T> {
    /// Turns the error into an [`Error`] whose message starts with `what()`.
    fn context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T> Context<T> for io::Result<T> {
    fn context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| Error::new(format!("{}: {e}", what().into())))
    }
}

/// A human-readable rendering of a command line, for messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&shell_quote(&arg.to_string_lossy()));
    }
    s
}

/// Quotes `s` for a POSIX shell, leaving obviously safe words as they are.
pub fn shell_quote(s: &str) -> String {
    let safe = !s.is_empty()
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/' | b':' | b'=' | b'+' | b',' | b'@')
        });
    if safe {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn status_text(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exit status {code}"),
        None => format!("{status}"),
    }
}

fn spawn_error(cmd: &Command, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::NotFound {
        Error::new(format!(
            "cannot run `{}`: {} not found (run `cargo xtask setup`, or install it)",
            describe(cmd),
            cmd.get_program().to_string_lossy()
        ))
    } else {
        Error::new(format!("cannot run `{}`: {e}", describe(cmd)))
    }
}

/// Runs `cmd` with inherited stdio; fails unless it exits 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().map_err(|e| spawn_error(cmd, e))?;
    if !status.success() {
        bail!("`{}` failed: {}", describe(cmd), status_text(status));
    }
    Ok(())
}

/// Runs `cmd`, capturing stdout (returned) and stderr (quoted in the error if it fails).
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| spawn_error(cmd, e))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        bail!(
            "`{}` failed: {}{}",
            describe(cmd),
            status_text(out.status),
            if stderr.trim().is_empty() { String::new() } else { format!("; its stderr:\n{}", stderr.trim_end()) }
        );
    }
    String::from_utf8(out.stdout)
        .map_err(|_| Error::new(format!("`{}` printed something that is not UTF-8", describe(cmd))))
}

/// Finds `name` on `PATH`, and in the sbin directories a non-root `PATH` often lacks.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

/// True when `p` is a regular file (after symlinks) with an execute bit.
pub fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// True when this process runs as root (read from /proc, std has no getuid).
pub fn is_root() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

/// The workspace root (the directory holding the root Cargo.toml): from `CARGO_MANIFEST_DIR`
/// as `cargo run` sets it, else as it was when xtask was built.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .filter(|d| d.join("Cargo.toml").is_file())
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir.parent().map_or(manifest_dir.clone(), Path::to_path_buf)
}

/// Cargo's target directory (honours `CARGO_TARGET_DIR`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// Where xtask keeps its caches and generated files: `target/xtask`.
pub fn xtask_dir() -> PathBuf {
    target_dir().join("xtask")
}

/// The cargo that runs us (or `cargo` from `PATH`).
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Creates `dir` and its parents, with context.
pub fn create_dir_all(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).context(|| format!("cannot create directory {}", dir.display()))
}

/// Writes `data` to `path` atomically enough for a cache (temp file, then rename).
pub fn write_file(path: &Path, data: impl AsRef<[u8]>) -> Result<()> {
    if let Some(parent) = path.parent() {
        create_dir_all(parent)?;
    }
    let tmp = path.with_extension("tmp-xtask");
    std::fs::write(&tmp, data).context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc-1.2/x"), "abc-1.2/x");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("$X && exit 7"), "'$X && exit 7'");
    }

    #[test]
    fn describe_quotes_args() {
        let mut c = Command::new("sh");
        c.args(["-c", "exit 7"]);
        assert_eq!(describe(&c), "sh -c 'exit 7'");
    }
}
