//! The filter configuration the service follows (spec §8). Workers and models are configured in
//! one place, the HTTP filter's configuration, which Envoy delivers and replaces (LDS, ECDS, files
//! or a control plane); each filter root announces the configuration it was given, and the service
//! monitors exactly the workers of the newest one announced.

use serde::{Deserialize, Serialize};

use super::{keys, shared};
use crate::host::{Host, HostError};

/// What a filter root announces: its configuration as Envoy gave it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnnouncedConfig {
    pub text: String,
}

/// Announces `text` unless it is what was announced last; returns whether it announced. Every
/// filter VM of one configuration announces the same text, so only the first of them writes.
///
/// The newest configuration is the last one announced: Envoy configures a new filter
/// configuration's roots as it arrives and never configures an older one again, except when a VM
/// that crashed is reloaded while streams of the older configuration still run on it.
pub fn announce(host: &dyn Host, text: &str) -> Result<bool, HostError> {
    if let Some(current) = host.shared_get(keys::FILTER_CONFIG)? {
        if serde_json::from_slice::<AnnouncedConfig>(&current.bytes).is_ok_and(|c| c.text == text) {
            return Ok(false);
        }
    }
    let bytes = serde_json::to_vec(&AnnouncedConfig { text: text.to_string() })
        .map_err(|e| HostError::Failed(format!("configuration not encoded: {e}")))?;
    shared::publish(host, keys::FILTER_CONFIG, &bytes)?;
    Ok(true)
}

/// The service's view of the announcements.
#[derive(Debug)]
pub struct AnnouncedReader(shared::VersionedReader<AnnouncedConfig>);

impl Default for AnnouncedReader {
    fn default() -> Self {
        Self(shared::VersionedReader::new(keys::FILTER_CONFIG))
    }
}

impl AnnouncedReader {
    /// The configuration announced since the last call, if any.
    pub fn take_new(&mut self, host: &dyn Host) -> Option<String> {
        self.0.refresh(host).then(|| self.0.value().map(|c| c.text.clone())).flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    #[test]
    fn a_configuration_is_announced_once_and_read_once() {
        let host = MemoryHost::default();
        let mut reader = AnnouncedReader::default();
        assert_eq!(reader.take_new(&host), None);
        assert!(announce(&host, "one").unwrap());
        assert!(!announce(&host, "one").unwrap(), "the other VMs of the same configuration write nothing");
        assert_eq!(reader.take_new(&host).as_deref(), Some("one"));
        assert_eq!(reader.take_new(&host), None);
        assert!(announce(&host, "two").unwrap());
        assert!(announce(&host, "one").unwrap(), "going back is an update too");
        assert_eq!(reader.take_new(&host).as_deref(), Some("one"));
    }
}
