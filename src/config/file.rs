//! Reads a router configuration file (YAML or JSON) into the validated type: the one loader of the
//! native tools (`sgl-envoy-router validate|render`, `sgl-indexer`). The filter gets its
//! configuration from Envoy as JSON instead ([`super::parse_and_validate`]).

use std::path::Path;

use super::{from_value, ConfigError, ConfigErrors, RouterConfig};

/// Reads and validates the file at `path`.
pub fn load_file(path: &Path) -> Result<RouterConfig, ConfigErrors> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigErrors(vec![ConfigError::new("(file)", format!("cannot read {}: {e}", path.display()))]))?;
    parse_document(&text)
}

/// Validates a YAML or JSON document: the same validation the filter runs at `on_configure`, so
/// the tools accept exactly what Envoy accepts.
pub fn parse_document(text: &str) -> Result<RouterConfig, ConfigErrors> {
    // YAML is a superset of JSON, so one parser takes both.
    let value: serde_json::Value =
        serde_yaml_ng::from_str(text).map_err(|e| ConfigErrors(vec![ConfigError::new("(document)", e.to_string())]))?;
    from_value(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_read_alike_and_a_missing_file_names_itself() {
        let yaml = "workers: [{id: A, url: 'http://10.0.0.1:1', model: m}]\nmodels: {m: {buckets: [{id: all, groups: {plain: {policy: {type: round_robin}}}}]}}\n";
        let json = r#"{"workers": [{"id": "A", "url": "http://10.0.0.1:1", "model": "m"}],
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]}}}"#;
        assert_eq!(parse_document(yaml).unwrap(), parse_document(json).unwrap());
        assert_eq!(parse_document("workers: [").unwrap_err().0[0].path, "(document)");
        let missing = load_file(Path::new("/nonexistent/router.yaml")).unwrap_err();
        assert_eq!(missing.0[0].path, "(file)");
        assert!(missing.0[0].message.contains("/nonexistent/router.yaml"));
    }
}
