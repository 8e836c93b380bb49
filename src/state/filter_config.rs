//! The filter configuration the service follows (spec §8). Workers and models are configured in
//! one place, the HTTP filter's configuration, which Envoy delivers and replaces (LDS, ECDS, files
//! or a control plane); each filter root announces the configuration it was given, and the service
//! monitors exactly the workers of the newest one announced.

use serde::{Deserialize, Serialize};

use super::{keys, shared};
use crate::host::{Host, HostError};

/// What a filter root announces: its configuration as Envoy gave it, and its generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnnouncedConfig {
    pub text: String,
    #[serde(default)]
    pub generation: u64,
}

/// What an announcement did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announced {
    /// The service follows it now.
    Followed,
    /// It is what the service follows already: every filter VM of one configuration announces it,
    /// and only the first writes.
    Already,
    /// An older generation than the one the service follows (a VM reloaded after a crash on the
    /// configuration it started with, or a listener not yet updated): not followed.
    Older { followed: u64 },
    /// Another configuration of the same generation is followed: generations name one text each.
    Conflict,
}

/// Announces `text` of `generation` to the service. The service follows the highest generation
/// it was announced. Generation 0 (a configuration that names none) comes before every other, and
/// among themselves such configurations are unordered: the last announced is followed, as Envoy
/// configures a new filter configuration's roots as it arrives.
pub fn announce(host: &dyn Host, text: &str, generation: u64) -> Result<Announced, HostError> {
    let mine = serde_json::to_vec(&AnnouncedConfig { text: text.to_string(), generation })
        .map_err(|e| HostError::Failed(format!("configuration not encoded: {e}")))?;
    let verdict = std::cell::Cell::new(Announced::Followed);
    let written = shared::publish_if(host, keys::FILTER_CONFIG, |current| {
        let current = current.and_then(|c| serde_json::from_slice::<AnnouncedConfig>(c).ok());
        let v = match current {
            None => Announced::Followed,
            Some(c) if c.text == text => Announced::Already,
            Some(c) if generation > c.generation || generation == 0 && c.generation == 0 => Announced::Followed,
            Some(c) if generation < c.generation => Announced::Older { followed: c.generation },
            Some(_) => Announced::Conflict,
        };
        verdict.set(v);
        (v == Announced::Followed).then(|| mine.clone())
    })?;
    Ok(if written { Announced::Followed } else { verdict.get() })
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
    fn an_unordered_configuration_is_announced_once_and_read_once() {
        let host = MemoryHost::default();
        let mut reader = AnnouncedReader::default();
        assert_eq!(reader.take_new(&host), None);
        assert_eq!(announce(&host, "one", 0).unwrap(), Announced::Followed);
        assert_eq!(announce(&host, "one", 0).unwrap(), Announced::Already, "the other VMs write nothing");
        assert_eq!(reader.take_new(&host).as_deref(), Some("one"));
        assert_eq!(reader.take_new(&host), None);
        assert_eq!(announce(&host, "two", 0).unwrap(), Announced::Followed);
        assert_eq!(announce(&host, "one", 0).unwrap(), Announced::Followed, "unordered: the last one wins");
        assert_eq!(reader.take_new(&host).as_deref(), Some("one"));
    }

    /// A VM reloaded on the configuration it started with (FAIL_RELOAD after a crash) announces
    /// an older generation: the service keeps following the newer one, whatever the order.
    #[test]
    fn an_older_generation_never_takes_the_service_back() {
        let host = MemoryHost::default();
        let mut reader = AnnouncedReader::default();
        assert_eq!(announce(&host, "old", 5).unwrap(), Announced::Followed);
        assert_eq!(announce(&host, "new", 7).unwrap(), Announced::Followed);
        assert_eq!(reader.take_new(&host).as_deref(), Some("new"));
        assert_eq!(announce(&host, "old", 5).unwrap(), Announced::Older { followed: 7 }, "the reload");
        assert_eq!(announce(&host, "other", 7).unwrap(), Announced::Conflict);
        assert_eq!(announce(&host, "unordered", 0).unwrap(), Announced::Older { followed: 7 }, "0 is before any");
        assert_eq!(announce(&host, "newest", 8).unwrap(), Announced::Followed);
        assert_eq!(reader.take_new(&host).as_deref(), Some("newest"));
        assert_eq!(reader.take_new(&host), None);
    }
}
