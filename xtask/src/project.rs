//! Building the project's binaries (profile `vm`) and learning where cargo put them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::bail;
use crate::json::{self, Value};
use crate::util::{self, Context, Result};

/// The cargo profile the VM binaries are built with (release + debug assertions).
pub const PROFILE: &str = "vm";

/// One executable of the root crate, under the name it gets in the VM's `$BIN`.
#[derive(Debug, Clone, PartialEq)]
pub struct Binary {
    /// The target name: `echo` for `examples/echo.rs`, `testbed` for `tests/testbed.rs`.
    pub name: String,
    /// Where cargo put it (for tests the file name carries a hash).
    pub path: PathBuf,
}

/// The root crate's examples and integration-test executables.
#[derive(Debug, Clone, Default)]
pub struct Binaries {
    /// `examples/*.rs`.
    pub examples: Vec<Binary>,
    /// `tests/*.rs` (not the library's unit-test executable).
    pub tests: Vec<Binary>,
    /// The library's unit-test executable, as `rdma_reactor-lib`: its `#[ignore]`d tests need
    /// an RDMA device (the pure ones run on the host).
    pub lib_tests: Option<Binary>,
    /// `benches/*.rs`: packed into `$BIN` so they can run in the VM (`"$BIN"/latency --bench`),
    /// never run by `cargo xtask test`.
    pub benches: Vec<Binary>,
}

impl Binaries {
    /// Examples, tests and benches together.
    pub fn all(&self) -> impl Iterator<Item = &Binary> {
        self.examples.iter().chain(&self.tests).chain(&self.lib_tests).chain(&self.benches)
    }

    /// The test executables to run with an RDMA device, with the libtest filter for each: the
    /// library's own tests `--ignored` (only those that need the device), the integration
    /// tests `--include-ignored`.
    ///
    /// `tests/two_vm.rs` ([`TWO_VM_TESTS`]) is left out: its tests need two linked VMs.
    pub fn rdma_tests(&self) -> Vec<(&Binary, &'static str)> {
        let lib = self.lib_tests.iter().map(|b| (b, "--ignored"));
        let tests = self.tests.iter().filter(|b| b.name != TWO_VM_TESTS);
        lib.chain(tests.map(|b| (b, "--include-ignored"))).collect()
    }
}

/// The integration-test binary whose tests run in two linked VMs (`cargo xtask vm2 --cases`),
/// not in the single VM.
pub const TWO_VM_TESTS: &str = "two_vm";

/// Which artifacts of which package a cargo JSON stream is searched for.
fn artifacts(stdout: &str, manifest: &Path, kind: &str) -> Result<Vec<Binary>> {
    let mut found: Vec<Binary> = Vec::new();
    for line in stdout.lines().filter(|l| l.starts_with('{')) {
        let msg =
            json::parse(line).map_err(|e| util::Error::new(format!("cannot read cargo's JSON output: {e}\n{line}")))?;
        if msg.get("reason").and_then(Value::as_str) != Some("compiler-artifact") {
            continue;
        }
        if msg.get("manifest_path").and_then(Value::as_str).map(Path::new) != Some(manifest) {
            continue;
        }
        let Some(target) = msg.get("target") else {
            continue;
        };
        let kinds = target.get("kind").and_then(Value::as_array).unwrap_or_default();
        if !kinds.iter().any(|k| k.as_str() == Some(kind)) {
            continue;
        }
        let (Some(name), Some(exe)) =
            (target.get("name").and_then(Value::as_str), msg.get("executable").and_then(Value::as_str))
        else {
            continue;
        };
        if !found.iter().any(|b| b.name == name) {
            found.push(Binary { name: name.to_string(), path: PathBuf::from(exe) });
        }
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(found)
}

fn cargo_json(args: &[&str]) -> Result<String> {
    // The fault suite's injections (`Reactor::inject_short_cq`), the tokio driver (its
    // example and tests) and the log lines (`RUST_LOG` in the examples); one build for
    // everything.
    cargo_json_as(args, PROFILE, &["--features", "fault-injection,tokio,log"])
}

/// The profile of the binaries that are measured (`cargo xtask bench`, `vm --perf`): release,
/// with line tables for perf.
pub const PERF_PROFILE: &str = "perf";

fn cargo_json_as(args: &[&str], profile: &str, extra: &[&str]) -> Result<String> {
    let mut cmd = util::cargo();
    cmd.args(args)
        .args(["--profile", profile, "--package", "rdma-reactor", "--message-format=json-render-diagnostics"])
        .args(extra)
        .current_dir(util::workspace_root())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .stdout(Stdio::piped());
    let out = cmd.output().context(|| format!("cannot run `{}`", util::describe(&cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed ({}); see the compiler output above", util::describe(&cmd), out.status);
    }
    String::from_utf8(out.stdout).map_err(|_| util::Error::new(format!("`{}` printed non-UTF-8", util::describe(&cmd))))
}

/// Builds the examples and the integration tests with profile `vm`; returns their executables.
pub fn build() -> Result<Binaries> {
    let manifest = util::workspace_root().join("Cargo.toml");
    eprintln!("xtask: building examples and tests (cargo --profile {PROFILE})");
    // `--examples` with no example at all only earns a warning: skip it then.
    let has_examples = std::fs::read_dir(util::workspace_root().join("examples")).is_ok()
        || std::fs::read_to_string(&manifest).is_ok_and(|m| m.contains("[[example]]"));
    let examples = if has_examples {
        artifacts(&cargo_json(&["build", "--examples"])?, &manifest, "example")?
    } else {
        Vec::new()
    };
    let test_json = cargo_json(&["test", "--no-run"])?;
    let tests = artifacts(&test_json, &manifest, "test")?;
    let lib_tests = artifacts(&test_json, &manifest, "lib")?
        .into_iter()
        .next()
        .map(|b| Binary { name: format!("{}-lib", b.name), path: b.path });
    let has_benches = std::fs::read_dir(util::workspace_root().join("benches")).is_ok();
    let benches =
        if has_benches { artifacts(&cargo_json(&["bench", "--no-run"])?, &manifest, "bench")? } else { Vec::new() };
    let mut names: Vec<&str> =
        examples.iter().chain(&tests).chain(&lib_tests).chain(&benches).map(|b| b.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        bail!("two of the examples, integration tests and benches are called `{}`: $BIN can hold only one", w[0]);
    }
    Ok(Binaries { examples, tests, lib_tests, benches })
}

/// Builds the examples and the benches as a user would (profile [`PERF_PROFILE`]: release, no
/// debug assertions, no test hooks, with line tables): what `cargo xtask bench` and
/// `cargo xtask vm --perf` measure. No test executables: those need the test hooks.
pub fn build_perf() -> Result<Binaries> {
    let manifest = util::workspace_root().join("Cargo.toml");
    eprintln!("xtask: building examples and benches to measure (cargo --profile {PERF_PROFILE})");
    let examples = artifacts(
        &cargo_json_as(&["build", "--examples"], PERF_PROFILE, &["--features", "tokio"])?,
        &manifest,
        "example",
    )?;
    let benches = artifacts(&cargo_json_as(&["bench", "--no-run"], PERF_PROFILE, &[])?, &manifest, "bench")?;
    Ok(Binaries { examples, tests: Vec::new(), lib_tests: None, benches })
}

/// Builds `benches/path_count.rs` (profile [`PERF_PROFILE`], feature `bench-internals`) and
/// returns its executable: `cargo xtask path-count`'s subject.
pub fn build_path_count() -> Result<PathBuf> {
    let manifest = util::workspace_root().join("Cargo.toml");
    eprintln!("xtask: building benches/path_count.rs (cargo --profile {PERF_PROFILE}, feature bench-internals)");
    let json = cargo_json_as(&["build", "--bench", "path_count"], PERF_PROFILE, &["--features", "bench-internals"])?;
    artifacts(&json, &manifest, "bench")?
        .into_iter()
        .find(|b| b.name == "path_count")
        .map(|b| b.path)
        .ok_or_else(|| util::Error::new("cargo built no path_count bench".to_string()))
}

/// Makes a directory of symlinks NAME -> executable (the host's `$BIN`).
pub fn link_dir(bins: &Binaries, dir: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    util::create_dir_all(dir)?;
    for b in bins.all() {
        let link = dir.join(&b.name);
        std::os::unix::fs::symlink(&b.path, &link)
            .context(|| format!("cannot link {} to {}", link.display(), b.path.display()))?;
    }
    Ok(())
}

/// True when the root crate has `examples/NAME.rs` (used by the demo).
pub fn has_example(name: &str) -> bool {
    util::workspace_root().join("examples").join(format!("{name}.rs")).is_file()
}

/// `cargo test` for the host (unit tests; RDMA tests show as ignored), as a command.
pub fn host_test_command() -> Command {
    let mut cmd = util::cargo();
    cmd.args(["test", "--profile", PROFILE, "--workspace", "--no-fail-fast"]).current_dir(util::workspace_root());
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_root_crates_tests_and_examples() {
        let m = "/w/Cargo.toml";
        let lines = [
            format!(r#"{{"reason":"compiler-artifact","manifest_path":"{m}","target":{{"kind":["lib"],"name":"rdma_reactor"}},"executable":"/w/target/vm/deps/rdma_reactor-aa"}}"#),
            format!(r#"{{"reason":"compiler-artifact","manifest_path":"{m}","target":{{"kind":["test"],"name":"testbed"}},"executable":"/w/target/vm/deps/testbed-bb"}}"#),
            format!(r#"{{"reason":"compiler-artifact","manifest_path":"{m}","target":{{"kind":["example"],"name":"echo"}},"executable":"/w/target/vm/examples/echo"}}"#),
            r#"{"reason":"compiler-artifact","manifest_path":"/w/xtask/Cargo.toml","target":{"kind":["test"],"name":"other"},"executable":"/x"}"#.to_string(),
            format!(r#"{{"reason":"compiler-artifact","manifest_path":"{m}","target":{{"kind":["lib"],"name":"rdma_reactor"}},"executable":null}}"#),
            r#"{"reason":"build-finished","success":true}"#.to_string(),
        ];
        let out = lines.join("\n");
        let tests = artifacts(&out, Path::new(m), "test").unwrap();
        assert_eq!(tests, vec![Binary { name: "testbed".into(), path: "/w/target/vm/deps/testbed-bb".into() }]);
        let examples = artifacts(&out, Path::new(m), "example").unwrap();
        assert_eq!(examples.len(), 1);
        assert_eq!(examples[0].name, "echo");
        // The lib's unit-test executable; the plain lib build (no executable) is skipped.
        let lib = artifacts(&out, Path::new(m), "lib").unwrap();
        assert_eq!(lib, vec![Binary { name: "rdma_reactor".into(), path: "/w/target/vm/deps/rdma_reactor-aa".into() }]);
    }
}
