//! libtest's output, read: its counts, the tests it listed as failed (with why), and the
//! lines of tests that do not apply to iWARP.

/// The line a test prints (to stdout, past libtest's capture) when it does not apply to the
/// device's transport: `xtask-not-applicable: TEST: REASON` (`util::not_on_iwarp`).
pub(super) const NOT_APPLICABLE: &str = "xtask-not-applicable: ";

/// The `(test, reason)` of every [`NOT_APPLICABLE`] line in a binary's output. The line may
/// follow libtest's `test NAME ... ` on the same line (libtest prints the result after the
/// test ran).
pub(super) fn parse_not_applicable(output: &[u8]) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = Vec::new();
    for line in String::from_utf8_lossy(output).lines() {
        let Some(i) = line.find(NOT_APPLICABLE) else { continue };
        let rest = line[i + NOT_APPLICABLE.len()..].trim_end();
        let (test, reason) = rest.split_once(": ").unwrap_or((rest, ""));
        let entry = (test.trim().to_string(), reason.trim().to_string());
        if !entry.0.is_empty() && !found.contains(&entry) {
            found.push(entry);
        }
    }
    found
}

/// A test libtest listed as failed: its name and, when its output said, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    pub(super) name: String,
    /// Where it panicked and the panic's first line (`panicked at f.rs:1:2: message`), or
    /// else its output's first line (a test that returned `Err`, or a `should_panic` test
    /// that did not panic).
    pub(super) why: Option<String>,
}

impl Failure {
    /// `name: why`, or the name alone.
    pub(super) fn describe(&self) -> String {
        match &self.why {
            Some(why) => format!("{}: {why}", self.name),
            None => self.name.clone(),
        }
    }
}

/// The tests in libtest's closing `failures:` lists (four spaces, then a test's name, which
/// for a doc test has spaces in it), of every test binary in `output`, in order, each with
/// why from its own `---- name stdout ----` block (the first unused block of that name: two
/// binaries may have tests of the same name).
pub(super) fn parse_failures(output: &[u8]) -> Vec<Failure> {
    const MAX_WHY: usize = 300;
    let text = String::from_utf8_lossy(output);
    // Each block's name and lines, in order.
    let mut blocks: Vec<(&str, Vec<&str>)> = Vec::new();
    let mut in_block = false;
    let mut names: Vec<&str> = Vec::new();
    let mut in_list = false;
    let mut listed = 0;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("---- ").and_then(|l| l.strip_suffix(" stdout ----")) {
            blocks.push((name, Vec::new()));
            (in_block, in_list) = (true, false);
            continue;
        }
        if line.trim_end() == "failures:" {
            (in_block, in_list, listed) = (false, true, 0);
            continue;
        }
        if in_block {
            if let Some((_, lines)) = blocks.last_mut() {
                lines.push(line);
            }
        } else if in_list {
            match line.strip_prefix("    ").map(str::trim_end) {
                Some(name) if !name.is_empty() && !name.starts_with(' ') => {
                    listed += 1;
                    names.push(name);
                }
                _ if listed == 0 && line.trim().is_empty() => {}
                _ => in_list = false,
            }
        }
    }
    let why_of = |lines: &[&str]| -> Option<String> {
        let mut why = match lines.iter().position(|l| l.contains("panicked at ")) {
            Some(i) => {
                let at = &lines[i][lines[i].find("panicked at ")?..];
                let message = lines[i + 1..].iter().find(|l| !l.trim().is_empty()).map_or("", |l| l.trim());
                format!("{} {message}", at.trim_end()).trim_end().to_string()
            }
            None => lines.iter().find(|l| !l.trim().is_empty())?.trim().to_string(),
        };
        if why.len() > MAX_WHY {
            let cut = (0..=MAX_WHY).rev().find(|&i| why.is_char_boundary(i)).unwrap_or(0);
            why.truncate(cut);
            why.push_str(" ...");
        }
        Some(why)
    };
    let mut used = vec![false; blocks.len()];
    names
        .into_iter()
        .map(|name| {
            let block = (0..blocks.len()).find(|&i| !used[i] && blocks[i].0 == name);
            let why = block.and_then(|i| {
                used[i] = true;
                why_of(&blocks[i].1)
            });
            Failure { name: name.to_string(), why }
        })
        .collect()
}

/// libtest's counts from a `test result:` line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counts {
    /// Tests that passed.
    pub passed: u64,
    /// Tests that failed.
    pub failed: u64,
    /// Tests that were ignored.
    pub ignored: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.passed += o.passed;
        self.failed += o.failed;
        self.ignored += o.ignored;
    }
}

/// Parses `test result: ok. 3 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; ...`.
pub(super) fn parse_result_line(line: &str) -> Option<Counts> {
    let rest = &line[line.find("test result: ")? + "test result: ".len()..];
    let (_, counts) = rest.split_once(". ")?;
    let mut c = Counts::default();
    let mut seen = false;
    for part in counts.split(';') {
        let mut it = part.split_whitespace();
        let (Some(n), Some(what)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(n) = n.parse::<u64>() else { continue };
        match what {
            "passed" => c.passed = n,
            "failed" => c.failed = n,
            "ignored" => c.ignored = n,
            _ => continue,
        }
        seen = true;
    }
    seen.then_some(c)
}

/// The counts of the last `test result:` line in `output`.
pub(super) fn last_result(output: &[u8]) -> Option<Counts> {
    String::from_utf8_lossy(output).lines().rev().find_map(parse_result_line)
}
