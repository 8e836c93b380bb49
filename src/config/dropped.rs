//! Options that design §7 deliberately dropped. They are refused by name with the reason, before
//! deserialization could answer with a generic "unknown variant".

use serde_json::Value;

use super::ConfigError;

const DROPPED_POLICIES: &[(&str, &str)] = &[
    ("fused_score", "fused-score selection was removed; choose one policy per group"),
    ("score_policy", "score-policy selection was removed; choose one policy per group"),
    ("legacy_host_affinity", "legacy host affinity was removed; use session_aware or sticky"),
];

const DROPPED_KEYS: &[(&str, &str)] = &[
    ("fuse", "fused-score terms and weights were removed with fused_score"),
    ("stable_pair", "stable prefill/decode pairing was removed; both engines come from one bucket"),
    ("affinity_mode", "only strict admitted-binding reuse remains; the soft mode was removed"),
    ("prefix_cache_min_share", "the prefix-share filter was removed; it is not the cache_aware minimum hit"),
    (
        "priority_header",
        "a client's own priority is not trusted: name classes under `queue.classes` and choose one with \
         `queue.class_header`, set at a trusted hop",
    ),
];

pub(super) fn find_dropped_options(value: &Value) -> Vec<ConfigError> {
    let mut found = Vec::new();
    walk(value, "", &mut found);
    found
}

fn walk(value: &Value, path: &str, found: &mut Vec<ConfigError>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let child_path = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
                if let Some((_, why)) = DROPPED_KEYS.iter().find(|(k, _)| k == key) {
                    found.push(ConfigError::new(&child_path, format!("`{key}` is not supported: {why}")));
                    continue;
                }
                if key == "type" {
                    if let Some(name) = child.as_str() {
                        if let Some((_, why)) = DROPPED_POLICIES.iter().find(|(p, _)| *p == name) {
                            found.push(ConfigError::new(
                                &child_path,
                                format!("policy `{name}` is not supported: {why}"),
                            ));
                        }
                    }
                }
                if key == "filter" && child.as_str() == Some("prefix_cache") {
                    found.push(ConfigError::new(
                        &child_path,
                        "`prefix_cache` filter is not supported: the prefix-share filter was removed",
                    ));
                }
                walk(child, &child_path, found);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                walk(child, &format!("{path}[{i}]"), found);
            }
        }
        _ => {}
    }
}
