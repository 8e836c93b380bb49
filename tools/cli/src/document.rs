//! Reads a router configuration file (YAML or JSON) into the core's validated type.

use std::path::Path;

use sgl_envoy_router::config::{self, ConfigError, ConfigErrors, RouterConfig};

pub fn load(path: &Path) -> Result<RouterConfig, ConfigErrors> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigErrors(vec![ConfigError::new("(file)", format!("cannot read {}: {e}", path.display()))]))?;
    parse(&text)
}

pub fn parse(text: &str) -> Result<RouterConfig, ConfigErrors> {
    // YAML is a superset of JSON, so one parser takes both.
    let value: serde_json::Value =
        serde_yaml_ng::from_str(text).map_err(|e| ConfigErrors(vec![ConfigError::new("(document)", e.to_string())]))?;
    // The same validation the filter runs at on_configure, so validate accepts exactly what Envoy
    // accepts (building the policies from a valid configuration cannot fail).
    config::from_value(value)
}
