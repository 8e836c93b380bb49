//! Router configuration, a leaf that describes: serde types, validation with field paths, and
//! refusal of dropped options. The filter, the service, the CLI and the indexer all go through
//! [`parse_and_validate`]; what the configuration builds is built by `server::factory`.

mod dropped;
mod types;
mod validate;

use serde::de::DeserializeOwned;
pub use types::*;

/// One problem in a configuration, always tied to the field it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { path: path.into(), message: message.into() }
    }
}

/// Every problem found; a configuration is accepted only when this list is empty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", join(.0))]
pub struct ConfigErrors(pub Vec<ConfigError>);

fn join(errors: &[ConfigError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// Parses a JSON router configuration and validates it.
pub fn parse_and_validate(json: &str) -> Result<RouterConfig, ConfigErrors> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| ConfigErrors(vec![ConfigError::new("(document)", e.to_string())]))?;
    from_value(value)
}

/// Validates an already-parsed document (the CLI reads YAML into a JSON value first).
pub fn from_value(value: serde_json::Value) -> Result<RouterConfig, ConfigErrors> {
    let refused = dropped::find_dropped_options(&value);
    if !refused.is_empty() {
        return Err(ConfigErrors(refused));
    }
    let config: RouterConfig = deserialize_with_path(value).map_err(|e| ConfigErrors(vec![e]))?;
    let errors = validate::validate(&config);
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(errors))
    }
}

fn deserialize_with_path<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { "(document)".to_string() } else { path };
        ConfigError::new(path, e.into_inner().to_string())
    })
}

#[cfg(test)]
mod tests;
