//! The worker-agent's part of the configuration tree: `worker_agent`, the sidecar's flags by name
//! (`component: pool`, `engine_port: 8000`, `topology: [zone=a]`, …). `kvepp worker-agent` and
//! `kvepp-agent` load defaults (the flags') → `--config FILE`'s `worker_agent` → environment (the
//! flags' variables, the Downward API's among them) → flags.
//!
//! Invariants: a key of the section is a flag's name (with `_` or `-`), anything else is refused
//! naming it; a value is checked as the flag's own would be (clap's parser and message); a key
//! whose flag's variable is set in the environment yields to it.

use std::collections::BTreeMap;
use std::ffi::OsString;

use clap::{CommandFactory, FromArgMatches};

use super::{Config, ConfigError, FieldError};
use crate::agent::AgentArgs;

/// The agent's flags as a command of their own (the last occurrence of a flag wins, so the file's
/// values, put first, yield to the command line's).
#[derive(Debug, clap::Parser)]
#[command(name = "worker-agent", args_override_self = true)]
struct AgentCli {
    #[command(flatten)]
    args: AgentArgs,
}

/// The agent's flags from `argv` (its own arguments, without the program or subcommand name),
/// over the `worker_agent` section of the `--config` file they name, when they name one.
pub fn agent_args(argv: Vec<OsString>) -> Result<AgentArgs, ConfigError> {
    let parse = |extra: Vec<OsString>| {
        let all = std::iter::once(OsString::from("worker-agent"))
            .chain(extra)
            .chain(argv.iter().cloned());
        AgentCli::command()
            .try_get_matches_from(all)
            .and_then(|m| AgentCli::from_arg_matches(&m))
            .map(|c| c.args)
            .map_err(|e| invalid("worker_agent", e.to_string()))
    };
    let first = parse(Vec::new())?;
    let Some(path) = first.config.clone() else {
        return Ok(first);
    };
    let tree = Config::from_file(&path)?;
    parse(section_args(&tree.worker_agent, |v| {
        std::env::var_os(v).is_some()
    })?)
}

/// The section as flags: `--name value` per scalar, repeated per list item; keys whose flag's
/// environment variable `is_set` are left to it.
fn section_args(
    section: &BTreeMap<String, serde_yaml::Value>,
    is_set: impl Fn(&str) -> bool,
) -> Result<Vec<OsString>, ConfigError> {
    let cmd = AgentCli::command();
    let mut out = Vec::new();
    for (key, value) in section {
        let id = key.replace('-', "_");
        let Some(arg) = cmd.get_arguments().find(|a| a.get_id().as_str() == id) else {
            return Err(invalid(
                "worker_agent",
                format!("{key}: not a worker-agent flag"),
            ));
        };
        if arg.get_env().is_some_and(|v| is_set(&v.to_string_lossy())) || id == "config" {
            continue;
        }
        let flag = format!("--{}", arg.get_long().unwrap_or(&id));
        let items = match value {
            serde_yaml::Value::Sequence(s) => s.clone(),
            v => vec![v.clone()],
        };
        for item in items {
            let text = match item {
                serde_yaml::Value::String(s) => s,
                serde_yaml::Value::Bool(b) => b.to_string(),
                serde_yaml::Value::Number(n) => n.to_string(),
                other => {
                    return Err(invalid(
                        "worker_agent",
                        format!("{key}: {other:?} is not a flag value"),
                    ))
                }
            };
            out.push(OsString::from(format!("{flag}={text}")));
        }
    }
    Ok(out)
}

/// Checks a `worker_agent` section: every key a flag, every value a flag value.
pub(crate) fn check_section(
    section: &BTreeMap<String, serde_yaml::Value>,
) -> Result<(), ConfigError> {
    let args = section_args(section, |_| false)?;
    AgentCli::command()
        .try_get_matches_from(std::iter::once(OsString::from("worker-agent")).chain(args))
        .map(|_| ())
        .map_err(|e| invalid("worker_agent", e.to_string()))
}

fn invalid(field: &'static str, message: String) -> ConfigError {
    ConfigError::Invalid(vec![FieldError { field, message }])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(yaml: &str) -> BTreeMap<String, serde_yaml::Value> {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn the_section_is_flags_by_name_and_yields_to_the_environment() {
        let s = section(
            "component: pool\nengine-port: 9000\ntopology: [zone=a, rack=r1]\npod_ip: 10.0.0.9\n",
        );
        let args = section_args(&s, |v| v == "POD_IP").unwrap();
        let args: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--component=pool",
                "--engine-port=9000",
                "--topology=zone=a",
                "--topology=rack=r1"
            ],
            "pod_ip's variable is set: the environment wins"
        );
        let err = section_args(&section("no_such_flag: 1\n"), |_| false).unwrap_err();
        assert!(err.to_string().contains("no_such_flag"), "{err}");
    }

    #[test]
    fn flags_override_the_file_and_the_file_overrides_defaults() {
        let dir = kvepp_test_support::TempDir::new("agent-config");
        let file = dir.path().join("kvepp.yaml");
        std::fs::write(
            &file,
            "worker_agent: {component: from-file, engine_port: 9000, drain_seconds: 7}\n",
        )
        .unwrap();
        let argv = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        let f = file.to_string_lossy().into_owned();
        let a = agent_args(argv(&["--config", &f, "--engine-port", "9100"])).unwrap();
        assert_eq!(a.component, "from-file", "from the file");
        assert_eq!(a.engine_port, 9100, "the flag wins");
        assert_eq!(a.drain_seconds, 7);
        assert_eq!(a.check_interval_ms, 1000, "the default");
        std::fs::write(&file, "worker_agent: {engine_port: x}\n").unwrap();
        let err = agent_args(argv(&["--config", &f, "--component", "c"])).unwrap_err();
        assert!(err.to_string().contains("--engine-port"), "{err}");
    }
}
