//! The README stays true about the repository: every path its layout block names
//! exists, and every relative link points at a file of the repository.

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

#[test]
fn relative_links_point_into_the_repository() {
    let readme = readme();
    assert!(
        !readme.contains("../"),
        "the README refers to a path outside the repository (a reader of the repository \
         alone cannot follow it)"
    );
    let targets: Vec<&str> = readme
        .split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .filter(|t| !t.contains("://") && !t.starts_with('#'))
        .collect();
    assert!(
        targets.contains(&"docs/emulators.md"),
        "links were read: {targets:?}"
    );
    for target in targets {
        let path = target.split('#').next().unwrap_or(target);
        assert!(!path.starts_with('/'), "{target}: an absolute path");
        assert!(repo().join(path).exists(), "{target}: no such file");
    }
}
