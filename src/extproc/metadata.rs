//! Reading the proxy's metadata: the subset hint and the endpoint that actually served a request.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{value::Kind, Value};

use super::response::{LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE};

/// The subset hint of one request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Subset {
    /// No hint: pick from the whole pool.
    #[default]
    Unset,
    /// Only these endpoints (entries that are not `ip:port` are dropped, so they never match).
    Only(Vec<SocketAddr>),
}

fn lookup<'a>(md: &'a Metadata, namespace: &str, key: &str) -> Option<&'a Value> {
    md.filter_metadata.get(namespace)?.fields.get(key)
}

/// Addresses in a metadata value: a list of strings, or one string (comma-separated allowed).
fn addresses(v: &Value, out: &mut Vec<SocketAddr>) {
    match &v.kind {
        Some(Kind::StringValue(s)) => {
            out.extend(
                s.split(',')
                    .filter_map(|p| p.trim().parse::<SocketAddr>().ok()),
            );
        }
        Some(Kind::ListValue(list)) => {
            for item in &list.values {
                addresses(item, out);
            }
        }
        _ => {}
    }
}

pub(crate) fn subset_hint(md: Option<&Metadata>) -> Subset {
    let Some(v) = md.and_then(|md| lookup(md, SUBSET_NAMESPACE, SUBSET_KEY)) else {
        return Subset::Unset;
    };
    let mut out = Vec::new();
    addresses(v, &mut out);
    Subset::Only(out)
}

/// `envoy.lb` → `x-gateway-destination-endpoint-served`, when the proxy reports it.
pub(crate) fn served_endpoint(md: Option<&Metadata>) -> Option<SocketAddr> {
    let v = lookup(md?, LB_NAMESPACE, SERVED_KEY)?;
    let mut out = Vec::new();
    addresses(v, &mut out);
    out.first().copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{ListValue, Struct};

    fn md(ns: &str, key: &str, v: Value) -> Metadata {
        let mut inner = Struct::default();
        inner.fields.insert(key.into(), v);
        let mut m = Metadata::default();
        m.filter_metadata.insert(ns.into(), inner);
        m
    }

    fn s(x: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(x.into())),
        }
    }

    #[test]
    fn subset_forms() {
        assert_eq!(subset_hint(None), Subset::Unset);
        assert_eq!(
            subset_hint(Some(&md("other", SUBSET_KEY, s("1.2.3.4:5")))),
            Subset::Unset
        );
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![s("10.0.0.1:80"), s("garbage"), s("[::1]:9")],
            })),
        };
        assert_eq!(
            subset_hint(Some(&md(SUBSET_NAMESPACE, SUBSET_KEY, list))),
            Subset::Only(vec![
                "10.0.0.1:80".parse().unwrap(),
                "[::1]:9".parse().unwrap()
            ])
        );
        let empty = Value {
            kind: Some(Kind::ListValue(ListValue::default())),
        };
        assert_eq!(
            subset_hint(Some(&md(SUBSET_NAMESPACE, SUBSET_KEY, empty))),
            Subset::Only(vec![])
        );
        assert_eq!(
            subset_hint(Some(&md(
                SUBSET_NAMESPACE,
                SUBSET_KEY,
                s("10.0.0.1:80, 10.0.0.2:80")
            ))),
            Subset::Only(vec![
                "10.0.0.1:80".parse().unwrap(),
                "10.0.0.2:80".parse().unwrap()
            ])
        );
        let num = Value {
            kind: Some(Kind::NumberValue(1.0)),
        };
        assert_eq!(
            subset_hint(Some(&md(SUBSET_NAMESPACE, SUBSET_KEY, num))),
            Subset::Only(vec![])
        );
    }

    #[test]
    fn served() {
        assert_eq!(
            served_endpoint(Some(&md(LB_NAMESPACE, SERVED_KEY, s("10.0.0.2:8000")))),
            Some("10.0.0.2:8000".parse().unwrap())
        );
        assert_eq!(
            served_endpoint(Some(&md(LB_NAMESPACE, "other", s("10.0.0.2:8000")))),
            None
        );
    }
}
