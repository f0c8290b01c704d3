//! The README and the reference pages under `docs/` stay true about the repository:
//! every path the README's layout block names exists, every relative link (of the README
//! and of each page) points at a file of the repository and, with a `#fragment`, at one
//! of its headings, and the README links every page.

use std::path::{Path, PathBuf};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(repo().join("README.md")).expect("README.md is readable")
}

/// The paths of the fenced block under `## Layout`: the first word of each line, under
/// the last top-level entry when indented (`src/` then `  message.rs` is
/// `src/message.rs`).
fn layout_paths(readme: &str) -> Vec<PathBuf> {
    let section = readme
        .split("\n## Layout")
        .nth(1)
        .expect("the README has a `## Layout` section");
    let block = section
        .split("```")
        .nth(1)
        .expect("the Layout section has a fenced block");
    // After the opening fence, its info string (`text`) up to the end of the line.
    let block = block.split_once('\n').map_or(block, |(_, rest)| rest);
    let mut paths = Vec::new();
    let mut parent = PathBuf::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if line.starts_with(' ') {
            paths.push(parent.join(name));
        } else {
            parent = PathBuf::from(name);
            paths.push(parent.clone());
        }
    }
    paths
}

#[test]
fn every_path_in_the_layout_block_exists() {
    let paths = layout_paths(&readme());
    assert!(paths.len() >= 10, "the layout block was read: {paths:?}");
    let missing: Vec<&PathBuf> = paths.iter().filter(|p| !repo().join(p).exists()).collect();
    assert!(
        missing.is_empty(),
        "README layout names paths that do not exist: {missing:?}"
    );
    assert!(
        paths.contains(&PathBuf::from("src/producer/")),
        "nested entries are read under their parent: {paths:?}"
    );
}

/// The relative link targets of a Markdown text: `[text](target)`, without web
/// addresses and in-page anchors.
fn relative_links(markdown: &str) -> Vec<&str> {
    markdown
        .split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .filter(|t| !t.contains("://") && !t.starts_with('#'))
        .collect()
}

/// The anchors GitHub gives a Markdown file's headings: lower case, spaces as `-`,
/// punctuation other than `-` and `_` left out.
fn heading_anchors(markdown: &str) -> Vec<String> {
    markdown
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// Checks every relative link of `markdown`, a file in `dir`: the file exists and,
/// with a fragment, has a heading of that anchor.
fn check_links(file: &str, dir: &Path, markdown: &str) {
    for target in relative_links(markdown) {
        let (path, fragment) = target.split_once('#').unwrap_or((target, ""));
        assert!(!path.starts_with('/'), "{file}: {target}: an absolute path");
        let resolved = dir.join(path);
        assert!(resolved.exists(), "{file}: {target}: no such file");
        if !fragment.is_empty() {
            let text = std::fs::read_to_string(&resolved).expect("a linked page is readable");
            assert!(
                heading_anchors(&text).iter().any(|a| a == fragment),
                "{file}: {target}: no heading with that anchor"
            );
        }
    }
}

/// The reference pages: every `.md` file under `docs/`.
fn doc_pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/ is readable")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    pages
}

#[test]
fn relative_links_point_into_the_repository() {
    let readme = readme();
    assert!(
        !readme.contains("../"),
        "the README refers to a path outside the repository (a reader of the repository \
         alone cannot follow it)"
    );
    let targets = relative_links(&readme);
    assert!(
        targets.contains(&"docs/emulators.md"),
        "links were read: {targets:?}"
    );
    check_links("README.md", repo(), &readme);
}

#[test]
fn the_reference_pages_link_within_the_repository_and_the_readme_links_each() {
    let pages = doc_pages();
    assert!(pages.len() >= 5, "the pages were found: {pages:?}");
    let readme = readme();
    let linked = relative_links(&readme);
    for page in &pages {
        let name = page
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let text = std::fs::read_to_string(page).expect("a page is readable");
        check_links(name, &repo().join("docs"), &text);
        assert!(
            linked
                .iter()
                .any(|t| t.split('#').next() == Some(&format!("docs/{name}"))),
            "the README does not link docs/{name}: a reader cannot find it"
        );
    }
}

#[test]
fn anchors_are_read_as_github_makes_them() {
    let anchors = heading_anchors("# Title\n## Many streams\ntext\n### Deadlines: nothing hangs");
    assert_eq!(
        anchors,
        ["title", "many-streams", "deadlines-nothing-hangs"]
    );
}
