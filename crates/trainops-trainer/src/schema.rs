//! `manifest.json`'s JSON Schema (`docs/manifest.schema.json`, embedded) and a validator
//! of the part of JSON Schema 2020-12 it uses: the same keywords, the same meaning and
//! the same messages as the Python package's `trainops.train.schema`
//! (`tests/test_reader_contract.py` feeds the same manifests to both).
//!
//! Keywords: `type`, `const`, `enum`, `required`, `properties`, `additionalProperties`
//! (`false`), `items`, `minItems`, `uniqueItems`, `minLength`, `pattern` (`$` is the end of
//! the string, as in ECMA-262), `minimum`, `maximum`, `oneOf`, `not`, `$ref`
//! (`#/$defs/...`); annotations (`$schema`, `$id`, `title`, `description`, `$defs`) are
//! skipped. A schema with any other keyword is refused (a test loads the embedded one), so
//! the schema cannot outgrow the validator unnoticed. Numbers compare by value (`1 == 1.0`).

use std::cmp::Ordering;
use std::collections::HashMap;

use serde_json::{Map, Number, Value};

/// The schema every manifest is validated against (a copy of `docs/manifest.schema.json`;
/// a test checks they are the same bytes).
pub const MANIFEST_SCHEMA: &str = include_str!("manifest.schema.json");

const KEYWORDS: [&str; 16] = [
    "type",
    "const",
    "enum",
    "required",
    "properties",
    "additionalProperties",
    "items",
    "minItems",
    "uniqueItems",
    "minLength",
    "pattern",
    "minimum",
    "maximum",
    "oneOf",
    "not",
    "$ref",
];
const ANNOTATIONS: [&str; 5] = ["$schema", "$id", "title", "description", "$defs"];

/// A loaded schema: [`Validator::problems`] lists every violation of a JSON value.
pub struct Validator {
    root: Value,
    patterns: HashMap<String, regex_lite::Regex>,
}

/// JSON equality: numbers by value, `true` never equal to `1`, objects by keys.
pub fn json_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => cmp_numbers(x, y) == Some(Ordering::Equal),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_equal(a, b)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
        }
        _ => a == b,
    }
}

/// The exact order of two JSON numbers (an integer beyond 2^53 against a float too).
fn cmp_numbers(a: &Number, b: &Number) -> Option<Ordering> {
    fn int(n: &Number) -> Option<i128> {
        n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from))
    }
    match (int(a), int(b)) {
        (Some(x), Some(y)) => Some(x.cmp(&y)),
        (Some(x), None) => cmp_int_float(x, b.as_f64()?),
        (None, Some(y)) => cmp_int_float(y, a.as_f64()?).map(Ordering::reverse),
        (None, None) => a.as_f64()?.partial_cmp(&b.as_f64()?),
    }
}

fn cmp_int_float(i: i128, f: f64) -> Option<Ordering> {
    if f.is_nan() {
        return None;
    }
    // |i| < 2^65: a float beyond ±2^100 is beyond it; otherwise compare the integer part
    // exactly, then the fraction.
    if f >= 1e30 {
        return Some(Ordering::Less);
    }
    if f <= -1e30 {
        return Some(Ordering::Greater);
    }
    let floor = f.floor();
    match i.cmp(&(floor as i128)) {
        Ordering::Equal if f > floor => Some(Ordering::Less),
        o => Some(o),
    }
}

fn is_integer(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.is_i64() || n.is_u64() || n.as_f64().is_some_and(|f| f.is_finite() && f.fract() == 0.0),
        _ => false,
    }
}

fn is_type(v: &Value, t: &str) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "number" => v.is_number(),
        "integer" => is_integer(v),
        _ => false,
    }
}

fn type_words(t: &str) -> &'static str {
    match t {
        "object" => "an object",
        "array" => "an array",
        "string" => "a string",
        "integer" => "an integer",
        "number" => "a number",
        "boolean" => "a boolean",
        _ => "null",
    }
}

/// A value as the messages show it: compact JSON, cut at 80 characters.
pub(crate) fn show(v: &Value) -> String {
    let text = v.to_string();
    if text.chars().count() <= 80 {
        text
    } else {
        text.chars().take(77).collect::<String>() + "..."
    }
}

/// A number as Python prints it in the messages (`0`, `18446744073709551615`, `0.5`).
fn show_number(v: &Value) -> String {
    v.to_string()
}

fn key(path: &str, k: &str) -> String {
    if path.is_empty() {
        k.to_string()
    } else {
        format!("{path}.{k}")
    }
}

impl Validator {
    /// The validator of `manifest.schema.json`.
    pub fn manifest() -> Validator {
        let root = serde_json::from_str(MANIFEST_SCHEMA).expect("the embedded schema is JSON");
        Validator::new(root).expect("the embedded schema uses only the supported keywords")
    }

    /// A validator of `schema`; an error naming the first keyword it does not support.
    pub fn new(schema: Value) -> Result<Validator, String> {
        let mut v = Validator { root: Value::Null, patterns: HashMap::new() };
        v.root = schema.clone();
        v.check_keywords(&schema, "#")?;
        Ok(v)
    }

    fn check_keywords(&mut self, s: &Value, at: &str) -> Result<(), String> {
        let Some(map) = s.as_object() else { return Err(format!("schema {at}: expected an object")) };
        let mut unknown: Vec<&String> =
            map.keys().filter(|k| !KEYWORDS.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str())).collect();
        unknown.sort();
        if !unknown.is_empty() {
            return Err(format!("schema {at}: keywords {unknown:?} are not supported"));
        }
        if map.get("additionalProperties").is_some_and(|a| a != &Value::Bool(false)) {
            return Err(format!("schema {at}: additionalProperties must be false"));
        }
        for group in ["$defs", "properties"] {
            if let Some(Value::Object(subs)) = map.get(group) {
                for (k, sub) in subs {
                    self.check_keywords(sub, &format!("{at}/{group}/{k}"))?;
                }
            }
        }
        if let Some(Value::Array(branches)) = map.get("oneOf") {
            for (i, b) in branches.iter().enumerate() {
                self.check_keywords(b, &format!("{at}/oneOf/{i}"))?;
            }
        }
        for k in ["items", "not"] {
            if let Some(sub) = map.get(k) {
                self.check_keywords(sub, &format!("{at}/{k}"))?;
            }
        }
        if let Some(r) = map.get("$ref") {
            self.resolve(r.as_str().unwrap_or_default())?;
        }
        if let Some(Value::String(p)) = map.get("pattern") {
            let re = regex_lite::Regex::new(p).map_err(|e| format!("schema {at}: pattern {p:?}: {e}"))?;
            self.patterns.insert(p.clone(), re);
        }
        Ok(())
    }

    fn resolve(&self, r: &str) -> Result<&Value, String> {
        let name =
            r.strip_prefix("#/$defs/").ok_or(format!("schema: $ref {r:?}: only '#/$defs/<name>' is supported"))?;
        self.root.get("$defs").and_then(|d| d.get(name)).ok_or(format!("schema: $ref {r:?} names no definition"))
    }

    fn target(&self, s: &Value) -> &Value {
        self.resolve(s["$ref"].as_str().unwrap_or_default()).expect("checked when loaded")
    }

    /// The subschema `s` in words: a definition's `description` when `s` refers to one
    /// that has it, else its keywords.
    pub fn expected(&self, s: &Value) -> String {
        if s.get("$ref").is_some() {
            let t = self.target(s);
            return match t.get("description").and_then(Value::as_str) {
                Some(d) => d.to_string(),
                None => self.expected(t),
            };
        }
        if let Some(c) = s.get("const") {
            return show(c);
        }
        if let Some(Value::Array(e)) = s.get("enum") {
            return format!("one of {}", e.iter().map(show).collect::<Vec<_>>().join(", "));
        }
        if let Some(Value::Array(b)) = s.get("oneOf") {
            return b.iter().map(|b| self.expected(b)).collect::<Vec<_>>().join(" or ");
        }
        let Some(t) = s.get("type").and_then(Value::as_str) else { return "a value".into() };
        let mut words = type_words(t).to_string();
        let min_len = s.get("minLength").and_then(Value::as_u64).unwrap_or(0);
        if t == "string" {
            if let Some(p) = s.get("pattern").and_then(Value::as_str) {
                words += &format!(" matching {p}");
            } else if min_len >= 1 {
                words = "a non-empty string".into();
            }
        }
        if t == "integer" || t == "number" {
            if let Some(m) = s.get("minimum") {
                words += &format!(" >= {}", show_number(m));
            }
            if let Some(m) = s.get("maximum") {
                let and = if s.get("minimum").is_some() { " and" } else { "" };
                words += &format!("{and} <= {}", show_number(m));
            }
        }
        if t == "array" {
            if s.get("minItems").and_then(Value::as_u64).unwrap_or(0) >= 1 {
                words = "a non-empty array".into();
            }
            if let Some(items) = s.get("items") {
                words += &format!(", each item {}", self.expected(items));
            }
            if s.get("uniqueItems") == Some(&Value::Bool(true)) {
                words += ", without repeats";
            }
        }
        words
    }

    /// Every way `value` violates the schema (empty: it is valid), each
    /// `"<key path>: expected ..., got ..."` (`states[0].dtype`).
    pub fn problems(&self, value: &Value) -> Vec<String> {
        let mut out = Vec::new();
        self.check(value, &self.root, "", &mut out, None);
        out
    }

    fn is_valid(&self, value: &Value, s: &Value) -> bool {
        let mut out = Vec::new();
        self.check(value, s, "", &mut out, None);
        out.is_empty()
    }

    /// Appends to `out` the violations of `s` by `v` at `path`; `desc`: the description
    /// of the definition `s` is (through `$ref`), for the messages.
    fn check(&self, v: &Value, s: &Value, path: &str, out: &mut Vec<String>, desc: Option<&str>) {
        let at = if path.is_empty() { "(the manifest)" } else { path };
        let bad = |out: &mut Vec<String>, what: String| {
            out.push(format!("{at}: expected {}, got {}", desc.unwrap_or(&what), show(v)));
        };
        if s.get("$ref").is_some() {
            let t = self.target(s);
            self.check(v, t, path, out, t.get("description").and_then(Value::as_str));
        }
        if let Some(t) = s.get("type") {
            let fits = match t {
                Value::String(t) => is_type(v, t),
                Value::Array(ts) => ts.iter().any(|t| is_type(v, t.as_str().unwrap_or_default())),
                _ => true,
            };
            if !fits {
                bad(out, self.expected(s));
                return;
            }
        }
        if let Some(c) = s.get("const") {
            if !json_equal(v, c) {
                bad(out, show(c));
            }
        }
        if let Some(Value::Array(e)) = s.get("enum") {
            if !e.iter().any(|x| json_equal(v, x)) {
                bad(out, self.expected(&serde_json::json!({ "enum": e })));
            }
        }
        if let Some(Value::Array(b)) = s.get("oneOf") {
            if b.iter().filter(|b| self.is_valid(v, b)).count() != 1 {
                bad(out, self.expected(&serde_json::json!({ "oneOf": b })));
            }
        }
        if let Some(n) = s.get("not") {
            if self.is_valid(v, n) {
                bad(out, format!("{}, not {}", self.expected(s), self.expected(n)));
            }
        }
        if let Value::String(text) = v {
            let min_len = s.get("minLength").and_then(Value::as_u64).unwrap_or(0);
            // JSON Schema counts characters (code points), as Python's len()
            if (text.chars().count() as u64) < min_len {
                bad(out, format!("a string of at least {min_len} character(s)"));
            }
            if let Some(Value::String(p)) = s.get("pattern") {
                if !self.patterns[p].is_match(text) {
                    bad(out, self.expected(s));
                }
            }
        }
        if let Value::Number(n) = v {
            if let Some(Value::Number(m)) = s.get("minimum") {
                if cmp_numbers(n, m).is_none_or(|o| o == Ordering::Less) {
                    bad(out, self.expected(s));
                }
            }
            if let Some(Value::Number(m)) = s.get("maximum") {
                if cmp_numbers(n, m).is_none_or(|o| o == Ordering::Greater) {
                    bad(out, self.expected(s));
                }
            }
        }
        if let Value::Array(items) = v {
            let min = s.get("minItems").and_then(Value::as_u64).unwrap_or(0);
            if (items.len() as u64) < min {
                bad(out, format!("an array of at least {min} item(s)"));
            }
            if s.get("uniqueItems") == Some(&Value::Bool(true)) {
                for (i, j) in repeats(items) {
                    out.push(format!(
                        "{path}[{j}]: expected no repeats, got {} again (also {path}[{i}])",
                        show(&items[j])
                    ));
                }
            }
            if let Some(item) = s.get("items") {
                for (i, x) in items.iter().enumerate() {
                    self.check(x, item, &format!("{path}[{i}]"), out, None);
                }
            }
        }
        if let Value::Object(map) = v {
            self.check_object(map, s, path, out);
        }
    }

    fn check_object(&self, map: &Map<String, Value>, s: &Value, path: &str, out: &mut Vec<String>) {
        let empty = Map::new();
        let props = s.get("properties").and_then(Value::as_object).unwrap_or(&empty);
        if let Some(Value::Array(required)) = s.get("required") {
            for k in required.iter().filter_map(Value::as_str) {
                if !map.contains_key(k) {
                    let what = props.get(k).map_or_else(|| "a value".to_string(), |p| self.expected(p));
                    out.push(format!("{}: required key is missing (expected {what})", key(path, k)));
                }
            }
        }
        let closed = s.get("additionalProperties") == Some(&Value::Bool(false));
        for (k, item) in map {
            match props.get(k) {
                Some(p) => self.check(item, p, &key(path, k), out, None),
                None if closed => {
                    let mut names: Vec<&String> = props.keys().collect();
                    names.sort();
                    let names: Vec<&str> = names.into_iter().map(String::as_str).collect();
                    out.push(format!("{}: unknown key (expected one of {})", key(path, k), names.join(", ")));
                }
                None => {}
            }
        }
    }
}

/// `(first, again)` index pairs of equal items.
fn repeats(items: &[Value]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    let mut strings: HashMap<&str, usize> = HashMap::new();
    let mut others: Vec<usize> = Vec::new();
    for (j, v) in items.iter().enumerate() {
        if let Value::String(s) = v {
            match strings.get(s.as_str()) {
                Some(&i) => found.push((i, j)),
                None => {
                    strings.insert(s, j);
                }
            }
        } else {
            match others.iter().find(|&&i| json_equal(&items[i], v)) {
                Some(&i) => found.push((i, j)),
                None => others.push(j),
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_embedded_schema_is_the_documented_one() {
        let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/manifest.schema.json");
        assert_eq!(std::fs::read_to_string(docs).unwrap(), MANIFEST_SCHEMA);
        Validator::manifest();
    }

    #[test]
    fn unsupported_keywords_are_refused() {
        let e = Validator::new(json!({"type": "object", "patternProperties": {}})).err().unwrap();
        assert_eq!(e, "schema #: keywords [\"patternProperties\"] are not supported");
        assert!(Validator::new(json!({"additionalProperties": true})).is_err());
    }

    #[test]
    fn numbers_compare_by_value() {
        assert!(json_equal(&json!(1), &json!(1.0)));
        assert!(!json_equal(&json!(true), &json!(1)));
        let big: Value = serde_json::from_str("18446744073709551616").unwrap(); // 2^64 as f64
        let max = json!(u64::MAX);
        let (Value::Number(b), Value::Number(m)) = (&big, &max) else { unreachable!() };
        assert_eq!(cmp_numbers(b, m), Some(Ordering::Greater));
        assert_eq!(cmp_numbers(m, b), Some(Ordering::Less));
        let half = json!(0.5);
        let zero = json!(0);
        let (Value::Number(h), Value::Number(z)) = (&half, &zero) else { unreachable!() };
        assert_eq!(cmp_numbers(h, z), Some(Ordering::Greater));
        assert!(is_integer(&json!(2.0)) && !is_integer(&json!(2.5)) && !is_integer(&json!("2")));
    }

    #[test]
    fn messages_name_the_key_and_what_was_expected() {
        let v = Validator::manifest();
        let p = v.problems(&json!({"format": "x", "checkpoint": "../x", "models": {"training": "..", "z": 1},
                                   "parameters": ["a", "a"], "options": {"key_seed": -1}}));
        let has = |s: &str| assert!(p.iter().any(|x| x == s), "{s}\n{p:#?}");
        has("format: expected \"trainops-artifacts\", got \"x\"");
        has("checkpoint: expected a bare file name inside the artifacts folder (no '/', '\\' or NUL, and not '.' or '..'), got \"../x\"");
        has("models.training: expected a bare file name inside the artifacts folder (no '/', '\\' or NUL, and not '.' or '..'), got \"..\"");
        has("models.eval: required key is missing (expected a bare file name inside the artifacts folder (no '/', '\\' or NUL, and not '.' or '..'))");
        has("parameters[1]: expected no repeats, got \"a\" again (also parameters[0])");
        has("options.key_seed: expected an integer >= 0 and <= 18446744073709551615, got -1");
        has("states: required key is missing (expected a non-empty array, each item an object)");
        assert_eq!(v.problems(&json!([])), vec!["(the manifest): expected an object, got []"]);
        let closed =
            Validator::new(json!({"properties": {"a": {"type": "integer"}}, "additionalProperties": false})).unwrap();
        assert_eq!(closed.problems(&json!({"a": 1.0, "b": 2})), vec!["b: unknown key (expected one of a)"]);
    }
}
