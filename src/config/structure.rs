//! Structural errors, all of them: serde stops at the first, so the document is read, the field the
//! error names is repaired (removed, or a policy reset to its type alone), and it is read again,
//! until it parses or an error leaves nothing to repair (a missing required field).

use serde_json::{Map, Value};

use super::{deserialize_with_path, ConfigError, PolicyConfig, RouterConfig};

/// More than any real document has; each pass removes one field.
const MAX_PASSES: usize = 200;

/// Reads the document, appending every structural error to `errors`; `None` when it never parsed.
pub(super) fn read_all(mut value: Value, errors: &mut Vec<ConfigError>) -> Option<RouterConfig> {
    for _ in 0..MAX_PASSES {
        let error = match deserialize_with_path::<RouterConfig>(value.clone()) {
            Ok(config) => return Some(config),
            Err(e) => precise(&value, e),
        };
        let missing = error.message.starts_with("missing field");
        if !errors.iter().any(|e| e.path == error.path || error.path.starts_with(&format!("{}.", e.path))) {
            errors.push(error.clone());
        }
        if missing || !repair(&mut value, &error.path) {
            return None;
        }
    }
    None
}

/// A dropped option was reported by name: a dropped key is removed, a dropped policy type becomes
/// a plain policy so the rest of its group is still read.
pub(super) fn neutralize_dropped(value: &mut Value, path: &str) {
    if let Some((parent, key)) = split_last(path) {
        if let Some(Value::Object(map)) = at_mut(value, &parent) {
            if key == "type" {
                map.insert("type".into(), Value::String("round_robin".into()));
            } else {
                map.remove(&key);
            }
        }
    }
}

/// Serde reports errors inside an internally tagged policy at the policy itself; find the field.
fn precise(value: &Value, error: ConfigError) -> ConfigError {
    let Some(Value::Object(policy)) = at(value, &error.path) else { return error };
    let Some(kind) = policy.get("type") else { return error };
    if let Some(field) = error.message.strip_prefix("unknown field `").and_then(|m| m.split('`').next()) {
        return ConfigError::new(format!("{}.{field}", error.path), error.message.clone());
    }
    for (key, field) in policy.iter().filter(|(k, _)| *k != "type") {
        let alone = Value::Object(Map::from_iter([("type".to_string(), kind.clone()), (key.clone(), field.clone())]));
        if let Err(e) = serde_json::from_value::<PolicyConfig>(alone) {
            return ConfigError::new(format!("{}.{key}", error.path), e.to_string());
        }
    }
    error
}

/// Removes what `path` names so the next read gets past it. `false` when nothing could be removed.
fn repair(value: &mut Value, path: &str) -> bool {
    let Some((parent, key)) = split_last(path) else { return false };
    match at_mut(value, &parent) {
        Some(Value::Object(map)) => map.remove(&key).is_some(),
        Some(Value::Array(items)) => match key.parse::<usize>() {
            Ok(i) if i < items.len() => {
                items.remove(i);
                true
            }
            _ => false,
        },
        _ => false,
    }
}

/// `a.b[2].c` → segments `a`, `b`, `2`, `c`.
fn segments(path: &str) -> Vec<String> {
    path.split('.').flat_map(|part| part.split('[').map(|s| s.trim_end_matches(']').to_string())).collect()
}

fn split_last(path: &str) -> Option<(Vec<String>, String)> {
    if path.is_empty() || path.starts_with('(') {
        return None;
    }
    let mut parts = segments(path);
    let last = parts.pop()?;
    Some((parts, last))
}

fn at<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    if path.is_empty() || path.starts_with('(') {
        return None;
    }
    segments(path).iter().try_fold(value, |v, seg| match v {
        Value::Object(m) => m.get(seg),
        Value::Array(a) => seg.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

fn at_mut<'a>(value: &'a mut Value, parts: &[String]) -> Option<&'a mut Value> {
    parts.iter().try_fold(value, |v, seg| match v {
        Value::Object(m) => m.get_mut(seg),
        Value::Array(a) => seg.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
        _ => None,
    })
}
