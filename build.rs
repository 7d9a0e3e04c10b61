// rdma-sys links libibverbs and librdmacm through pkg-config; this script only turns a missing
// pkg-config file into an error that says what to install.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for (lib, pkg) in [
        ("libibverbs", "libibverbs-dev"),
        ("librdmacm", "librdmacm-dev"),
    ] {
        let ok = std::process::Command::new("pkg-config")
            .args(["--exists", lib])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            println!(
                "cargo:warning={lib} not found by pkg-config: install {pkg} (or run `cargo xtask setup`)"
            );
        }
    }
}
