//! The unit tests of `cargo xtask test`'s parsing, rows, report and runner script.

use super::*;

/// A row of `place` and `name` that passed with counts `c` and nothing else said: the tests
/// change what they test with struct update syntax.
fn row_of(place: &'static str, name: &str, c: Option<Counts>) -> Row {
    Row {
        place,
        name: name.into(),
        counts: c,
        status: Some(0),
        killed: false,
        note: None,
        secs: None,
        not_applicable: Vec::new(),
        failed_tests: Vec::new(),
        second_boot: Vec::new(),
    }
}

#[test]
fn parses_libtest_summaries() {
    let ok = "test result: ok. 3 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.01s";
    assert_eq!(parse_result_line(ok), Some(Counts { passed: 3, failed: 0, ignored: 2 }));
    let bad = "test result: FAILED. 1 passed; 4 failed; 0 ignored; 0 measured; 0 filtered out";
    assert_eq!(parse_result_line(bad), Some(Counts { passed: 1, failed: 4, ignored: 0 }));
    assert_eq!(parse_result_line("test foo ... ok"), None);
    assert_eq!(parse_result_line("test result: garbage"), None);
}

/// The console of CI's siw boot that hung (stop 27): the BUG line is found, the warnings and
/// the test's own output are not.
#[test]
fn a_kernel_failure_on_the_console_is_named() {
    let console = "test signals_and_spurious_wakeups_cost_nothing ... echo server: listening on 198.18.1.1:21482\n\
                   [   20.100000] WARNING: CPU: 0 PID: 12 at net/core/sock.c:1 x+0x1/0x2\n\
                   [   21.083221] kernel BUG at lib/list_debug.c:53!\n\
                   [   21.085235] invalid opcode: 0000 [#1] PREEMPT SMP NOPTI\n";
    assert_eq!(kernel_failure(console).as_deref(), Some("kernel BUG at lib/list_debug.c:53!"));
    assert_eq!(kernel_failure("[ 3.1] WARNING: CPU: 1 PID: 2 at x\ntest a ... ok\n"), None);
    assert_eq!(
        kernel_failure("[ 9.0] BUG: unable to handle page fault for address: 0000000000000008").as_deref(),
        Some("BUG: unable to handle page fault for address: 0000000000000008")
    );
}

#[test]
fn parses_end_markers() {
    assert_eq!(parse_end("end testbed rc=0 killed=0 secs=3"), Some(("testbed".into(), 0, false, 3.0)));
    assert_eq!(parse_end("end hang rc=137 killed=1 secs=300"), Some(("hang".into(), 137, true, 300.0)));
    assert_eq!(parse_end("end x killed=0"), None);
    assert_eq!(parse_end("begin x"), None);
}

#[test]
fn crashes_and_kills_count_as_failures() {
    let row = |counts, status, killed| Row { status, killed, ..row_of("vm", "t", counts) };
    let c = |p, f| Some(Counts { passed: p, failed: f, ignored: 0 });
    assert_eq!(row(c(2, 0), Some(0), false).failed(), 0);
    assert_eq!(row(c(2, 3), Some(101), false).failed(), 3);
    assert_eq!(row(c(2, 0), Some(134), false).failed(), 1);
    assert_eq!(row(None, Some(137), true).failed(), 1);
    assert_eq!(row(None, None, false).failed(), 1);
}

#[test]
fn failed_tests_come_from_libtest_s_closing_list() {
    let out = b"test a ... FAILED\n\
        test b ... ok\n\
        \n\
        failures:\n\
        \n\
        ---- a stdout ----\n\
        thread 'a' panicked at tests/x.rs:1:1:\n\
        \n\
        failures:\n    a\n    c_d\n\
        \n\
        test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out\n";
    let names: Vec<String> = parse_failures(out).into_iter().map(|f| f.name).collect();
    assert_eq!(names, vec!["a".to_string(), "c_d".to_string()]);
    assert!(parse_failures(b"test result: ok. 3 passed; 0 failed; 0 ignored\n").is_empty());
    let row = Row {
        second_boot: vec!["eight".into()],
        ..row_of("vm siw", "kv_e2e", Some(Counts { passed: 2, failed: 0, ignored: 0 }))
    };
    assert_eq!(
        second_boot_section(std::slice::from_ref(&row)).as_deref(),
        Some(
            "xtask: passed in a second boot or pair of VMs (see the first one's output above)\n  vm siw kv_e2e: \
             failed in the first: eight\n"
        )
    );
    let x = Failure { name: "x".into(), why: Some("panicked at a.rs:1:1: no".into()) };
    let with_x = Row { failed_tests: vec![x], ..row };
    assert_eq!(row_failures(&with_x), vec!["x".to_string()]);
    assert_eq!(with_x.failed_tests[0].describe(), "x: panicked at a.rs:1:1: no");
}

#[test]
fn failures_are_named_with_why_across_binaries_and_listed_last() {
    // Three test binaries' output, as `cargo test --workspace` prints it: a panic; a test with
    // no panic line (a `should_panic` test that did not panic) listed before one that panicked;
    // a doc test (spaces in its name) and a test named as one in the first binary.
    let out = b"running 2 tests\n\
        test t::slow ... FAILED\n\
        \n\
        failures:\n\
        \n\
        ---- t::slow stdout ----\n\
        \n\
        thread 't::slow' (2978) panicked at src/t.rs:465:13:\n\
        1s: 999.068965ms\n\
        note: run with `RUST_BACKTRACE=1`\n\
        \n\
        \n\
        failures:\n    t::slow\n\
        \n\
        test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n\
        running 2 tests\n\
        \n\
        failures:\n\
        \n\
        ---- u stdout ----\n\
        note: test did not panic as expected at src/u.rs:3:4\n\
        ---- v stdout ----\n\
        thread 'v' panicked at src/v.rs:1:2:\n\
        oh no\n\
        \n\
        failures:\n    u\n    v\n\
        \n\
        test result: FAILED. 0 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out\n\
        running 2 tests\n\
        \n\
        failures:\n\
        \n\
        ---- src/lib.rs - Foo (line 12) stdout ----\n\
        Test executable failed (exit status: 101).\n\
        ---- t::slow stdout ----\n\
        thread 't::slow' panicked at xtask/src/t.rs:9:9:\n\
        another\n\
        \n\
        failures:\n    src/lib.rs - Foo (line 12)\n    t::slow\n\
        \n\
        test result: FAILED. 0 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out\n";
    let failures = parse_failures(out);
    let described: Vec<String> = failures.iter().map(Failure::describe).collect();
    assert_eq!(
        described,
        vec![
            "t::slow: panicked at src/t.rs:465:13: 1s: 999.068965ms".to_string(),
            "u: note: test did not panic as expected at src/u.rs:3:4".to_string(),
            "v: panicked at src/v.rs:1:2: oh no".to_string(),
            "src/lib.rs - Foo (line 12): Test executable failed (exit status: 101).".to_string(),
            "t::slow: panicked at xtask/src/t.rs:9:9: another".to_string(),
        ]
    );
    // A long message is cut at a character boundary.
    let long = format!(
        "failures:\n\n---- w stdout ----\nthread 'w' panicked at a.rs:1:1:\n{}\n\nfailures:\n    w\n",
        "é".repeat(400)
    );
    let why = parse_failures(long.as_bytes()).remove(0).why.expect("why");
    assert!(why.ends_with(" ...") && why.len() <= 304, "{why}");

    let failed = Row {
        status: Some(101),
        failed_tests: failures[..2].to_vec(),
        ..row_of("host", "cargo test --workspace", Some(Counts { passed: 1, failed: 5, ignored: 0 }))
    };
    let crashed = Row {
        place: "vm rxe",
        name: "faults".into(),
        counts: None,
        status: Some(139),
        failed_tests: Vec::new(),
        ..failed.clone()
    };
    let unnamed =
        Row { name: "memory".into(), counts: Some(Counts { passed: 3, failed: 1, ignored: 0 }), ..crashed.clone() };
    let killed = Row { name: "scale".into(), killed: true, ..crashed.clone() };
    let never = Row { name: "srq".into(), note: Some("never ran".into()), ..crashed.clone() };
    let passed = Row { counts: Some(Counts { passed: 3, failed: 0, ignored: 0 }), status: Some(0), ..crashed.clone() };
    assert_eq!(failed_section(std::slice::from_ref(&passed)), None);
    assert_eq!(
        failed_section(&[failed, passed, crashed.clone(), unnamed, killed, never]).as_deref(),
        Some(
            "xtask: FAILED (see each one's output above)\n  host cargo test --workspace: t::slow: panicked at \
             src/t.rs:465:13: 1s: 999.068965ms\n  host cargo test --workspace: u: note: test did not panic as \
             expected at src/u.rs:3:4\n  host cargo test --workspace: and 3 more, not named in its output\n  vm \
             rxe faults: exit status 139 (signal 11)\n  vm rxe memory: 1 failed, not named in its output\n  vm \
             rxe scale: killed by the watchdog\n  vm rxe srq: never ran\n"
        )
    );
    // The second boot's note keeps the names (or the row's description) only.
    assert_eq!(row_failures(&crashed), vec!["faults (exit status 139 (signal 11))".to_string()]);
}

#[test]
fn a_test_s_own_output_is_not_misread_and_a_crashed_binary_is_named() {
    // A test whose output has a `failures:` heading and a header-like line of its own, a
    // panic of another thread before its own, then a binary that crashed (no result) and one
    // after it.
    let out = b"running 1 test\n\
        test nested ... FAILED\n\
        \n\
        failures:\n\
        \n\
        ---- nested stdout ----\n\
        failures:\n    not_a_test\n\
        ---- inner stdout ----\n\
        thread 'worker' panicked at src/w.rs:1:1:\n\
        caught\n\
        thread 'nested' panicked at src/n.rs:2:2:\n\
        note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\
        the real one\n\
        \n\
        \n\
        failures:\n    nested\n\
        \n\
        test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n\
        running 3 tests\n\
        test a ... ok\n\
        test b ... \n\
        running 1 test\n\
        test c ... ok\n\
        \n\
        test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n\
        running 2 tests\n\
        test d ... ok\n";
    let described: Vec<String> = parse_failures(out).iter().map(Failure::describe).collect();
    assert_eq!(
        described,
        vec![
            "nested: panicked at src/n.rs:2:2: the real one".to_string(),
            "(ended without a test result): a crash? its last line: `test b ...`".to_string(),
            "(ended without a test result): a crash? its last line: `test d ... ok`".to_string(),
        ]
    );
}

#[test]
fn not_applicable_lines_are_collected_after_libtest_s_prefix_too() {
    let out = b"running 3 tests\n\
        test a ... xtask-not-applicable: a: iWARP has no immediate data\n\
        ok\n\
        test b ... ok\n\
        xtask-not-applicable: c: no memory windows on siw\n\
        xtask-not-applicable: c: no memory windows on siw\n\
        test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n";
    assert_eq!(
        parse_not_applicable(out),
        vec![
            ("a".to_string(), "iWARP has no immediate data".to_string()),
            ("c".to_string(), "no memory windows on siw".to_string())
        ]
    );
    assert!(parse_not_applicable(b"test x ... ok\n").is_empty());
}

#[test]
fn rows_count_not_applicable_tests_and_list_them_after_the_table() {
    let row = |place, na: Vec<(String, String)>| Row {
        not_applicable: na,
        ..row_of(place, "srq", Some(Counts { passed: 3, failed: 0, ignored: 0 }))
    };
    let plain = row("vm rxe", Vec::new());
    assert_eq!(plain.render(), format!("  {:<7} {:<28} 3 passed, 0 failed, 0 ignored", "vm rxe", "srq"));
    let siw = row("vm siw", vec![("write_imm".into(), "iWARP has no immediate data".into())]);
    assert_eq!(siw.failed(), 0, "a binary with n/a tests that exits 0 passes");
    assert!(siw.render().ends_with(" 3 passed, 0 failed, 0 ignored, 1 n/a"), "{}", siw.render());
    assert!(siw.render().starts_with("  vm siw  srq "), "{}", siw.render());
    assert_eq!(not_applicable_section(&[plain]), None);
    assert_eq!(
        not_applicable_section(&[row("vm rxe", Vec::new()), siw]).as_deref(),
        Some("xtask: not applicable on siw (iWARP)\n  srq: write_imm: iWARP has no immediate data\n")
    );
}

#[test]
fn both_devices_unless_one_is_chosen() {
    let o = |device| Options { per_binary: Duration::from_secs(1), vm_timeout: None, verbose: false, device };
    assert_eq!(o(None).devices(), vec![Device::Rxe, Device::Siw]);
    assert_eq!(o(Some(Device::Siw)).devices(), vec![Device::Siw]);
    assert_eq!((vm_place(Device::Siw), vm2_place(Device::Rxe)), ("vm siw", "vm2 rxe"));
}

#[test]
fn runner_runs_each_binary_under_timeout() {
    let t = |n: &str| Binary { name: n.into(), path: "/x".into() };
    let (lib, testbed) = (t("rdma_reactor-lib"), t("testbed"));
    let stream = t("stream");
    let tests = [(&lib, "--ignored"), (&testbed, "--include-ignored"), (&stream, "--include-ignored")];
    let s = runner_script("n", &tests, Duration::from_secs(300));
    assert!(s.contains("timeout -s KILL $T \"$BIN/$name\" $filter --test-threads=1"));
    assert!(s.contains(
        "run_test rdma_reactor-lib 300 --ignored\nrun_test testbed 300 --include-ignored\n\
         run_test stream 900 --include-ignored\nexit 0\n"
    ));
    assert!(s.contains("echo \"@@xtask-n:end $name rc=$rc killed=$killed secs=$secs@@\""));
}

/// A case result for the two-VM stage's tests.
fn case(name: &str, passed: bool, detail: &str) -> vm2::CaseResult {
    vm2::CaseResult { name: name.into(), passed, detail: detail.into(), secs: Some(1.0) }
}

#[test]
fn a_failed_two_vm_case_runs_once_more_in_a_pair_of_its_own() {
    let mut calls: Vec<Vec<&str>> = Vec::new();
    let rows = vm2_stage("vm2 rxe", "rxe", |cases| {
        calls.push(cases.to_vec());
        Ok(if cases.len() == vm2::CASES.len() {
            cases
                .iter()
                .map(|&c| {
                    case(c, c != "reconnect-restart", if c == "reconnect-restart" { "A: no reconnect" } else { "fine" })
                })
                .collect()
        } else {
            vec![case(cases[0], true, "alone")]
        })
    });
    assert_eq!(calls, vec![vm2::CASES.to_vec(), vec!["reconnect-restart"]], "one failed: a pair of its own");
    let again = rows.iter().find(|r| r.name == "reconnect-restart").unwrap();
    assert_eq!(again.failed(), 0);
    assert_eq!(again.note.as_deref(), Some("second pair; the first failed: A: no reconnect; alone"));
    assert_eq!(again.second_boot, vec!["A: no reconnect".to_string()]);
    let listed = second_boot_section(&rows).unwrap();
    assert!(listed.contains("vm2 rxe reconnect-restart: failed in the first: A: no reconnect"), "{listed}");
}

#[test]
fn several_failed_two_vm_cases_run_again_the_first_alone_the_others_together() {
    let mut calls: Vec<Vec<&str>> = Vec::new();
    let rows = vm2_stage("vm2 rxe", "rxe", |cases| {
        calls.push(cases.to_vec());
        Ok(if cases.len() == vm2::CASES.len() {
            // The pair wedges at reconnect-link: it and the two cases after it fail.
            let wedged = ["reconnect-link", "reconnect-restart", "peer-killed"];
            cases
                .iter()
                .map(|&c| if wedged.contains(&c) { case(c, false, "timed out") } else { case(c, true, "fine") })
                .collect()
        } else {
            // Again: reconnect-link passes alone; of the others, peer-killed fails again.
            cases.iter().map(|&c| case(c, c != "peer-killed", "again")).collect()
        })
    });
    assert_eq!(calls, vec![vm2::CASES.to_vec(), vec!["reconnect-link"], vec!["reconnect-restart", "peer-killed"]]);
    assert_eq!(rows.len(), vm2::CASES.len());
    let row = |n: &str| rows.iter().find(|r| r.name == n).unwrap();
    assert_eq!(row("reconnect-link").note.as_deref(), Some("second pair; the first failed: timed out; again"));
    let with = row("reconnect-restart");
    assert_eq!(with.failed(), 0);
    assert_eq!(
        with.note.as_deref(),
        Some("second pair, with the other failed cases; the first failed: timed out; again")
    );
    assert_eq!(with.second_boot, vec!["timed out".to_string()]);
    let twice = row("peer-killed");
    assert_eq!(twice.failed(), 1, "a second failure fails the run");
    assert_eq!(
        twice.note.as_deref(),
        Some("second pair, with the other failed cases; the first failed: timed out; again")
    );
    assert_eq!(row("blast-loss").note.as_deref(), Some("fine"));
    let listed = second_boot_section(&rows).unwrap();
    assert!(listed.contains("vm2 rxe reconnect-restart: failed in the first: timed out"), "{listed}");
    assert!(!listed.contains("peer-killed"), "{listed}");
}

#[test]
fn every_failed_two_vm_case_runs_once_more_in_at_most_two_pairs() {
    let mut calls = 0;
    let rows = vm2_stage("vm2 siw", "siw", |cases| {
        calls += 1;
        Ok(cases.iter().map(|&c| case(c, false, "down")).collect())
    });
    // The first pair, the first failed case alone, the others together; no third run.
    assert_eq!(calls, 3);
    assert!(rows.iter().all(|r| r.failed() == 1));
    let rows = vm2_stage("vm2 siw", "siw", |_| Err(crate::util::Error::new("no qemu")));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].note.as_deref(), Some("no qemu"));
}

/// Real output of `cargo test --no-fail-fast` (stdout; Rust 1.92, `RUST_BACKTRACE=1`) of a
/// crate with a failed assertion that printed first, a `should_panic` test that did not panic,
/// a test that returned `Err`, a binary that aborted, a second binary with a test of the same
/// name, and a failed doc test.
#[test]
fn real_libtest_output_is_read() {
    let out = include_bytes!("libtest-sample.txt");
    let described: Vec<String> = parse_failures(out).iter().map(Failure::describe).collect();
    assert_eq!(
        described,
        vec![
            "tests::no_panic: note: test did not panic as expected at src/lib.rs:14:8".to_string(),
            "tests::plain_panic: panicked at src/lib.rs:11:49: assertion `left == right` failed: arith is off"
                .to_string(),
            "tests::returns_err: Error: \"bad thing\"".to_string(),
            "(ended without a test result): a crash? its last line: `running 1 test`".to_string(),
            "plain_panic: panicked at tests/other.rs:2:20: second binary".to_string(),
            "src/lib.rs - add (line 3): panicked at src/lib.rs:5:1: assertion `left == right` failed".to_string(),
        ]
    );
}
