//! Predicates written once and composed into the statements (and into the additive index
//! they match) when the statements are rendered.
//!
//! Each fragment is a file under `src/sql/fragments/`, its meaning and its plan rule
//! documented at its top. A statement names one as `{name:alias}`: the fragment's `@` stands
//! for the alias (`{in_line:e}` reads `(e.scheduled_at <= now() OR …)`; an empty alias gives
//! bare column names, as an index predicate needs). A fragment may name other fragments and
//! the statement's bind parameters by name (`{lease_us}`, `{topics}`, …), which the statement
//! supplies with its parts (see `Statements::new`).
//!
//! The fragments carry the plan rules of the relay's statements, so that no statement's cost
//! depends on the planner's statistics (a fresh table never analysed, statistics taken when
//! the table was small, or fresh ones):
//!
//! * `window` is the predicate of the additive index `idx_<t>_pending_window`, whose order is
//!   the fetch window's `ORDER BY`, and the only index predicate the window implies;
//! * `pending` states "pending" so that it implies no partial index's predicate: reads by id go
//!   through the primary key, reads of leased rows through `idx_<t>_locked_at`;
//! * `key_order` is the predicate of `idx_<t>_pending_key_order`, for the reads that walk a
//!   key's line with the key in the index condition;
//! * `lease_free` is one comparison, never an OR the planner could turn into a bitmap OR over
//!   the partial indexes;
//! * `earlier` reads a key's line ordered by (`key_first`, created_at), an order only
//!   `idx_<t>_pending_key_order` yields, with the key (`same_key`) in its index condition.
//!
//! The inbox table (`crate::inbox::sql`) replaces `same_key` and `key_first` with its own key
//! and adds fragments of its own (the fetch window's two ranges) through [`expand_with`].

/// The fragment files, by name.
const FRAGMENTS: [(&str, &str); 10] = [
    ("in_line", include_str!("fragments/in_line.sql")),
    ("key_order", include_str!("fragments/key_order.sql")),
    ("pending", include_str!("fragments/pending.sql")),
    ("window", include_str!("fragments/window.sql")),
    ("lease_free", include_str!("fragments/lease_free.sql")),
    ("filters", include_str!("fragments/filters.sql")),
    ("due", include_str!("fragments/due.sql")),
    ("earlier", include_str!("fragments/earlier.sql")),
    ("key_first", include_str!("fragments/key_first.sql")),
    ("same_key", include_str!("fragments/same_key.sql")),
];

/// How deep fragments may name fragments.
const MAX_DEPTH: usize = 8;

/// SQL text without its comment lines (`--` first on the line).
pub(crate) fn strip(s: &str) -> String {
    s.lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_owned()
}

/// The fragment `name` with its `@` replaced by `alias` (columns `alias.col`, or bare columns
/// when `alias` is empty); fragments it names are left for [`expand`].
fn instance(text: &str, alias: &str) -> String {
    let dot = if alias.is_empty() {
        String::new()
    } else {
        format!("{alias}.")
    };
    strip(text)
        .replace("@.", &dot)
        .replace(":@}", &format!(":{alias}}}"))
}

/// One pass over `body`: every `{name:alias}` of a known fragment replaced by its instance,
/// a fragment of `overrides` in place of the one of that name; the other fragments of
/// `overrides` are the table's own, known to its statements only.
fn expand_fragments(body: &str, overrides: &[(&str, &str)]) -> String {
    let mut out = body.to_owned();
    let own = overrides
        .iter()
        .filter(|(n, _)| FRAGMENTS.iter().all(|(f, _)| f != n))
        .copied();
    for (name, default) in FRAGMENTS.into_iter().chain(own) {
        let text = overrides
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(default, |(_, t)| *t);
        let open = format!("{{{name}:");
        while let Some(at) = out.find(&open) {
            let rest = &out[at + open.len()..];
            let Some(end) = rest.find('}') else { break };
            let alias = rest[..end].to_owned();
            let whole = format!("{open}{alias}}}");
            out = out.replacen(&whole, &instance(text, &alias), 1);
        }
    }
    out
}

/// `body` with every part `{name}` of `parts` and every fragment `{name:alias}` substituted,
/// fragments inside fragments included. Comment lines of parts are dropped.
pub(crate) fn expand(body: &str, parts: &[(&str, &str)]) -> String {
    expand_with(body, parts, &[])
}

/// [`expand`] with some fragments replaced by other texts of the same meaning for another
/// table: the inbox table names its key (consumer_group, source, partition_key) in `same_key`
/// and `key_first`, so that the outbox's `earlier` probe serves it unchanged. A fragment of `overrides` whose name
/// is no shared fragment's is added for this expansion (the inbox's window ranges).
pub(crate) fn expand_with(
    body: &str,
    parts: &[(&str, &str)],
    overrides: &[(&str, &str)],
) -> String {
    let mut body = body.to_owned();
    for _ in 0..MAX_DEPTH {
        let before = body.clone();
        for (name, text) in parts {
            body = body.replace(&format!("{{{name}}}"), &strip(text));
        }
        body = expand_fragments(&body, overrides);
        if body == before {
            break;
        }
    }
    body
}

/// The fragment `name` for `alias`, fully expanded (no parts: for fragments that name no bind
/// parameter, such as the index predicate `window`).
///
/// # Panics
///
/// When `name` is not a fragment (a programming error caught by the unit tests).
pub(crate) fn fragment(name: &str, alias: &str) -> String {
    let text = FRAGMENTS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no SQL fragment {name}"))
        .1;
    expand(&instance(text, alias), &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_expand_with_their_alias_and_parts() {
        assert_eq!(
            fragment("window", ""),
            "status COLLATE \"C\" = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts"
        );
        let due = expand("{due:l}", &[("lease_us", "$3::int8")]);
        assert!(
            due.starts_with("l.scheduled_at <= now() AND l.attempts_made"),
            "{due}"
        );
        assert!(
            due.contains("COALESCE(l.locked_at, '-infinity'::timestamptz) < now() - $3::int8"),
            "{due}"
        );
        let probe = expand("({earlier:h})", &[]);
        assert!(
            probe.contains("e.topic = ANY(ARRAY[h.topic]) AND e.partition_key = h.partition_key")
                && probe.contains("(e.scheduled_at <= now()"),
            "{probe}"
        );
        let rest = probe.replace("{table}", "");
        assert!(!rest.contains('{') && !rest.contains('@'), "{probe}");
        for (name, text) in FRAGMENTS {
            let body = strip(text);
            assert!(!body.is_empty() && !body.contains("--"), "{name}");
        }
    }
}
