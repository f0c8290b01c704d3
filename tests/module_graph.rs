//! The core crate's modules import each other without cycles: between two sibling
//! modules (two files, or two folders under one parent), imports go one way only. A
//! re-export is followed to the file that defines the item, so `use crate::Message`
//! depends on `message.rs`, not on `lib.rs`; code under `#[cfg(test)]` counts too (a
//! unit test that imports a module above its own closes a cycle like any other import).
//! `scripts/module_graph.py` prints the same graph, with its edges, for a reader. No file
//! names an item through the crate root's re-exports (that imports from the module
//! above). The middleware crate is held to the same rules, with the pairs of modules that
//! still import each other listed: a new pair fails.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Module = Vec<String>;

/// Module path -> source text without comments and strings.
fn read_crate(src: &Path) -> BTreeMap<Module, String> {
    let mut files = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path
                .strip_prefix(src)
                .expect("under src/")
                .with_extension("");
            let mut module: Module = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).expect("a source file");
            files.insert(module, plain_code(&text));
        }
    }
    files
}

/// The text with comments removed and string and character literals emptied.
fn plain_code(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        let at = |j: usize| c.get(j).copied().unwrap_or(' ');
        if c[i] == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c[i] == 'r'
            && (at(i + 1) == '"' || at(i + 1) == '#')
            && (i == 0 || !(c[i - 1].is_alphanumeric() || c[i - 1] == '_'))
        {
            let hashes = (1..).take_while(|&k| at(i + k) == '#').count();
            if at(i + 1 + hashes) != '"' {
                out.push(c[i]);
                i += 1;
                continue;
            }
            i += 2 + hashes;
            while i < c.len() && !(c[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#')) {
                i += 1;
            }
            i += 1 + hashes;
            out.push_str("\"\"");
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' && (at(i + 1) == '\\' || at(i + 2) == '\'') {
            i += if at(i + 1) == '\\' { 2 } else { 1 };
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The paths of a use tree (`a::{b, c::d as e}`), each with its alias.
fn expand_use(tree: &str) -> Vec<(Vec<String>, Option<String>)> {
    fn walk(prefix: &[String], tree: &str, out: &mut Vec<(Vec<String>, Option<String>)>) {
        let tree = tree.trim();
        if let (Some(open), true) = (tree.find('{'), tree.ends_with('}')) {
            let mut head = prefix.to_vec();
            head.extend(split_path(tree[..open].trim_end_matches(':')));
            let inner = &tree[open + 1..tree.len() - 1];
            let (mut depth, mut start) = (0, 0);
            for (k, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        walk(&head, &inner[start..k], out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            walk(&head, &inner[start..], out);
            return;
        }
        let (path, alias) = match tree.split_once(" as ") {
            Some((path, alias)) => (path, Some(alias.trim().to_owned())),
            None => (tree, None),
        };
        let mut full = prefix.to_vec();
        full.extend(split_path(path).filter(|s| s != "self"));
        if !full.is_empty() {
            out.push((full, alias));
        }
    }
    let mut out = Vec::new();
    walk(
        &[],
        &tree.split_whitespace().collect::<Vec<_>>().join(" "),
        &mut out,
    );
    out
}

fn split_path(path: &str) -> impl Iterator<Item = String> + '_ {
    path.split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// An absolute module path for `path` as written in `module`; `None` for another crate.
fn absolute(
    path: &[String],
    module: &[String],
    files: &BTreeMap<Module, String>,
) -> Option<Module> {
    let first = path.first()?;
    let mut child = module.to_vec();
    child.push(first.clone());
    if files.contains_key(&child) {
        let mut full = module.to_vec();
        full.extend(path.iter().cloned());
        return Some(full);
    }
    match first.as_str() {
        "crate" => Some(path[1..].to_vec()),
        "super" | "self" => {
            let mut base = module.to_vec();
            let mut k = 0;
            while k < path.len() && (path[k] == "super" || path[k] == "self") {
                if path[k] == "super" {
                    base.pop();
                }
                k += 1;
            }
            base.extend(path[k..].iter().cloned());
            Some(base)
        }
        _ => None,
    }
}

struct Crate {
    files: BTreeMap<Module, String>,
    /// Per module: the names its top-level `use`s bring in, as absolute paths.
    aliases: BTreeMap<Module, BTreeMap<String, Module>>,
    /// Per module: the absolute paths it names.
    uses: BTreeMap<Module, Vec<Module>>,
}

impl Crate {
    fn read(src: &Path) -> Self {
        let files = read_crate(src);
        let mut aliases = BTreeMap::new();
        let mut uses = BTreeMap::new();
        for (module, code) in &files {
            let (mut names, mut found) = (BTreeMap::new(), Vec::new());
            // Inline modules: their names and the brace depth they open at.
            let mut inline: Vec<(String, usize)> = Vec::new();
            let mut depth = 0;
            let bytes = code.as_bytes();
            let mut i = 0;
            while i < code.len() {
                let word_start =
                    i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
                let here = &code[i..];
                let mut inner = module.clone();
                inner.extend(inline.iter().map(|(name, _)| name.clone()));
                if word_start && here.starts_with("use ") {
                    let end = here.find(';').unwrap_or(here.len());
                    for (path, alias) in expand_use(&here[4..end]) {
                        if let Some(target) = absolute(&path, &inner, &files) {
                            if inline.is_empty() {
                                if let Some(name) = alias.or_else(|| target.last().cloned()) {
                                    if name != "*" {
                                        names.insert(name, target.clone());
                                    }
                                }
                            }
                            found.push(target);
                        }
                    }
                    i += end;
                    continue;
                }
                if word_start
                    && ["crate::", "super::", "self::"]
                        .iter()
                        .any(|p| here.starts_with(p))
                {
                    let end = here
                        .find(|ch: char| !(ch.is_alphanumeric() || ch == '_' || ch == ':'))
                        .unwrap_or(here.len());
                    let path: Vec<String> = split_path(&here[..end]).collect();
                    if let Some(target) = absolute(&path, &inner, &files) {
                        found.push(target);
                    }
                    i += end;
                    continue;
                }
                if word_start && here.starts_with("mod ") {
                    let rest = here[4..].trim_start();
                    let name: String = rest
                        .chars()
                        .take_while(|ch| ch.is_alphanumeric() || *ch == '_')
                        .collect();
                    if rest[name.len()..].trim_start().starts_with('{') {
                        inline.push((name, depth + 1));
                    }
                }
                match bytes[i] {
                    b'{' => depth += 1,
                    b'}' => {
                        if inline.last().is_some_and(|(_, d)| *d == depth) {
                            inline.pop();
                        }
                        depth -= 1;
                    }
                    _ => {}
                }
                i += here.chars().next().map_or(1, char::len_utf8);
            }
            aliases.insert(module.clone(), names);
            uses.insert(module.clone(), found);
        }
        Crate {
            files,
            aliases,
            uses,
        }
    }

    /// The module whose file defines the item `path` names.
    fn resolve(&self, path: &[String], hops: usize) -> Module {
        let path: Vec<String> = path.iter().filter(|s| *s != "*").cloned().collect();
        let mut k = path.len();
        while k > 0 && !self.files.contains_key(&path[..k]) {
            k -= 1;
        }
        let module = path[..k].to_vec();
        if k == path.len() || hops > 10 {
            return module;
        }
        match self.aliases.get(&module).and_then(|a| a.get(&path[k])) {
            Some(target) if *target != path => {
                let mut next = target.clone();
                next.extend(path[k + 1..].iter().cloned());
                self.resolve(&next, hops + 1)
            }
            _ => module,
        }
    }

    /// Edges between sibling modules under their deepest common parent.
    fn sibling_edges(&self) -> BTreeMap<Module, BTreeSet<Module>> {
        let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
        for (from, targets) in &self.uses {
            for target in targets {
                let to = self.resolve(target, 0);
                let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
                if common == from.len() || common == to.len() {
                    continue; // a module and its own parts
                }
                edges
                    .entry(from[..=common].to_vec())
                    .or_default()
                    .insert(to[..=common].to_vec());
            }
        }
        edges
    }
}

/// The groups of two or more modules that import each other, directly or around.
fn cycles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    let reach = |start: &Module| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![start.clone()];
        while let Some(m) = todo.pop() {
            for next in edges.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&Module, BTreeSet<Module>> =
        edges.keys().map(|m| (m, reach(m))).collect();
    let mut groups: Vec<Vec<Module>> = Vec::new();
    for (m, r) in &reaches {
        if !r.contains(*m) || groups.iter().any(|g| g.contains(*m)) {
            continue;
        }
        let group = reaches
            .iter()
            .filter(|(o, ro)| r.contains(**o) && ro.contains(*m))
            .map(|(o, _)| (*o).clone())
            .collect();
        groups.push(group);
    }
    groups
}

fn name(m: &Module) -> String {
    format!("crate::{}", m.join("::"))
}

#[test]
fn sibling_modules_import_each_other_one_way_only() {
    let krate = Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(krate.files.len() >= 20, "the crate's files were read");
    let edges = krate.sibling_edges();
    assert!(
        edges
            .get(&vec!["consumer".to_owned()])
            .is_some_and(|to| to.contains(&vec!["message".to_owned()])),
        "the consumer's import of message is seen: {edges:?}"
    );
    let found: Vec<Vec<String>> = cycles(&edges)
        .iter()
        .map(|group| group.iter().map(name).collect())
        .collect();
    assert!(
        found.is_empty(),
        "modules that import each other (scripts/module_graph.py shows the edges): {found:?}"
    );
}

/// Paths in files other than the crate root that name an item through one of the root's
/// re-exports (`crate::Message` rather than `crate::message::Message`): a module that
/// does so imports from the module above it.
fn through_root_reexports(krate: &Crate) -> Vec<String> {
    let root = krate.aliases.get(&Vec::new()).cloned().unwrap_or_default();
    let mut found = Vec::new();
    for (module, targets) in &krate.uses {
        if module.is_empty() {
            continue;
        }
        for target in targets {
            let Some(first) = target.first() else {
                continue;
            };
            if root.contains_key(first) && !krate.files.contains_key(&vec![first.clone()]) {
                found.push(format!(
                    "{} names crate::{}",
                    name(module),
                    target.join("::")
                ));
            }
        }
    }
    found
}

#[test]
fn modules_import_items_from_their_modules_not_from_the_crate_root() {
    let krate = Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let found = through_root_reexports(&krate);
    assert!(found.is_empty(), "{found:?}");
}

/// Sibling modules of the middleware crate that still import each other directly: the
/// default dead-letter policy names the transient errors of the layers that use it
/// (batch, produce), and the retry layer reports its attempts to the dead-letter layer
/// whose tests stack the two. No pair may be added; bisect, the builder and the split
/// setting are in no cycle at all.
const MIDDLEWARE_MUTUAL: [(&str, &str); 3] = [
    ("batch", "dead_letter"),
    ("dead_letter", "produce"),
    ("dead_letter", "retry"),
];

#[test]
fn middleware_modules_import_each_other_one_way_only() {
    let krate = Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("middleware/src"));
    assert!(krate.files.len() >= 20, "the middleware's files were read");
    let edges = krate.sibling_edges();
    let module = |m: &str| vec![m.to_owned()];
    assert!(
        edges
            .get(&module("bisect"))
            .is_some_and(|to| to.contains(&module("dead_letter"))),
        "bisect's import of the dead-letter policy is seen: {edges:?}"
    );
    let in_cycles: Vec<Vec<String>> = cycles(&edges)
        .iter()
        .map(|group| group.iter().map(name).collect())
        .collect();
    for layer in ["bisect", "builder", "splits"] {
        assert!(
            !in_cycles
                .iter()
                .flatten()
                .any(|m| *m == name(&module(layer))),
            "{layer} is in a cycle: {in_cycles:?}"
        );
    }
    let mut mutual = Vec::new();
    for (from, targets) in &edges {
        for to in targets {
            let back = edges.get(to).is_some_and(|t| t.contains(from));
            if back && from < to {
                mutual.push((name(from), name(to)));
            }
        }
    }
    let known: Vec<(String, String)> = MIDDLEWARE_MUTUAL
        .iter()
        .map(|(a, b)| (name(&module(a)), name(&module(b))))
        .collect();
    let new: Vec<_> = mutual.iter().filter(|pair| !known.contains(pair)).collect();
    assert!(
        new.is_empty(),
        "middleware modules that import each other (scripts/module_graph.py middleware/src shows the edges): {new:?}"
    );
    assert!(
        through_root_reexports(&krate).is_empty(),
        "{:?}",
        through_root_reexports(&krate)
    );
}

#[test]
fn a_cycle_is_found() {
    let edge = |a: &str, b: &str| (vec![a.to_owned()], BTreeSet::from([vec![b.to_owned()]]));
    let edges = BTreeMap::from([edge("a", "b"), edge("b", "c"), edge("c", "a")]);
    assert_eq!(cycles(&edges).len(), 1);
    let edges = BTreeMap::from([edge("a", "b"), edge("b", "c")]);
    assert!(cycles(&edges).is_empty());
    let uses = expand_use("crate::{a::{B, C as D}, e}");
    assert_eq!(uses.len(), 3);
    assert_eq!(uses[1].1.as_deref(), Some("D"));
}
