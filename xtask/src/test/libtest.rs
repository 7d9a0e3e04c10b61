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
    /// The test's name as libtest lists it (a path; a doc test's has spaces in it).
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

/// The failed tests of every test binary in `output`, in order, each with why.
///
/// Each binary's output ends with its `test result:` line and is read alone. In it, libtest
/// prints `failures:` twice when a failed test wrote anything: first the `---- NAME stdout
/// ----` blocks of what they wrote, then the list of names (four spaces, then a name). Only
/// the last `failures:` is taken as the list and only headers between the first and the last
/// as blocks, and only a listed test's header starts a block, so a test whose own output has
/// such lines is not misread (short of a last `failures:` of its own). A name takes the
/// first unused block of that name in its binary.
pub(super) fn parse_failures(output: &[u8]) -> Vec<Failure> {
    let text = String::from_utf8_lossy(output);
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    let mut found = Vec::new();
    for part in lines.split_inclusive(|l| l.contains("test result: ")) {
        // A binary that ended without its result (a crash: on the host cargo says so on
        // stderr) runs into the next one's part, or ends the output. (Its `running` line comes
        // before any `failures:`, after which tests' own output is printed.)
        let heading = part.iter().position(|l| *l == "failures:").unwrap_or(part.len());
        let running: Vec<usize> = (0..heading)
            .filter(|&i| part[i].starts_with("running ") && (part[i].ends_with(" test") || part[i].ends_with(" tests")))
            .collect();
        let finished = part.last().is_some_and(|l| l.contains("test result: "));
        let ended = if finished { running.len().saturating_sub(1) } else { running.len() };
        for (n, &start) in running[..ended].iter().enumerate() {
            let end = running.get(n + 1).copied().unwrap_or(heading);
            let last = part[start..end].iter().rev().find(|l| l.starts_with("test ")).unwrap_or(&part[start]);
            found.push(Failure {
                name: "(ended without a test result)".into(),
                why: Some(format!("a crash? its last line: `{last}`")),
            });
        }
        found.extend(binary_failures(part));
    }
    found
}

/// [`parse_failures`] for one test binary's lines.
fn binary_failures(lines: &[&str]) -> Vec<Failure> {
    let headings: Vec<usize> = (0..lines.len()).filter(|&i| lines[i] == "failures:").collect();
    let (Some(&first), Some(&last)) = (headings.first(), headings.last()) else { return Vec::new() };
    let mut names: Vec<&str> = Vec::new();
    for line in &lines[last + 1..] {
        match line.strip_prefix("    ") {
            Some(name) if !name.is_empty() && !name.starts_with(' ') => names.push(name),
            _ if names.is_empty() && line.is_empty() => {}
            _ => break,
        }
    }
    // Each block's name and the lines after its header.
    let mut blocks: Vec<(&str, &[&str])> = Vec::new();
    let mut open: Option<(&str, usize)> = None;
    for i in first + 1..=last {
        // Only a listed test's header: a test's own output may have lines shaped like one.
        let header = lines[i]
            .strip_prefix("---- ")
            .and_then(|l| l.strip_suffix(" stdout ----"))
            .filter(|name| names.contains(name));
        if header.is_some() || i == last {
            if let Some((name, start)) = open.take() {
                blocks.push((name, &lines[start..i]));
            }
        }
        if let Some(name) = header {
            open = Some((name, i + 1));
        }
    }
    let mut used = vec![false; blocks.len()];
    names
        .into_iter()
        .map(|name| {
            let block = (0..blocks.len()).find(|&b| !used[b] && blocks[b].0 == name);
            let why = block.and_then(|b| {
                used[b] = true;
                why_of(name, blocks[b].1)
            });
            Failure { name: name.to_string(), why }
        })
        .collect()
}

/// Why test `name` failed, from what it wrote: its own thread's panic (`thread 'NAME' ...
/// panicked at`, else the first panic) with the message's first line, or else the first line
/// it wrote; at most 300 bytes.
fn why_of(name: &str, lines: &[&str]) -> Option<String> {
    const MAX_WHY: usize = 300;
    let panicked = |l: &&str| l.contains("panicked at ");
    let own = format!("thread '{name}'");
    let at = lines.iter().position(|l| panicked(l) && l.contains(&own)).or_else(|| lines.iter().position(panicked));
    let mut why = match at {
        Some(i) => {
            let at = &lines[i][lines[i].find("panicked at ")?..];
            let message = lines[i + 1..]
                .iter()
                .find(|l| !l.trim().is_empty() && !l.starts_with("note: run with"))
                .map_or("", |l| l.trim());
            format!("{at} {message}").trim_end().to_string()
        }
        None => lines.iter().find(|l| !l.trim().is_empty())?.trim().to_string(),
    };
    if why.len() > MAX_WHY {
        let cut = (0..=MAX_WHY).rev().find(|&i| why.is_char_boundary(i)).unwrap_or(0);
        why.truncate(cut);
        why.push_str(" ...");
    }
    Some(why)
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
