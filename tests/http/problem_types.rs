//! The `type` URIs of the HTTP problems (`http::problem_type`) point at anchors of the `http`
//! module's page on docs.rs. This test builds that page with rustdoc and checks that each URI's
//! fragment is an `id` on it, so a client that follows a problem's `type` lands on its
//! explanation.
//!
//! The docs are built with the features `http` and `tower` only: the `http` module's page with
//! every feature (as docs.rs builds it) differs only by its list of modules (`actix`), not by
//! the headings the problem types point at, and the
//! first run does not have to check the PostgreSQL and CLI dependencies. They are built in a
//! target directory of their own (`target/problem-types-doc`), because the `cargo test`
//! running this holds the lock of its own; after the first run, rustdoc only redoes this crate.

use std::path::{Path, PathBuf};
use std::process::Command;

use idempotency_store::http::{problem_code, problem_type};

const PREFIX: &str = "https://docs.rs/idempotency-store/latest/idempotency_store/http/#";

/// Every constant of `problem_type`, by name.
const CONSTANTS: [(&str, &str); 12] = [
    ("MISSING_KEY", problem_type::MISSING_KEY),
    ("INVALID_KEY", problem_type::INVALID_KEY),
    ("KEY_REUSED", problem_type::KEY_REUSED),
    ("IN_PROGRESS", problem_type::IN_PROGRESS),
    ("STORE_FULL", problem_type::STORE_FULL),
    ("INTERNAL", problem_type::INTERNAL),
    ("TOO_LARGE", problem_type::TOO_LARGE),
    ("INVALID_BODY", problem_type::INVALID_BODY),
    ("UNAVAILABLE", problem_type::UNAVAILABLE),
    ("NOT_STORED", problem_type::NOT_STORED),
    ("OUTCOME_UNKNOWN", problem_type::OUTCOME_UNKNOWN),
    ("COMPLETED_NOT_STORED", problem_type::COMPLETED_NOT_STORED),
];

/// Every constant of `problem_code`, by the name of its type in `problem_type`.
const CODES: [(&str, &str); 12] = [
    ("MISSING_KEY", problem_code::MISSING_KEY),
    ("INVALID_KEY", problem_code::INVALID_KEY),
    ("KEY_REUSED", problem_code::KEY_REUSED),
    ("IN_PROGRESS", problem_code::IN_PROGRESS),
    ("STORE_FULL", problem_code::STORE_FULL),
    ("INTERNAL", problem_code::INTERNAL),
    ("TOO_LARGE", problem_code::TOO_LARGE),
    ("INVALID_BODY", problem_code::INVALID_BODY),
    ("UNAVAILABLE", problem_code::UNAVAILABLE),
    ("NOT_STORED", problem_code::NOT_STORED),
    ("OUTCOME_UNKNOWN", problem_code::OUTCOME_UNKNOWN),
    ("COMPLETED_NOT_STORED", problem_code::COMPLETED_NOT_STORED),
];

// A type added to `CONSTANTS` needs its code here too.
const _: () = assert!(CODES.len() == CONSTANTS.len());

/// The directory holding this test's binary's `debug/deps` (or `release/deps`): the target
/// directory the suite was built in, wherever `CARGO_TARGET_DIR` put it.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
}

/// Builds the crate's docs with the HTTP features and returns the `http` module's page.
fn http_page() -> String {
    let doc_target = target_dir().join("problem-types-doc");
    let status = Command::new(env!("CARGO"))
        .args([
            "doc",
            "--no-deps",
            "--lib",
            "--features",
            "http,tower",
            "--quiet",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CARGO_TARGET_DIR", &doc_target)
        .status()
        .expect("run cargo doc");
    assert!(status.success(), "cargo doc failed: {status}");
    let page = doc_target.join("doc/idempotency_store/http/index.html");
    std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("read {}: {e}", page.display()))
}

/// The values of every `id="…"` attribute on the page.
fn ids(html: &str) -> Vec<&str> {
    html.split(" id=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect()
}

/// The problem-type URIs written in the `http` module's source (every file of `src/http/`),
/// so that a constant added there without an entry in `CONSTANTS` fails this test instead of
/// escaping it.
fn uris_in_source() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/http");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read src/http/")
        .map(|entry| entry.expect("an entry of src/http/").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no source files in src/http/");
    let mut uris = Vec::new();
    for path in files {
        let source = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        uris.extend(
            source
                .split('"')
                .filter(|text| text.starts_with(PREFIX) && text.len() > PREFIX.len())
                .map(str::to_owned),
        );
    }
    uris
}

#[test]
fn every_problem_type_is_a_constant_listed_here() {
    let listed: Vec<&str> = CONSTANTS.iter().map(|(_, uri)| *uri).collect();
    let in_source = uris_in_source();
    for uri in &in_source {
        assert!(
            listed.contains(&uri.as_str()),
            "{uri} is in src/http/ but not in CONSTANTS"
        );
    }
    for (name, uri) in CONSTANTS {
        assert!(
            uri.starts_with(PREFIX),
            "{name} = {uri} is not on the http page"
        );
        assert!(
            in_source.iter().any(|u| u == uri),
            "{name} = {uri} not found in src/http/"
        );
    }
}

#[test]
fn every_problem_type_anchor_exists_on_the_http_page() {
    let html = http_page();
    let ids = ids(&html);
    assert!(
        ids.contains(&"problem-types"),
        "the page has no \"Problem types\" section: is it the http module's page?"
    );
    let missing: Vec<String> = CONSTANTS
        .iter()
        .map(|(name, uri)| (name, &uri[PREFIX.len()..]))
        .filter(|(_, fragment)| !ids.contains(fragment))
        .map(|(name, fragment)| format!("{name} (#{fragment})"))
        .collect();
    assert!(
        missing.is_empty(),
        "no such id on http/index.html: {missing:?}"
    );
}

/// Each problem's `code` is its type's fragment, and the type's heading on the page (what a
/// client following the `type` reads) names it.
#[test]
fn every_problem_code_is_named_under_its_type_heading() {
    let html = http_page();
    for ((name, uri), (code_of, code)) in CONSTANTS.iter().zip(CODES) {
        assert_eq!(*name, code_of, "CODES in the order of CONSTANTS");
        assert_eq!(&uri[PREFIX.len()..], code, "{name}");
        let start = html
            .find(&format!(" id=\"{code}\""))
            .unwrap_or_else(|| panic!("{name}: no heading #{code}"));
        // Its section: up to the next heading.
        let section = &html[start..];
        let end = (2..=4)
            .filter_map(|level| section.find(&format!("<h{level}")))
            .min()
            .unwrap_or(section.len());
        assert!(
            section[..end].contains(&format!("<code>{code}</code>")),
            "{name}: its heading does not name the code {code}"
        );
    }
}
