//! The configuration reference, `docs/configuration.md`, generated from the configuration types
//! (a test module: it checks the document, and `KVEPP_WRITE_DOCS=1` rewrites it; no binary has it):
//! every field of the file (from the types' JSON schema, whose descriptions are the fields' doc
//! comments, with the defaults of [`Config::default`]), every flag and environment variable of each
//! subcommand (from their `clap` definitions), and the variables read outside the flags.
//!
//! Invariants: the document is a pure function of the code; a field, flag or variable without its
//! documentation is reported by name in [`Reference::undocumented`] (the test beside this module
//! fails on it, and on a document that differs from [`reference()`]'s output). The variables read
//! outside the flags are listed in [`ENV_OVERRIDES`]; the names the code actually reads are
//! recorded through its getters and compared with that list.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde_json::Value;

use crate::config::{self, Config};

/// The generated document and what it could not document.
#[derive(Debug, Clone)]
pub struct Reference {
    pub markdown: String,
    /// Paths (`router.temperature`, `--pool-name`, `DYN_ROUTER_TEMPERATURE`) lacking documentation.
    pub undocumented: Vec<String>,
}

/// Environment variables read outside the flags: (name, what it sets).
pub const ENV_OVERRIDES: &[(&str, &str)] = &[
    (
        "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
        "`router.overlap_score_credit`",
    ),
    (
        "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",
        "`router.host_cache_hit_weight`",
    ),
    (
        "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",
        "`router.disk_cache_hit_weight`",
    ),
    (
        "DYN_ROUTER_PREFILL_LOAD_SCALE",
        "`router.prefill_load_scale`",
    ),
    (
        "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
        "`router.decode_active_request_weight`",
    ),
    ("DYN_ROUTER_TEMPERATURE", "`router.temperature`"),
    (
        "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
        "deprecated: `router.prefill_load_scale` (0 also zeroes `router.overlap_score_credit`)",
    ),
    (
        "DYN_OVERLAP_SCORE_WEIGHT",
        "deprecated: as `DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT`",
    ),
    (
        "DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL",
        "`disaggregation.kv_transfer_topology_level` (empty: unset)",
    ),
    (
        "DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY",
        "`disaggregation.kv_transfer_mismatch_policy` (`fail` or `fallback`)",
    ),
    (
        "DYN_ROUTER_KV_TRANSFER_WEIGHT",
        "`disaggregation.kv_transfer_weight`",
    ),
    ("OTEL_SDK_DISABLED", "`true` turns tracing off"),
    (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "`tracing.protocol` (`grpc` or `http/protobuf`)",
    ),
    (
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "`tracing.protocol`, when the traces-specific variable is unset",
    ),
    (
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "`tracing.otlp_endpoint`",
    ),
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "`tracing.otlp_endpoint` (`/v1/traces` appended for `http/protobuf`)",
    ),
    ("OTEL_SERVICE_NAME", "`tracing.service_name`"),
    ("OTEL_TRACES_SAMPLER", "`tracing.sampler`"),
    ("OTEL_TRACES_SAMPLER_ARG", "`tracing.sampler_arg`"),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "`tracing.max_queue_size`"),
    ("OTEL_BSP_SCHEDULE_DELAY", "`tracing.schedule_delay_ms`"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "`tracing.export_timeout_ms`"),
];

/// The subcommands whose flags the reference lists, with the `clap` definitions of their flags.
fn subcommands() -> Vec<(&'static str, clap::Command)> {
    use clap::Args;
    vec![
        (
            "serve",
            config::ServeArgs::augment_args(clap::Command::new("serve")),
        ),
        (
            "worker-agent",
            crate::agent::AgentArgs::augment_args(clap::Command::new("worker-agent")),
        ),
        (
            "select-service",
            crate::standalone::SelectArgs::augment_args(clap::Command::new("select-service")),
        ),
        (
            "slot-tracker",
            crate::standalone::SlotTrackerArgs::augment_args(clap::Command::new("slot-tracker")),
        ),
    ]
}

/// The names the code reads outside the flags, recorded through its getters.
fn env_names_read() -> BTreeSet<String> {
    let read = std::cell::RefCell::new(BTreeSet::new());
    let record = |k: &str| -> Option<String> {
        read.borrow_mut().insert(k.to_owned());
        None
    };
    let cfg = Config::default();
    let _ = config::router_knobs_from_env(cfg.router, record);
    let mut transfer = cfg.disaggregation.clone();
    let _ = config::transfer_from_env(&mut transfer, record);
    let _ = cfg.tracing.clone().apply_env(record);
    read.into_inner()
}

/// Renders the reference.
pub fn reference() -> Reference {
    // Both are plain data (maps, strings, numbers): serializing them cannot fail.
    let schema = serde_json::to_value(schemars::schema_for!(Config)).unwrap_or_default();
    let defaults = serde_json::to_value(Config::default()).unwrap_or_default();
    let mut r = Render {
        defs: schema.get("$defs").cloned().unwrap_or(Value::Null),
        out: String::new(),
        undocumented: Vec::new(),
    };
    r.out.push_str(HEADER);
    r.out.push_str("\n## The configuration file\n\n");
    r.out.push_str(
        "Top-level fields; each section follows. A field left out keeps its default; unknown \
         fields are refused.\n\n",
    );
    r.section(&schema, "", &defaults);
    r.flags();
    r.env_overrides();
    Reference {
        markdown: r.out,
        undocumented: r.undocumented,
    }
}

const HEADER: &str = "# Configuration reference

<!-- Generated from the configuration types (src/reference.rs); edit the doc comments, then
     run `KVEPP_WRITE_DOCS=1 cargo test -p kvepp --lib reference::`. -->

Every kvepp binary reads one configuration tree. Precedence, lowest to highest: the defaults below →
the `--config` file (YAML or JSON) → environment variables → command-line flags. `kvepp config`
prints the effective tree as YAML; every bad field is reported at start, each with its own message.
";

struct Render {
    defs: Value,
    out: String,
    undocumented: Vec<String>,
}

impl Render {
    /// Follows `$ref` (and the non-null arm of an optional's `anyOf`) to the schema it names.
    fn resolve<'a>(&'a self, mut s: &'a Value) -> &'a Value {
        loop {
            if let Some(r) = s.get("$ref").and_then(Value::as_str) {
                let name = r.rsplit('/').next().unwrap_or(r);
                match self.defs.get(name) {
                    Some(d) => s = d,
                    None => return s,
                }
            } else if let Some(arms) = s.get("anyOf").and_then(Value::as_array) {
                match arms.iter().find(|a| a.get("type") != Some(&"null".into())) {
                    Some(a) if arms.len() == 2 => s = a,
                    _ => return s,
                }
            } else {
                return s;
            }
        }
    }

    fn is_struct(&self, s: &Value) -> bool {
        self.resolve(s).get("properties").is_some()
    }

    /// One table of `schema`'s fields, then a section for each field that is itself a struct.
    fn section(&mut self, schema: &Value, prefix: &str, defaults: &Value) {
        let schema = self.resolve(schema).clone();
        let Some(props) = schema.get("properties").and_then(Value::as_object) else {
            return;
        };
        let mut nested = Vec::new();
        self.out
            .push_str("| field | type | default | meaning |\n|---|---|---|---|\n");
        for (name, prop) in props {
            let path = format!("{prefix}{name}");
            let doc = description(prop);
            if doc.is_empty() {
                self.undocumented.push(path.clone());
            }
            let default = defaults.get(name).unwrap_or(&Value::Null);
            if self.is_struct(prop) {
                let _ = writeln!(
                    self.out,
                    "| `{path}` | section | see [`{path}`](#{anchor}) | {doc} |",
                    anchor = path.replace('.', "")
                );
                nested.push((path, prop.clone(), default.clone(), doc));
            } else {
                let _ = writeln!(
                    self.out,
                    "| `{path}` | {ty} | {default} | {doc} |",
                    ty = self.type_name(prop),
                    default = show_default(default),
                );
            }
        }
        for (path, prop, default, doc) in nested {
            let _ = write!(self.out, "\n### `{path}`\n\n{doc}\n\n");
            self.section(&prop, &format!("{path}."), &default);
        }
    }

    /// A field's type as the file spells it: `integer`, `string`, `` `a` \| `b` ``, `list of …`.
    fn type_name(&self, prop: &Value) -> String {
        let s = self.resolve(prop);
        if let Some(values) = enum_values(s) {
            return values
                .iter()
                .map(|v| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(" \\| ");
        }
        let ty = match s.get("type") {
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(ts)) => ts
                .iter()
                .filter_map(Value::as_str)
                .find(|t| *t != "null")
                .unwrap_or("any")
                .to_owned(),
            _ => "any".to_owned(),
        };
        match ty.as_str() {
            "array" => match s.get("items") {
                Some(items) => format!("list of {}", self.type_name(items)),
                None => "list".into(),
            },
            "object" => match s.get("additionalProperties") {
                Some(v) if v.is_object() => format!("map of {}", self.type_name(v)),
                _ => "map".into(),
            },
            "string" => match s.get("format").and_then(Value::as_str) {
                Some("ip") => "IP address".into(),
                _ => "string".into(),
            },
            "integer" | "number" | "boolean" => ty,
            other => other.to_owned(),
        }
    }

    fn flags(&mut self) {
        self.out.push_str(
            "\n## Flags and environment variables\n\nEach flag overrides the file; its \
             environment variable (where it has one) sits between the file and the flag. \
             `kvepp config` and `kvepp envoy-config` take `serve`'s flags; the `kvepp-agent` \
             binary takes `worker-agent`'s.\n",
        );
        for (name, cmd) in subcommands() {
            let _ = write!(
                self.out,
                "\n### `kvepp {name}`\n\n| flag | environment | default | meaning |\n|---|---|---|---|\n"
            );
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                let help = arg
                    .get_long_help()
                    .or(arg.get_help())
                    .map(|h| one_line(&h.to_string()))
                    .unwrap_or_default();
                if help.is_empty() {
                    self.undocumented.push(format!("kvepp {name} --{long}"));
                }
                let env = arg
                    .get_env()
                    .map(|e| format!("`{}`", e.to_string_lossy()))
                    .unwrap_or_default();
                let defaults: Vec<String> = arg
                    .get_default_values()
                    .iter()
                    .map(|v| format!("`{}`", v.to_string_lossy()))
                    .collect();
                let values: Vec<String> = arg
                    .get_possible_values()
                    .iter()
                    .filter(|v| !v.is_hide_set())
                    .map(|v| format!("`{}`", v.get_name()))
                    .collect();
                let takes_value = arg.get_num_args().is_some_and(|n| n.takes_values());
                let flag = match (takes_value, values.is_empty()) {
                    (false, _) => format!("`--{long}`"),
                    (true, false) => format!("`--{long}` {}", values.join(" \\| ")),
                    (true, true) => {
                        let value = arg
                            .get_value_names()
                            .and_then(|n| n.first())
                            .map(|n| n.to_string())
                            .unwrap_or_else(|| long.to_uppercase().replace('-', "_"));
                        format!("`--{long} {value}`")
                    }
                };
                let default = if defaults.is_empty() {
                    "the file's".to_owned()
                } else {
                    defaults.join(", ")
                };
                let _ = writeln!(self.out, "| {flag} | {env} | {default} | {help} |");
            }
        }
    }

    fn env_overrides(&mut self) {
        self.out.push_str(
            "\n## Environment variables outside the flags\n\nThe variables Dynamo and \
             OpenTelemetry users already set; each overrides the file.\n\n| variable | sets |\n|---|---|\n",
        );
        let read = env_names_read();
        for (name, sets) in ENV_OVERRIDES {
            let _ = writeln!(self.out, "| `{name}` | {sets} |");
        }
        let listed: BTreeSet<String> = ENV_OVERRIDES.iter().map(|(n, _)| n.to_string()).collect();
        self.undocumented
            .extend(read.difference(&listed).map(|n| format!("environment {n}")));
        self.undocumented.extend(
            listed
                .difference(&read)
                .map(|n| format!("environment {n} (listed, not read)")),
        );
    }
}

/// The field's own doc comment, on one line (table cells hold no line breaks).
fn description(prop: &Value) -> String {
    prop.get("description")
        .and_then(Value::as_str)
        .map(one_line)
        .unwrap_or_default()
}

fn one_line(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// The values of an enum of unit variants (`enum`, or `oneOf` arms each a `const`).
fn enum_values(s: &Value) -> Option<Vec<String>> {
    if let Some(vs) = s.get("enum").and_then(Value::as_array) {
        return Some(vs.iter().map(value_text).collect());
    }
    let arms = s.get("oneOf").and_then(Value::as_array)?;
    let mut out = Vec::new();
    for arm in arms {
        if let Some(c) = arm.get("const") {
            out.push(value_text(c));
        } else if let Some(vs) = arm.get("enum").and_then(Value::as_array) {
            out.extend(vs.iter().map(value_text));
        } else {
            return None;
        }
    }
    Some(out)
}

fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn show_default(v: &Value) -> String {
    match v {
        Value::Null => "unset".into(),
        Value::String(s) if s.is_empty() => "`\"\"`".into(),
        Value::String(s) => format!("`{s}`"),
        Value::Array(a) if a.is_empty() => "none".into(),
        Value::Object(o) if o.is_empty() => "none".into(),
        other => format!("`{}`", other.to_string().replace('|', "\\|")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");

    /// docs/configuration.md is what the code generates, and nothing in the tree is undocumented.
    /// `KVEPP_WRITE_DOCS=1` rewrites the document instead of comparing.
    #[test]
    fn the_document_matches_the_configuration_types() {
        let r = reference();
        assert!(
            r.undocumented.is_empty(),
            "undocumented configuration (add a doc comment or help text): {:?}",
            r.undocumented
        );
        if std::env::var_os("KVEPP_WRITE_DOCS").is_some() {
            std::fs::write(DOC, &r.markdown).unwrap();
            return;
        }
        let on_disk = std::fs::read_to_string(DOC).unwrap_or_default();
        assert!(
            on_disk == r.markdown,
            "docs/configuration.md differs from the configuration types; regenerate it with \
             `KVEPP_WRITE_DOCS=1 cargo test -p kvepp --lib reference::`"
        );
    }

    #[derive(Default, serde::Serialize, schemars::JsonSchema)]
    struct Toy {
        /// Documented.
        a: u32,
        b: Vec<String>,
        inner: ToyInner,
    }

    #[derive(Default, serde::Serialize, schemars::JsonSchema)]
    struct ToyInner {
        /// Documented too.
        c: Option<bool>,
        d: u8,
    }

    /// A field without a doc comment is named, at any depth.
    #[test]
    fn a_field_without_a_doc_comment_is_reported() {
        let schema = serde_json::to_value(schemars::schema_for!(Toy)).unwrap();
        let mut r = Render {
            defs: schema.get("$defs").cloned().unwrap_or(Value::Null),
            out: String::new(),
            undocumented: Vec::new(),
        };
        r.section(&schema, "", &serde_json::to_value(Toy::default()).unwrap());
        assert_eq!(r.undocumented, ["b", "inner", "inner.d"]);
        assert!(
            r.out.contains("| `a` | integer | `0` | Documented. |"),
            "{}",
            r.out
        );
        assert!(
            r.out
                .contains("| `inner.c` | boolean | unset | Documented too. |"),
            "{}",
            r.out
        );
    }
}
