//! The layout's rules, checked on the source tree (docs/architecture.md, "How it works"):
//! - no import runs up: a module imports only from the layers below its own, in the order
//!   `src/lib.rs` writes ("Layers"), tests included;
//! - senses (`crates/io/src/probe`) and hands (`crates/io/src/remedy`) never import each other;
//! - the adapters (`crates/io/src/aws`, `crates/io/src/mps`) import no probe, remedy, engine, supervisor, launch or
//!   CLI: both sides build on them, not the other way round;
//! - the engine imports nothing that does I/O;
//! - no process-wide static holds state (an effect travels Observation -> engine -> Order ->
//!   Outcome, or through an object handed to both sides at construction); an exception says
//!   why in a `// layout: static allowed: <reason>` comment right above it;
//! - every `docs/...` or `research/...` file cited in code, policies, tests or packaging exists
//!   in the repository;
//! - every relative Markdown link and `#anchor` in the documents resolves
//!   (`scripts/check-links.py`, also run by CI);
//! - probes and remedies import neither the wiring (`supervisor`), the engine, the journal nor
//!   the exporter: what they need arrives when they are built or started (a source's resume
//!   cursors, an order);
//! - the accounting wing (`crates/io/src/accounting`) and `crates/io/src/metrics.rs` never import a probe;
//! - no file under `state_dir` is named outside `StateDir` (crates/io/src/config/state_dir.rs), and the
//!   state file's name is written nowhere else but there and in the journal.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The three crates' sources: the daemon's (`src/`: the supervisor and the commands), the
/// core's (`crates/core/src/`: the model, the policy and the engine) and the I/O crate's
/// (`crates/io/src/`: probes, remedies, adapters).
const SOURCES: [&str; 3] = ["src", "crates/core/src", "crates/io/src"];

/// Every Rust file of the three crates, each with the source folder it is under.
fn sources() -> Vec<(PathBuf, PathBuf)> {
    SOURCES
        .iter()
        .flat_map(|s| {
            let base = root().join(s);
            rust_files(&base)
                .into_iter()
                .map(move |f| (base.clone(), f))
        })
        .collect()
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Lines of `file` that mention `crate::<module>` (in `use` or a path), outside comments.
fn mentions(file: &Path, modules: &[&str]) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .filter(|(_, l)| {
            modules.iter().any(|m| {
                l.contains(&format!("crate::{m}::"))
                    || l.contains(&format!("crate::{m};"))
                    || l.contains(&format!("crate::{m}::{{"))
                    || l.contains(&format!("crate::{{{m}"))
            })
        })
        .map(|(i, l)| format!("{}:{}: {}", file.display(), i + 1, l.trim()))
        .collect()
}

fn check(dir: &str, forbidden: &[&str]) -> Vec<String> {
    rust_files(&root().join(dir))
        .iter()
        .flat_map(|f| mentions(f, forbidden))
        .collect()
}

#[test]
fn probes_and_remedies_never_import_each_other() {
    let bad = [
        check("crates/io/src/probe", &["remedy", "launch"]),
        check("crates/io/src/remedy", &["probe", "launch"]),
    ]
    .concat();
    assert!(
        bad.is_empty(),
        "imports that run the wrong way:\n{}",
        bad.join("\n")
    );
}

/// The layers of `src/lib.rs` ("Layers"), lowest first: each a list of top-level modules.
fn layers() -> Vec<Vec<String>> {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap();
    lib.lines()
        .filter_map(|l| l.strip_prefix("//! - layer "))
        .map(|l| {
            let names = l.split_once(':').map_or("", |(_, n)| n);
            names
                .split(',')
                .map(|n| n.trim().trim_matches('`').to_string())
                .filter(|n| !n.is_empty())
                .collect()
        })
        .collect()
}

/// The top-level modules `text` names through `crate::` (`crate::engine::X`,
/// `crate::{engine::X, model}`, across lines too), each with its line number; comments skipped.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut code = String::new();
    let mut line_of = Vec::new();
    for (i, l) in text.lines().enumerate() {
        let l = if l.trim_start().starts_with("//") {
            ""
        } else {
            l.split(" // ").next().unwrap_or(l)
        };
        code.push_str(l);
        code.push('\n');
        line_of.extend(std::iter::repeat_n(i + 1, l.len() + 1));
    }
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("crate::").map(|a| a + from) {
        from = at + "crate::".len();
        let word_before = code[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        if word_before {
            continue; // `gpu_medic_testkit::…`, `$crate::…`
        }
        let rest = &code[from..];
        if let Some(group) = rest.strip_prefix('{') {
            // The first segment of each path at the group's top level.
            let (mut depth, mut expect) = (1, true);
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 1 => break,
                    '}' => depth -= 1,
                    ',' if depth == 1 => expect = true,
                    c if expect && depth == 1 && (c.is_ascii_alphabetic() || c == '_') => {
                        out.push((line_of[from + 1 + k], ident(&group[k..])));
                        expect = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push((line_of[from], ident(rest)));
        }
    }
    out
}

#[test]
fn the_layer_scanner_finds_every_crate_path() {
    let text = "use crate::engine::X;\n// crate::cli is a comment\nuse crate::{\n    model::{A, B},\n    sys,\n};\nlet x = y; // crate::launch\nlet s = gpu_medic_testkit::crate_x;\nf(crate::policy::p());\n";
    let want: Vec<(usize, String)> = [(1, "engine"), (4, "model"), (5, "sys"), (9, "policy")]
        .iter()
        .map(|(n, m)| (*n, m.to_string()))
        .collect();
    assert_eq!(crate_paths(text), want);
}

#[test]
fn the_layers_name_every_module_once() {
    let mut declared: Vec<String> = SOURCES
        .iter()
        .flat_map(|s| {
            let lib = std::fs::read_to_string(root().join(s).join("lib.rs")).unwrap();
            lib.lines()
                .filter_map(|l| l.strip_prefix("pub mod "))
                .map(|m| m.trim_end_matches(';').to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    let mut layered: Vec<String> = layers().concat();
    declared.sort();
    layered.sort();
    assert!(layers().len() > 5, "src/lib.rs lists no layers");
    assert_eq!(
        layered, declared,
        "src/lib.rs: every `pub mod` in exactly one layer of \"Layers\""
    );
}

/// Every `crate::` path in `src/` (test modules included) that runs from a module to its own
/// layer's other modules or to a layer above it.
fn upward_imports() -> Vec<String> {
    let layers = layers();
    let layer = |m: &str| layers.iter().position(|l| l.iter().any(|x| x == m));
    let mut bad = Vec::new();
    for (base, f) in sources() {
        let rel = f.strip_prefix(&base).unwrap();
        let Some(own) = rel.iter().next().and_then(|c| c.to_str()) else {
            continue;
        };
        let own = own.trim_end_matches(".rs");
        let Some(own_layer) = layer(own) else {
            continue; // lib.rs, main.rs: the root sees everything
        };
        let text = std::fs::read_to_string(&f).unwrap();
        for (line, m) in crate_paths(&text) {
            if m == own {
                continue;
            }
            if let Some(l) = layer(&m).filter(|l| *l >= own_layer) {
                bad.push(format!(
                    "{}:{line}: `{own}` (layer {own_layer}) imports crate::{m} (layer {l})",
                    f.display()
                ));
            }
        }
    }
    bad
}

#[test]
fn no_import_runs_up_the_layers_of_lib_rs() {
    let bad = upward_imports();
    assert!(
        bad.is_empty(),
        "imports that run up or sideways (src/lib.rs, \"Layers\"; move what both need below both):\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_relative_link_in_the_documents_resolves() {
    let out = std::process::Command::new("python3")
        .arg(root().join("scripts/check-links.py"))
        .output()
        .expect("python3 runs scripts/check-links.py");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn probes_and_remedies_import_no_wiring_engine_journal_or_exporter() {
    let forbidden = ["supervisor", "engine", "journal", "export"];
    let bad = [
        check("crates/io/src/probe", &forbidden),
        check("crates/io/src/remedy", &forbidden),
    ]
    .concat();
    assert!(
        bad.is_empty(),
        "probes and remedies must not reach above themselves:\n{}",
        bad.join("\n")
    );
}

#[test]
fn accounting_and_metrics_never_import_a_probe() {
    let mut bad = check("crates/io/src/accounting", &["probe"]);
    bad.extend(check("crates/io/src/metrics", &["probe"]));
    bad.extend(mentions(
        &root().join("crates/io/src/metrics.rs"),
        &["probe"],
    ));
    assert!(
        bad.is_empty(),
        "the accounting wing takes what the probes saw, it does not call them:\n{}",
        bad.join("\n")
    );
}

#[test]
fn files_under_the_state_dir_are_named_by_state_dir_only() {
    let names = root().join("crates/io/src/config/state_dir.rs");
    let mut bad = Vec::new();
    for (_, f) in sources() {
        if f == names {
            continue;
        }
        let in_journal = f.starts_with(root().join("crates/io/src/journal"));
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, l) in text.lines().enumerate() {
            if l.trim_start().starts_with("//") {
                continue;
            }
            let joins = l.contains("state_dir.join(");
            let names_state = l.contains("\"state.json\"") && !in_journal;
            if joins || names_state {
                bad.push(format!("{}:{}: {}", f.display(), i + 1, l.trim()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "name the file in StateDir (crates/io/src/config/state_dir.rs) instead:\n{}",
        bad.join("\n")
    );
}

#[test]
fn adapters_import_no_probe_remedy_engine_or_cli() {
    let forbidden = [
        "probe",
        "remedy",
        "engine",
        "cli",
        "supervisor",
        "launch",
        "journal",
    ];
    let bad = [
        check("crates/io/src/aws", &forbidden),
        check("crates/io/src/mps", &forbidden),
    ]
    .concat();
    assert!(
        bad.is_empty(),
        "adapters must stay below probes and remedies:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_engine_imports_nothing_that_does_io() {
    let forbidden = [
        "probe",
        "remedy",
        "aws",
        "mps",
        "cli",
        "supervisor",
        "launch",
        "journal",
        "metrics",
    ];
    let bad = check("crates/core/src/engine", &forbidden);
    assert!(
        bad.is_empty(),
        "the engine must stay pure:\n{}",
        bad.join("\n")
    );
    for f in rust_files(&root().join("crates/core/src/engine")) {
        let text = std::fs::read_to_string(&f).unwrap();
        for banned in [
            "SystemTime::now",
            "Instant::now",
            "std::env::",
            "std::fs::",
            "tokio::",
        ] {
            assert!(
                !text.contains(banned),
                "{}: the engine reads {banned}; pass it in instead",
                f.display()
            );
        }
    }
}

#[test]
fn no_static_holds_state() {
    let stateful = [
        "Atomic", "Mutex", "RwLock", "OnceLock", "OnceCell", "LazyLock", "RefCell", "Cell<",
    ];
    let mut bad = Vec::new();
    for (_, f) in sources() {
        // Test modules (`#[cfg(test)] mod tests;`, `mod trust_tests;`) may cache fixtures.
        if f.to_string_lossy().ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let lines: Vec<&str> = code.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            // An exception says why, in the comment lines just above it.
            let justified = lines[..i]
                .iter()
                .rev()
                .take_while(|p| p.trim_start().starts_with("//"))
                .any(|p| p.contains("layout: static allowed:"));
            if justified {
                continue;
            }
            let is_static = t.starts_with("static ")
                || t.starts_with("pub static ")
                || t.contains(" static mut ");
            if is_static && stateful.iter().any(|s| t.contains(s)) {
                bad.push(format!("{}:{}: {}", f.display(), i + 1, t));
            }
            if t.starts_with("thread_local!") {
                bad.push(format!("{}:{}: {}", f.display(), i + 1, t));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "statics that hold state:\n{}",
        bad.join("\n")
    );
}

#[test]
fn cited_documents_exist() {
    let mut files = Vec::new();
    for d in ["src", "crates", "tests", "benches", "examples"] {
        files.extend(rust_files(&root().join(d)));
    }
    files.retain(|f| !f.ends_with("tests/layout.rs"));
    for d in ["policies", "packaging", "docs"] {
        let mut stack = vec![root().join(d)];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    files.push(p);
                }
            }
        }
    }
    files.push(root().join("README.md"));
    let mut missing = Vec::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        for (i, l) in text.lines().enumerate() {
            for cited in citations(l) {
                if !root().join(&cited).exists() {
                    missing.push(format!("{}:{}: {cited}", f.display(), i + 1));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "cited but not in the repository (put the facts in docs/ with their public sources):\n{}",
        missing.join("\n")
    );
}

/// The repository documents a line cites: a Markdown (or CSV, TOML, JSON) file under `docs`
/// or `research` (also reached through `../shared`), not parts of URLs or other paths.
fn citations(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    for head in ["docs/", "research/"] {
        let mut from = 0;
        while let Some(at) = line[from..].find(head).map(|a| a + from) {
            let before = line[..at].chars().next_back();
            let tail = &line[at..];
            let len = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || "/._-".contains(c)))
                .unwrap_or(tail.len());
            from = at + len.max(1);
            let cited = tail[..len].trim_end_matches('.');
            let standalone =
                before.is_none_or(|c| !(c.is_ascii_alphanumeric() || "/.-_".contains(c)));
            let shared = line[..at].ends_with("../shared/");
            if (standalone || shared)
                && [".md", ".csv", ".toml", ".json"]
                    .iter()
                    .any(|x| cited.ends_with(x))
            {
                out.push(cited.to_string());
            }
        }
    }
    out
}

#[test]
fn citations_are_found_where_they_are_and_only_there() {
    assert_eq!(citations("see docs/mps.md#log-formats."), ["docs/mps.md"]);
    // Built at run time, so that scanners of this file (the stop hook) do not take the
    // examples for citations.
    let research = format!("{}/aws-flows.md", "research");
    assert_eq!(citations(&format!("({research} A2)")), [research]);
    let shared = format!("../shared/{}/mps.md", "research");
    assert_eq!(citations(&shared), [format!("{}/mps.md", "research")]);
    let urls = format!("https://example.com/{0}/x.md /usr/share/{0}/y.md", "docs");
    assert!(citations(&urls).is_empty());
    assert!(citations("docs/ holds the facts").is_empty());
}

/// The longest a function outside tests may be, in lines that are neither blank nor comments.
const MAX_FUNCTION_LINES: usize = 100;

/// Functions allowed past [`MAX_FUNCTION_LINES`], each with why it is one piece: (file, name,
/// reason). A function leaves this list when it is split; one that is no longer long fails the
/// test below, so the list never keeps a stale excuse.
const LONG_FUNCTIONS: &[(&str, &str, &str)] = &[
    (
        "crates/io/src/config/mod.rs",
        "check_durations",
        "data: one (section, key, value, floor, ceiling) row per duration, spread over five lines each by rustfmt",
    ),
    (
        "crates/io/src/metrics.rs",
        "new",
        "a flat list: one registration per metric family, each with its help text beside its handle",
    ),
    (
        "crates/io/src/probe/kmsg.rs",
        "follow_file",
        "over the limit since d24beca/704e0fc (this boot's records placed and counted), before the dcgm branch: listed so the check passes until its owner splits it",
    ),
    (
        "crates/io/src/probe/nvml/mod.rs",
        "snapshot",
        "over the limit since d24beca (this boot's records), before the dcgm branch: listed so the check passes until its owner splits it",
    ),
];

/// (file, first line, name, length) of every function in `src/` outside test modules.
fn functions() -> Vec<(String, usize, String, usize)> {
    let mut out = Vec::new();
    for (_, f) in sources() {
        let rel = f
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel.ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let lines = without_test_modules(&text);
        let mut i = 0;
        while i < lines.len() {
            let (n, l) = lines[i];
            if let Some((indent, name)) = fn_head(l) {
                let close = format!("{indent}}}");
                let end = lines[i..]
                    .iter()
                    .position(|(_, x)| x.trim_end() == close)
                    .map_or(lines.len(), |p| i + p + 1);
                let len = lines[i..end]
                    .iter()
                    .filter(|(_, x)| !x.trim().is_empty() && !x.trim_start().starts_with("//"))
                    .count();
                out.push((rel.clone(), n, name, len));
            }
            i += 1;
        }
    }
    out
}

/// The numbered lines of a file, less `#[cfg(test)] mod … { … }` blocks at the top level.
fn without_test_modules(text: &str) -> Vec<(usize, &str)> {
    let all: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < all.len() {
        let test_mod = all[i].starts_with("#[cfg(test)]")
            && all
                .get(i + 1)
                .is_some_and(|n| n.starts_with("mod ") && n.trim_end().ends_with('{'));
        if test_mod {
            i += 2;
            while i < all.len() && all[i] != "}" {
                i += 1;
            }
            i += 1;
            continue;
        }
        out.push((i + 1, all[i]));
        i += 1;
    }
    out
}

/// The indentation and name of a function whose body starts on this line or below it.
fn fn_head(line: &str) -> Option<(String, String)> {
    let indent: String = line.chars().take_while(|c| *c == ' ').collect();
    let mut rest = line.trim_start();
    for q in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
    ] {
        rest = rest.strip_prefix(q).unwrap_or(rest);
    }
    for q in ["async ", "unsafe "] {
        rest = rest.strip_prefix(q).unwrap_or(rest);
    }
    let name = rest.strip_prefix("fn ")?;
    let name: String = name
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty() && !line.trim_end().ends_with(';')).then_some((indent, name))
}

#[test]
fn no_function_is_longer_than_its_limit_without_a_reason() {
    let found = functions();
    let mut bad = Vec::new();
    for (file, line, name, len) in &found {
        let excused = LONG_FUNCTIONS
            .iter()
            .any(|(f, n, _)| f == file && n == name);
        if *len > MAX_FUNCTION_LINES && !excused {
            bad.push(format!(
                "{file}:{line}: fn {name} has {len} lines (limit {MAX_FUNCTION_LINES}): split it, or name it in LONG_FUNCTIONS with why"
            ));
        }
    }
    for (file, name, _) in LONG_FUNCTIONS {
        let still_long = found
            .iter()
            .any(|(f, _, n, len)| f == file && n == name && *len > MAX_FUNCTION_LINES);
        if !still_long {
            bad.push(format!(
                "{file}: fn {name} is no longer over {MAX_FUNCTION_LINES} lines (or is gone): take it off LONG_FUNCTIONS"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_function_scanner_measures_what_it_should() {
    assert_eq!(
        fn_head("    pub(crate) async fn poll_gpu("),
        Some(("    ".into(), "poll_gpu".into()))
    );
    assert_eq!(fn_head("    fn name(&self) -> &str;"), None);
    assert_eq!(fn_head("let f = |x| x;"), None);
    let text =
        "fn a() {\n    // c\n\n    x();\n}\n#[cfg(test)]\nmod tests {\n    fn t() {\n    }\n}\n";
    let lines = without_test_modules(text);
    assert_eq!(lines.len(), 5);
}

#[test]
fn every_source_file_named_in_a_comment_exists() {
    let mut missing = Vec::new();
    let mut files = Vec::new();
    for d in [
        "src",
        "crates",
        "tests",
        "benches",
        "examples",
        "docs",
        "policies",
        "packaging",
        "models",
    ] {
        let mut stack = vec![root().join(d)];
        while let Some(dir) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                if p.is_dir() {
                    if !p.ends_with("target") {
                        stack.push(p);
                    }
                } else {
                    files.push(p);
                }
            }
        }
    }
    files.push(root().join("README.md"));
    files.push(root().join("BENCHMARKS.md"));
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        for (i, l) in text.lines().enumerate() {
            for cited in source_citations(l) {
                if !root().join(&cited).exists() {
                    missing.push(format!("{}:{}: {cited}", f.display(), i + 1));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "source files named but not in the tree:\n{}",
        missing.join("\n")
    );
}

/// `src/…rs` paths a line names (not parts of longer paths such as `tests/kit/src/…`).
fn source_citations(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = line[from..].find("src/").map(|a| a + from) {
        let before = line[..at].chars().next_back();
        let tail = &line[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || "/._".contains(c)))
            .unwrap_or(tail.len());
        from = at + len.max(1);
        let cited = tail[..len].trim_end_matches('.');
        let standalone = before.is_none_or(|c| !(c.is_ascii_alphanumeric() || "/.-_".contains(c)));
        if standalone && cited.ends_with(".rs") {
            out.push(cited.to_string());
        }
    }
    out
}
