//! Reading Prometheus text exposition (what engines serve on `/metrics`): a sample's label set,
//! found by its braces outside quoted values, and its label pairs with escapes resolved. The
//! engine readers ([`super::metrics`], [`super::lora`]) parse labels only through here.

/// The label pairs of a Prometheus text-format label set (the text between the braces), with
/// escapes (`\\`, `\"`, `\n`) resolved; None if it is not well formed.
pub(crate) fn labels(set: &str) -> Option<Vec<(&str, String)>> {
    let mut out = Vec::new();
    let mut rest = set.trim_start();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let name = rest[..eq].trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return None;
        }
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        out.push((name, value));
        rest = after[end + 1..].trim_start();
        rest = match rest.strip_prefix(',') {
            Some(r) => r.trim_start(),
            None if rest.is_empty() => rest,
            None => return None,
        };
    }
    Some(out)
}

/// The label set of `line` when it is a sample of `name` (braces found outside quoted values),
/// and the rest of the line after it.
pub(crate) fn series<'a>(line: &'a str, name: &str) -> Option<(&'a str, &'a str)> {
    let body = line.strip_prefix(name)?.strip_prefix('{')?;
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in body.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some((&body[..i], &body[i + 1..])),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in label set `set` (None: absent, or the set is not well formed).
pub(crate) fn label(set: &str, key: &str) -> Option<String> {
    labels(set)?
        .into_iter()
        .find_map(|(k, v)| (k == key).then_some(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_sets_are_read_with_quotes_and_escapes() {
        assert_eq!(
            labels("a=\"1\",b=\"x,y}\""),
            Some(vec![("a", "1".to_owned()), ("b", "x,y}".to_owned())])
        );
        assert_eq!(labels("a=\"unterminated"), None);
        assert_eq!(label("k=\"v\\\"w\"", "k").as_deref(), Some("v\"w"));
        assert_eq!(label("k=\"v\"", "other"), None);
        assert_eq!(series("m{a=\"}\"} 1", "m"), Some(("a=\"}\"", " 1")));
        assert_eq!(series("m 1", "m"), None);
    }
}
