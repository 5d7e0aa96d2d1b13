//! `manifest.json`'s JSON Schema (`docs/manifest.schema.json`, embedded), validated with
//! the `jsonschema` crate (Draft 2020-12), and its errors in words: each problem is
//! `"<key path>: expected <what>, got <value>"`. The library decides what is valid; this
//! module only words what it reports, the same way as the Python package's
//! `trainops.train.schema` words the `jsonschema` package's errors
//! (`tests/test_reader_contract.py` feeds the same manifests to both and compares).

use jsonschema::paths::LocationSegment;
use jsonschema::ValidationError;
use serde_json::Value;

/// The schema every manifest is validated against (a copy of `docs/manifest.schema.json`;
/// a test checks they are the same bytes).
pub const MANIFEST_SCHEMA: &str = include_str!("manifest.schema.json");

/// The `$schema` a schema must declare: the draft both readers validate with.
pub const DRAFT_2020_12: &str = "https://json-schema.org/draft/2020-12/schema";

/// A loaded schema: [`Validator::problems`] lists every violation of a JSON value.
#[derive(Debug)]
pub struct Validator {
    root: Value,
    inner: jsonschema::Validator,
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
        Validator::new(root).expect("the embedded schema is a valid Draft 2020-12 schema")
    }

    /// A validator of `schema`, which must declare Draft 2020-12 (`$schema`) and be valid
    /// against its meta-schema; else an error saying why.
    pub fn new(schema: Value) -> Result<Validator, String> {
        if schema.get("$schema").and_then(Value::as_str) != Some(DRAFT_2020_12) {
            return Err(format!("schema: expected \"$schema\": {DRAFT_2020_12:?}"));
        }
        let inner = jsonschema::draft202012::new(&schema).map_err(|e| format!("schema: {e}"))?;
        Ok(Validator { root: schema, inner })
    }

    /// Every way `value` violates the schema (empty: it is valid), each
    /// `"<key path>: expected ..., got ..."` (`states[0].dtype`).
    pub fn problems(&self, value: &Value) -> Vec<String> {
        self.inner.iter_errors(value).map(|e| self.problem(&e)).collect()
    }

    /// One error in words. Its keyword sits in the subschema at the error's schema path
    /// (canonical: a `$ref`'s target is named by its own location, `/$defs/file/pattern`);
    /// a failure inside a `$defs` entry with a `description` says that description.
    fn problem(&self, e: &ValidationError<'_>) -> String {
        let path = e.instance_path().segments().fold(String::new(), |p, s| match s {
            LocationSegment::Property(k) => key(&p, &k),
            LocationSegment::Index(i) => format!("{p}[{i}]"),
        });
        let at = if path.is_empty() { "(the manifest)" } else { &path };
        let pointer = e.schema_path().as_str();
        let parent = pointer.rsplit_once('/').map_or("", |(p, _)| p);
        let s = self.root.pointer(parent).unwrap_or(&Value::Null);
        let is_def = parent.strip_prefix("/$defs/").is_some_and(|name| !name.contains('/'));
        let desc = s.get("description").and_then(Value::as_str).filter(|_| is_def);
        let what = match e.kind() {
            jsonschema::error::ValidationErrorKind::Required { property } => {
                let k = property.as_str().unwrap_or_default();
                let p = s.get("properties").and_then(|p| p.get(k)).unwrap_or(&Value::Null);
                return format!("{}: required key is missing (expected {})", key(&path, k), self.expected(p));
            }
            kind => match kind.keyword() {
                "type" | "pattern" | "minimum" | "maximum" | "uniqueItems" => self.expected(s),
                "const" => show(&s["const"]),
                "enum" => self.expected(&serde_json::json!({ "enum": s["enum"] })),
                "oneOf" => self.expected(&serde_json::json!({ "oneOf": s["oneOf"] })),
                "not" => format!("{}, not {}", self.expected(s), self.expected(&s["not"])),
                "minLength" => format!("a string of at least {} character(s)", s["minLength"]),
                "minItems" => format!("an array of at least {} item(s)", s["minItems"]),
                _ => return format!("{at}: {e}"),
            },
        };
        format!("{at}: expected {}, got {}", desc.map_or(what, str::to_string), show(e.instance()))
    }

    /// The subschema `s` in words: a definition's `description` when `s` refers to one
    /// that has it, else its keywords.
    pub fn expected(&self, s: &Value) -> String {
        if let Some(r) = s.get("$ref").and_then(Value::as_str) {
            let t = self.root.pointer(r.trim_start_matches('#')).unwrap_or(&Value::Null);
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
        if t == "string" {
            if let Some(p) = s.get("pattern").and_then(Value::as_str) {
                words += &format!(" matching {p}");
            } else if s.get("minLength").and_then(Value::as_u64).unwrap_or(0) >= 1 {
                words = "a non-empty string".into();
            }
        }
        if t == "integer" || t == "number" {
            if let Some(m) = s.get("minimum") {
                words += &format!(" >= {m}");
            }
            if let Some(m) = s.get("maximum") {
                let and = if s.get("minimum").is_some() { " and" } else { "" };
                words += &format!("{and} <= {m}");
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
    fn only_valid_draft_2020_12_schemas_are_loaded() {
        assert!(Validator::new(json!({"type": "object"})).unwrap_err().contains("$schema"));
        let draft7 = json!({"$schema": "http://json-schema.org/draft-07/schema#"});
        assert!(Validator::new(draft7).is_err());
        assert!(Validator::new(json!({"$schema": DRAFT_2020_12, "type": 5})).is_err());
    }

    #[test]
    fn messages_name_the_key_and_what_was_expected() {
        let v = Validator::manifest();
        let p = v.problems(&json!({"format": "x", "checkpoint": "../x", "models": {"training": "..", "z": 1},
                                   "parameters": ["a", "a"], "options": {"key_seed": -1},
                                   "custom_ops": ["x"], "step": {"skip_output": 3},
                                   "data_inputs": [{"shape": [1, 2.5]}]}));
        let has = |s: &str| assert!(p.iter().any(|x| x == s), "{s}\n{p:#?}");
        let file = "a bare file name inside the artifacts folder (no '/', '\\' or NUL, and not '.' or '..')";
        has("format: expected \"trainops-artifacts\", got \"x\"");
        has(&format!("checkpoint: expected {file}, got \"../x\""));
        has(&format!("models.training: expected {file}, got \"..\""));
        has(&format!("models.eval: required key is missing (expected {file})"));
        has("parameters: expected a non-empty array, each item a graph input or output name (non-empty), without \
             repeats, got [\"a\",\"a\"]");
        has("options.key_seed: expected an integer >= 0 and <= 18446744073709551615, got -1");
        has("states: required key is missing (expected a non-empty array, each item an object)");
        has("custom_ops[0]: expected a string matching ^[A-Za-z0-9_.]+::[A-Za-z0-9_]+$, got \"x\"");
        has("step.skip_output: expected a graph input or output name (non-empty) or null, got 3");
        has("data_inputs[0].shape: expected an array, each item a size, a symbolic dimension's name, or null when \
             unknown or null, got [1,2.5]");
        assert_eq!(v.problems(&json!([])), vec!["(the manifest): expected an object, got []"]);
    }

    #[test]
    fn numbers_compare_exactly() {
        let v = Validator::manifest();
        let at = |seed: &str| {
            let options: Value = serde_json::from_str(&format!("{{\"key_seed\": {seed}}}")).unwrap();
            v.problems(&json!({"options": options})).into_iter().filter(|p| p.starts_with("options.key_seed")).count()
        };
        assert_eq!(at("18446744073709551615"), 0);
        assert_eq!(at("2.0"), 0);
        assert_eq!(at("18446744073709551616"), 1); // 2^64, a float here: past the maximum
        assert_eq!(at("2.5"), 1);
        assert_eq!(at("true"), 1);
    }

    #[test]
    fn patterns_end_at_the_end_of_the_string() {
        // ECMA-262's `$`, as the Python reader's: no match before a final newline.
        let v = Validator::manifest();
        let p = v.problems(&json!({"min_onnxruntime": "1.17.0\n"}));
        assert!(p.iter().any(|p| p.starts_with("min_onnxruntime: expected a string matching")), "{p:#?}");
    }
}
