//! Tags: the name every allocation carries (default `""`), set per thread at
//! run time with [`set_thread_tag`] (C ABI `vmmalloc_set_tag`, Python
//! `with vmmalloc.region("kv_cache"):`).
//!
//! Tag names are interned process-wide into small ids (id 0 is the default
//! tag `""`); the current thread's tag is one `Cell<u32>`, so the allocation
//! fast path reads one thread-local word. The expandable allocator keeps the
//! blocks of each tag in segments of their own (see `expandable/sleep.rs`), so a
//! tag's physical chunks can be released whole.
//!
//! Valid names: at most [`MAX_TAG_LEN`] bytes of UTF-8, without `,` (lists of
//! tags are comma-separated) or control characters.

use crate::{AllocError, AllocResult};
use std::cell::Cell;
use std::sync::RwLock;

/// The longest tag name, in bytes.
pub const MAX_TAG_LEN: usize = 64;

/// Interned names; index = id. Id 0 is `""`.
static NAMES: RwLock<Vec<String>> = RwLock::new(Vec::new());

thread_local! {
    /// The calling thread's tag id.
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

/// Checks a tag name: at most [`MAX_TAG_LEN`] bytes, no `,`, no control
/// characters. `""` (the default tag) is valid.
pub fn check_tag(tag: &str) -> AllocResult<()> {
    if tag.len() > MAX_TAG_LEN {
        return Err(AllocError::Sleep(format!(
            "tag {:?} is {} bytes long; at most {MAX_TAG_LEN} are allowed",
            tag,
            tag.len()
        )));
    }
    if let Some(c) = tag.chars().find(|c| *c == ',' || c.is_control()) {
        return Err(AllocError::Sleep(format!(
            "tag {tag:?} contains {c:?}; tags may not contain ',' or control characters"
        )));
    }
    Ok(())
}

/// The id of `tag`, interning it when `intern` is set; `None` when it was never seen.
fn lookup(tag: &str, intern: bool) -> Option<u32> {
    if tag.is_empty() {
        return Some(0);
    }
    {
        let names = NAMES.read().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = names.iter().position(|n| n == tag) {
            return Some(i as u32);
        }
    }
    if !intern {
        return None;
    }
    let mut names = NAMES.write().unwrap_or_else(|p| p.into_inner());
    if names.is_empty() {
        names.push(String::new());
    }
    if let Some(i) = names.iter().position(|n| n == tag) {
        return Some(i as u32);
    }
    names.push(tag.to_string());
    Some((names.len() - 1) as u32)
}

/// Sets the calling thread's tag: later allocations on this thread carry it.
/// `""` restores the default. Fails (changing nothing) on an invalid name.
pub fn set_thread_tag(tag: &str) -> AllocResult<()> {
    check_tag(tag)?;
    let id = lookup(tag, true).unwrap_or(0);
    CURRENT.with(|c| c.set(id));
    Ok(())
}

/// The calling thread's tag (`""` by default).
pub fn thread_tag() -> String {
    tag_name(current_tag_id())
}

/// The calling thread's tag id.
#[inline]
pub(crate) fn current_tag_id() -> u32 {
    CURRENT.with(|c| c.get())
}

/// Whether some thread ever set `tag` (`""` is always known).
pub fn is_known_tag(tag: &str) -> bool {
    lookup(tag, false).is_some()
}

/// The id of a known tag; `None` if no thread ever set it.
pub(crate) fn tag_id(tag: &str) -> Option<u32> {
    lookup(tag, false)
}

/// The name of tag `id`.
pub(crate) fn tag_name(id: u32) -> String {
    if id == 0 {
        return String::new();
    }
    let names = NAMES.read().unwrap_or_else(|p| p.into_inner());
    names.get(id as usize).cloned().unwrap_or_default()
}

/// Splits a comma-separated tag list (`"weights,kv_cache"`; spaces around
/// names are trimmed; `""` = no names, meaning "all tags" to pause/resume).
/// Fails on an invalid name.
pub fn parse_tag_list(list: &str) -> AllocResult<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for t in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        check_tag(t)?;
        if !out.iter().any(|o| o == t) {
            out.push(t.to_string());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_interned_and_per_thread() {
        set_thread_tag("tags-test-a").unwrap();
        let id = current_tag_id();
        assert_ne!(id, 0);
        assert_eq!(thread_tag(), "tags-test-a");
        assert_eq!(tag_id("tags-test-a"), Some(id));
        std::thread::spawn(|| assert_eq!(thread_tag(), ""))
            .join()
            .unwrap();
        set_thread_tag("").unwrap();
        assert_eq!(current_tag_id(), 0);
        assert_eq!(tag_id("tags-test-never-set"), None);
    }

    #[test]
    fn bad_names_are_refused_and_change_nothing() {
        set_thread_tag("tags-test-b").unwrap();
        let long = "x".repeat(MAX_TAG_LEN + 1);
        assert!(set_thread_tag(&long)
            .unwrap_err()
            .to_string()
            .contains("65 bytes"));
        assert!(set_thread_tag("a,b").is_err());
        assert!(set_thread_tag("a\nb").is_err());
        assert_eq!(thread_tag(), "tags-test-b");
        assert!(set_thread_tag(&"y".repeat(MAX_TAG_LEN)).is_ok());
        set_thread_tag("").unwrap();
    }

    #[test]
    fn lists_split_on_commas() {
        assert_eq!(
            parse_tag_list(" weights, kv_cache,weights").unwrap(),
            vec!["weights".to_string(), "kv_cache".to_string()]
        );
        assert!(parse_tag_list("").unwrap().is_empty());
        assert!(parse_tag_list(&"z".repeat(65)).is_err());
    }
}
